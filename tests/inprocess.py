"""The ledger client over the in-process chain: the real `LedgerClient`'s typed reads, with its two
primitive reads (one key, one prefix) answered from the harness's committed state, so that real verifier
daemons tick against a chain that a test drives block by block (`LiveCommittee`). Daemons tick side by
side, as they run, and their transactions share blocks as on a chain whose blocks come slower than the
daemons submit (`Rounds`). Nothing is proven: the state is the app's own."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from committee import Script
from harness import AppHarness, sqlite_url
from modelnodes import make_node
from overlaynet import start_apart
from waiting import run

from planetserve.chain.client import LedgerClient, Listing, Submitted
from planetserve.chain.keys import KeySet
from planetserve.chain.messages.base import Message
from planetserve.chain.rpc import TxOutcome
from planetserve.models import load
from planetserve.node.model_node import ModelNode
from planetserve.registry.epochs import Schedule
from planetserve.registry.params import Params
from planetserve.verifier import ReferenceModel
from planetserve.verifier.challenges import ChallengeSource
from planetserve.verifier.config import RECHALLENGE_SHARE
from planetserve.verifier.coverage import SILENT_ESCAPE
from planetserve.verifier.daemon import Daemon
from planetserve.verifier.overlay import OverlayChannel

T = TypeVar("T")


class _Status:
    """What the daemon asks the endpoint directly: the latest height."""

    def __init__(self, h: AppHarness) -> None:
        self.h = h

    def status(self) -> dict[str, Any]:
        return {"sync_info": {"latest_block_height": str(self.h.height)}}

    def close(self) -> None:
        return None


class InProcessLedger(LedgerClient):
    def __init__(self, h: AppHarness, rounds: Rounds) -> None:
        super().__init__(_Status(h), None)  # type: ignore[arg-type]
        self.h = h
        self.rounds = rounds

    @contextlib.contextmanager
    def snapshot(self, height: int | None = None) -> Iterator[int]:
        yield self.h.height

    def _entries(self, prefix: bytes) -> Listing:
        with self.rounds.reading:
            return Listing(self.h.height, list(self.h.store.batch().iterate(prefix)), False)

    def value(self, key: bytes, since: int | None = None) -> tuple[int, bytes | None]:
        with self.rounds.reading:
            return self.h.height, self.h.store.batch().get(key)

    def submit(self, keys: KeySet, msg: Message, timeout: float = 30.0) -> Submitted:
        raw = self.h.tx(keys, msg.TYPE, msg.body())
        result, height = self.rounds.submit(keys.public, raw)
        return Submitted(hashlib.sha256(raw).digest(), height,
                         TxOutcome(code=result.code, data=result.data, log=result.log))

    def verified_outcome(self, done: Submitted) -> Submitted:
        return done


def answered(daemons: Iterable[Daemon]) -> None:
    """Wait for the answers to every challenge the daemons have out."""
    concurrent.futures.wait([f for daemon in daemons for f in list(daemon.pending.values())], timeout=300)


class Rounds:
    """Blocks as a chain makes them for daemons running side by side: in a round every daemon ticks at
    once, in a thread of its own; a transaction waits for its block, which is made once each daemon
    still ticking waits on one, and carries all of theirs (in key order). Before each block the
    answers to what was sent are waited for, so that a node answers at the height it was asked at, and
    daemons done ticking send what their schedules hold for it, as they would on seeing the block."""

    def __init__(self, h: AppHarness) -> None:
        self.h = h
        self.daemons: dict[bytes, Daemon] = {}
        self.turn = threading.Condition()
        self.reading = threading.Lock()
        """Held by each read and by each block: the store is read from several threads."""
        self.ticking: set[bytes] = set()
        self.waiting: dict[bytes, bytes] = {}
        self.made: dict[bytes, tuple[Any, int]] = {}

    def tick_all(self) -> None:
        """Every daemon's tick at the chain's height, side by side; then an empty block, which every
        daemon sees."""
        with self.turn:
            self.ticking = set(self.daemons)
        with concurrent.futures.ThreadPoolExecutor(len(self.daemons), thread_name_prefix="tick") as ticks:
            for done in [ticks.submit(self._tick, member) for member in sorted(self.daemons)]:
                done.result()
        self.block()
        self.see_block()

    def block(self, *txs: bytes) -> Any:
        with self.reading:
            return self.h.block(*txs)

    def see_block(self, daemons: Iterable[Daemon] | None = None) -> None:
        """Each daemon (of `daemons`, by default all) sends what its schedule holds for the next block;
        the answers are waited for."""
        daemons = list(self.daemons.values() if daemons is None else daemons)
        for daemon in daemons:
            daemon.send_scheduled(self.h.height + 1)
        answered(daemons)

    def submit(self, member: bytes, raw: bytes) -> tuple[Any, int]:
        """The outcome of `raw` and its block's height, once the block that carries it is made."""
        with self.turn:
            if member not in self.ticking:  # outside a round: a block of its own
                return self.block(raw).tx_results[0], self.h.height
            self.waiting[member] = raw
            self._make_if_all_wait()
            while member not in self.made:
                self.turn.wait()
            return self.made.pop(member)

    def _tick(self, member: bytes) -> None:
        try:
            self.daemons[member].tick()
        finally:
            with self.turn:
                self.ticking.discard(member)
                self._make_if_all_wait()

    def _make_if_all_wait(self) -> None:
        if not self.waiting or self.waiting.keys() != self.ticking:
            return
        answered(self.daemons.values())
        members = sorted(self.waiting)
        result = self.block(*(self.waiting[m] for m in members))
        self.made.update((m, (r, self.h.height)) for m, r in zip(members, result.tx_results, strict=True))
        self.waiting.clear()
        self.turn.notify_all()
        self.see_block(d for m, d in self.daemons.items() if m not in self.ticking and m not in members)


