"""The ledger client over the in-process chain: the real `LedgerClient`'s typed reads, with its two
primitive reads (one key, one prefix) answered from the harness's committed state and each submitted
transaction carried by a block of its own, so that real verifier daemons tick against a chain that a test
drives block by block (`LiveCommittee`). Nothing is proven: the state is the app's own."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
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
from planetserve.verifier.coverage import KEEP_SHARE
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
    def __init__(self, h: AppHarness) -> None:
        super().__init__(_Status(h), None)  # type: ignore[arg-type]
        self.h = h
        self.watchers: list[Daemon] = []
        """Daemons that see each block this one's submissions make, as daemons running beside each other
        would: each sends the re-challenges its schedule holds for the next block."""

    @contextlib.contextmanager
    def snapshot(self, height: int | None = None) -> Iterator[int]:
        yield self.h.height

    def _entries(self, prefix: bytes) -> Listing:
        return Listing(self.h.height, list(self.h.store.batch().iterate(prefix)), False)

    def value(self, key: bytes, since: int | None = None) -> tuple[int, bytes | None]:
        return self.h.height, self.h.store.batch().get(key)

    def submit(self, keys: KeySet, msg: Message, timeout: float = 30.0) -> Submitted:
        raw = self.h.tx(keys, msg.TYPE, msg.body())
        [result] = self.h.block(raw).tx_results
        see_block(self.h, self.watchers)
        return Submitted(hashlib.sha256(raw).digest(), self.h.height,
                         TxOutcome(code=result.code, data=result.data, log=result.log))

    def verified_outcome(self, done: Submitted) -> Submitted:
        return done


def see_block(h: AppHarness, daemons: Iterable[Daemon]) -> None:
    """Each daemon sends what its schedule holds for the next block, as it would on seeing the block just
    made; the answers are waited for, so that a node answers at the height it was asked at."""
    daemons = list(daemons)
    for daemon in daemons:
        daemon.send_scheduled(h.height + 1)
    concurrent.futures.wait([f for daemon in daemons for f in daemon.pending.values()], timeout=300)


def tick_all(h: AppHarness, daemons: Iterable[Daemon]) -> None:
    """Each daemon's tick at the chain's height, waiting for the answers to what it sent before the next
    one ticks (so that a node answers at the height it was asked at); then an empty block, which every
    daemon sees."""
    daemons = list(daemons)
    for daemon in daemons:
        daemon.tick()
        concurrent.futures.wait(list(daemon.pending.values()), timeout=300)
    h.block()
    see_block(h, daemons)


@dataclass
class LiveCommittee:
    """Four members' real daemons doing all of their work (proofs, plans, the leader's challenges,
    re-challenges, attestations) block by block on the in-process chain, asking through a real user
    relay an honest node of org1 and `node`, of org2: real model nodes that do not forward to each other."""

    s: Script
    daemons: dict[bytes, Daemon]
    honest: ModelNode
    node: ModelNode

    @property
    def schedule(self) -> Schedule:
        return self.s.schedule

    def epoch(self, each: Callable[[], None] = lambda: None) -> int:
        """Through the epoch of the next block to its end, where it is finalized, calling `each` before every
        round of ticks; its number."""
        number = self.schedule.epoch_of(self.s.h.height + 1)
        while self.schedule.epoch_of(self.s.h.height) <= number:
            each()
            tick_all(self.s.h, self.daemons.values())
        return number


def live_committee(data: Path, tmp_path: Path, params: Params, node: ModelNode, play: Callable[[LiveCommittee], T],
                   share: float = RECHALLENGE_SHARE, escape: float = KEEP_SHARE) -> T:
    """`play` on a LiveCommittee with `node` (its `cheap` engine, if any, closed after), the chain's
    clock starting now so that the nodes' signed times fall in its slack; the daemons re-challenge a
    `share` of the nodes whatever the leader's result, raised where four members need more for a silent
    node to escape at most `escape` of epochs (verifier/coverage.py). Unlike the daemon's, this default
    keeps `share`: this chain makes a block of each transaction, and with every member re-challenging
    every node the closing-window test's chain ran past its deadlines between ticks."""
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
        daemons = {}
        for key, member in s.members.items():
            (tmp_path / key.hex()).mkdir()
            daemons[key] = Daemon(member, InProcessLedger(s.h), {"gt": reference}, channel,
                                  ChallengeSource("mixed", scale=0.05, max_prompt_len=256, length=length),
                                  tmp_path / key.hex(), rechallenge_share=share, silent_escape=escape)
        for daemon in daemons.values():
            daemon.ledger.watchers = list(daemons.values())
        try:
            return play(LiveCommittee(s, daemons, honest, node))
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
