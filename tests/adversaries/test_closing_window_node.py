"""A model node that cheats where members' re-challenges used not to reach: an epoch's closing windows and
the next epoch's first blocks (docs/threat-model.md, "Recognising challenges"). Reading the daemon, it
knows that an epoch's own re-challenges stop at `last_rechallenge`, so that their answers are revealed
where every member must attest them, and that the next leader's challenges start `SETTLE_BLOCKS` into
the next epoch; between the two it serves a cheaper model (tiny), and the model it registered elsewhere.
Members now commit the next epoch's re-challenges as soon as its plan is, send them from
`first_rechallenge`, in those windows, and reveal the answers once it starts.

Four members' real daemons tick block by block against the in-process chain, doing all of an epoch's
work themselves (proofs, plans, the leader's challenges, re-challenges, attestations), and ask through a
real user relay; the node and an honest one beside it are real model nodes. Every epoch in which a member's
secret offset put a re-challenge of the node in that window, its cheap answer is revealed and scored, and
its C(T) is cut; the epochs it escapes are exactly the others. The honest node and the members are never
touched."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from committee import EPOCH_PARAMS, HONEST, Script
from harness import AppHarness, sqlite_url
from inprocess import InProcessLedger
from modelnodes import PartlyCheapNode, cheap_engine, make_node
from overlaynet import start_apart
from waiting import run

from planetserve.chain import layout
from planetserve.chain.keys import KeySet
from planetserve.models import load
from planetserve.node.model_node import Job, ModelNode
from planetserve.registry.epochs import ChallengeResult, Schedule
from planetserve.registry.reputation import ReputationRule
from planetserve.verifier import ReferenceModel
from planetserve.verifier import daemon as daemon_module
from planetserve.verifier.challenges import ChallengeSource
from planetserve.verifier.daemon import (
    SETTLE_BLOCKS,
    Daemon,
    first_rechallenge,
    last_rechallenge,
    rechallenge_cutoff,
)
from planetserve.verifier.overlay import OverlayChannel

PARAMS = replace(EPOCH_PARAMS, epoch_blocks=40, results_blocks=16, vrf_window_blocks=10, plan_window_blocks=14,
                 response_slack_seconds=3_600)
"""The localnet's epochs. The in-process chain's clock runs 5 s a block, ahead of the nodes' own: the
answers they sign by their clocks stay within the slack."""
SCHEDULE = Schedule.from_params(PARAMS)
RULE = ReputationRule.from_params(PARAMS)
MAX_EPOCHS = 20
"""Epochs played until the node is caught. Each honest member sends its re-challenge of the node (a coin
of 2/3) from an offset in [-12, 31], 13 of the 44 in the window: a member catches it with probability
about 1/5, one of three about 0.5 an epoch, and all twenty epochs escape about 1e-6 of the time."""


class ClosingWindowNode(PartlyCheapNode):
    """Cheats whenever the block to come lies after its epoch's `last_rechallenge` or before the next
    leader's start, as it reads the ledger's height; records the height each prompt came at, and those
    it cheated on."""

    height: Callable[[], int]
    asked: dict[str, int]
    cheated: dict[str, int]

    def cheats(self, job: Job) -> bool:
        upcoming = self.asked[job.prompt] = self.height() + 1
        if not unchecked_before(upcoming):
            return False
        self.cheated[job.prompt] = upcoming
        return True


def unchecked_before(height: int) -> bool:
    """Whether block `height` lay where no re-challenge came before the next epoch's were sent early:
    after its epoch's last one, or before the leader starts."""
    return (height > last_rechallenge(SCHEDULE, SCHEDULE.epoch_of(height))
            or SCHEDULE.offset(height) < min(SETTLE_BLOCKS, PARAMS.results_blocks // 2))


@dataclass(frozen=True)
class Played:
    number: int
    cheap: list[int]
    """Heights at which the node answered a re-challenge of this epoch, revealed, with the cheap model, where
    the members' attestations tell the answer from the registered model's (a short greedy answer that both
    models end alike is no cheat)."""
    credibility: int
    """The node's C(T) this epoch."""


def results(s: Script, number: int) -> list[ChallengeResult]:
    return layout.decode_records(list(s.h.store.batch().iterate(layout.result_prefix(number))), ChallengeResult)


def tick_all(s: Script, daemons: dict[bytes, Daemon]) -> None:
    """Each daemon's tick at the chain's height, waiting for the answers to what it sent before the next
    one ticks (so that the node answers at the height it was asked at); then an empty block."""
    for daemon in daemons.values():
        daemon.tick()
        concurrent.futures.wait(list(daemon.pending.values()), timeout=300)
    s.h.block()


def test_a_node_cheating_in_the_closing_windows_meets_the_next_epochs_re_challenges(quick_family, tmp_path,
                                                                                     monkeypatch):
    monkeypatch.setattr(daemon_module, "RETRY_DELAY_S", 0.0)
    assert first_rechallenge(SCHEDULE, 2) - SCHEDULE.start(2) == -12  # sent from offset 28 of the epoch before
    reference = ReferenceModel.from_loaded(load("gt", quick_family), model_id="gt")

    def committee(relay: str, honest: ModelNode, node: ClosingWindowNode) -> tuple[Script, list[Played]]:
        s = Script(AppHarness(sqlite_url(tmp_path), members=4, params=PARAMS, genesis_time=int(time.time())),
                   nodes=0)
        s.register_node(s.owner, "org1", honest.keys, honest.config.address)
        other = KeySet.generate()
        assert s.block(s.tx(other, "register-org", {"org_id": "org2", "name": "Org Two"})) == [(0, "ok")]
        s.register_node(other, "org2", node.keys, node.config.address)
        node.height = lambda: s.h.height
        channel = OverlayChannel(relay, max_tokens=64)
        length = lambda text: len(honest.tokenizer(text)["input_ids"])  # noqa: E731
        daemons = {}
        for key, member in s.members.items():
            (tmp_path / key.hex()).mkdir()
            daemons[key] = Daemon(member, InProcessLedger(s.h), {"gt": reference}, channel,
                                  ChallengeSource("mixed", scale=0.05, max_prompt_len=256, length=length),
                                  tmp_path / key.hex())
        played: list[Played] = []
        try:
            while len(played) < MAX_EPOCHS and not (played and played[-1].cheap):
                number = SCHEDULE.epoch_of(s.h.height + 1)
                while SCHEDULE.epoch_of(s.h.height) <= number:
                    tick_all(s, daemons)
                if number == 0:
                    continue
                cheap = sorted(node.cheated[r.prompt] for r in results(s, number)
                               if r.node == node.keys.public and r.prompt in node.cheated and any(
                                   score < HONEST for _, score, _ in s.state.attestations(number, r.node, r.submitter)))
                # every re-challenge of the epoch came once its tags could be committed, and early enough for
                # its answer to be revealed before the epoch's closing windows
                sent = [node.asked[r.prompt] for r in results(s, number)
                        if r.node == node.keys.public and r.kind == "rechallenge" and r.prompt in node.asked]
                assert all(first_rechallenge(SCHEDULE, number) <= height < rechallenge_cutoff(SCHEDULE, number)
                           for height in sent), (number, sent)
                rep = s.state.reputation(node.keys.public)
                assert rep is not None and rep.last_epoch == number, f"epoch {number} did not score the node"
                played.append(Played(number, cheap, rep.window[-1]))
                leader = s.epoch(number).leader  # its answers of re-challenges it sent before it was elected
                assert {(r.node, r.kind) for r in results(s, number) if r.submitter == leader} == {
                    (honest.keys.public, "leader"), (node.keys.public, "leader")}  # go unrevealed
                honest_rep = s.state.reputation(honest.keys.public)
                assert honest_rep.last_epoch == number and honest_rep.trusted, honest_rep
            assert all(d.status["rejected"] == 0 for d in daemons.values()), [d.status for d in daemons.values()]
            return s, played
        finally:
            for daemon in daemons.values():
                daemon.pool.shutdown(wait=False, cancel_futures=True)

    async def main() -> tuple[Script, list[Played]]:
        honest, node = make_node(quick_family), make_node(quick_family, ClosingWindowNode)
        node.asked, node.cheated = {}, {}
        node.cheap = cheap_engine(quick_family, node)
        net = await start_apart([honest, node])  # neither forwards to the other
        try:
            return await asyncio.to_thread(committee, net.client.http_url, honest, node)
        finally:
            await net.close()
            await node.cheap.close()

    s, played = run(main(), timeout=1500)
    *escaped, last = played
    assert last.cheap, f"not caught in {MAX_EPOCHS} epochs: {played}"
    # caught: a re-challenge sent in the closing windows of the epoch before, or before its leader started,
    # met the cheap model, and its answer cut the node's C(T)
    assert all(unchecked_before(height) for height in last.cheap)
    assert last.credibility < RULE.abnormal, played
    # the epochs it escaped had no re-challenge there: only honest answers were scored
    assert all(not e.cheap and e.credibility >= RULE.abnormal for e in escaped), escaped
    assert all(s.faults(m) == [] for m in s.members)