@dataclass
class LiveCommittee:
    """Four members' real daemons doing all of their work (proofs, plans, the leader's challenges,
    re-challenges, attestations) block by block on the in-process chain, asking through a real user
    relay an honest node of org1 and `node`, of org2: real model nodes that do not forward to each other."""

    s: Script
    daemons: dict[bytes, Daemon]
    honest: ModelNode
    node: ModelNode
    rounds: Rounds

    @property
    def schedule(self) -> Schedule:
        return self.s.schedule

    def epoch(self, each: Callable[[], None] = lambda: None) -> int:
        """Through the epoch of the next block to its end, where it is finalized, calling `each` before every
        round of ticks; its number."""
        number = self.schedule.epoch_of(self.s.h.height + 1)
        while self.schedule.epoch_of(self.s.h.height) <= number:
            each()
            self.rounds.tick_all()
        return number


def live_committee(data: Path, tmp_path: Path, params: Params, node: ModelNode, play: Callable[[LiveCommittee], T],
                   share: float = RECHALLENGE_SHARE, escape: float = SILENT_ESCAPE) -> T:
    """`play` on a LiveCommittee with `node` (its `cheap` engine, if any, closed after), the chain's
    clock starting now so that the nodes' signed times fall in its slack; the daemons re-challenge a
    `share` of the nodes whatever the leader's result, raised where four members need more for a silent
    node to escape at most `escape` of epochs (verifier/coverage.py; by default, as the daemon's, every
    node)."""
    reference = ReferenceModel.from_loaded(load("gt", data), model_id="gt")

    def committee(relay: str, honest: ModelNode) -> T:
        s = Script(AppHarness(sqlite_url(tmp_path), members=4, params=params, genesis_time=int(time.time())),
                   nodes=0)
        s.register_node(s.owner, "org1", honest.keys, honest.config.address)
        other = KeySet.generate()
        assert s.block(s.tx(other, "register-org", {"org_id": "org2", "name": "Org Two"})) == [(0, "ok")]
        s.register_node(other, "org2", node.keys, node.config.address)
        channel = OverlayChannel(relay, max_tokens=64)
        length = lambda text: len(honest.tokenizer(text)["input_ids"])  # noqa: E731
        rounds = Rounds(s.h)
        daemons = rounds.daemons
        for key, member in s.members.items():
            (tmp_path / key.hex()).mkdir()
            daemons[key] = Daemon(member, InProcessLedger(s.h, rounds), {"gt": reference}, channel,
                                  ChallengeSource("mixed", scale=0.05, max_prompt_len=256, length=length),
                                  tmp_path / key.hex(), rechallenge_share=share, silent_escape=escape)
        try:
            return play(LiveCommittee(s, daemons, honest, node, rounds))
        finally:
            for daemon in daemons.values():
                daemon.pool.shutdown(wait=False, cancel_futures=True)

    async def main() -> T:
        honest = make_node(data)
        net = await start_apart([honest, node])
        try:
            return await asyncio.to_thread(committee, net.client.http_url, honest)
        finally:
            await net.close()
            cheap = getattr(node, "cheap", None)
            if cheap is not None:
                await cheap.close()

    return run(main(), timeout=1500)
