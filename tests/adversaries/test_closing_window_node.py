"""A model node that cheats where members' re-challenges used not to reach: an epoch's closing windows and
the next epoch's first blocks (docs/threat-model.md, "Recognising challenges"). Reading the daemon, it
knows that an epoch's own re-challenges stop at `last_rechallenge`, so that their answers are revealed
where every member must attest them, and that the next leader's challenges start `SETTLE_BLOCKS` into
the next epoch; between the two it serves a cheaper model (tiny), and the model it registered elsewhere.
Members now commit the next epoch's re-challenges as soon as its plan is, send them from
`first_rechallenge`, in those windows, and reveal the answers once it starts.

Four members' real daemons, at their defaults, tick side by side against the in-process chain, doing all
of an epoch's work themselves (proofs, plans, the leader's challenges, re-challenges, attestations), and
ask through a real user relay; the node and an honest one beside it are real model nodes. Every epoch in
which a member's secret offset put a re-challenge of the node in that window (four members each
re-challenge every node by default), its cheap answer is revealed and scored, and its C(T) is cut; the
epochs it escapes are exactly the others. The honest node and the members are never touched."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from committee import EPOCH_PARAMS, HONEST
from inprocess import LiveCommittee, live_committee
from modelnodes import PartlyCheapNode, cheap_engine, make_node

from planetserve.chain.errors import Code
from planetserve.node.model_node import Job
from planetserve.registry.epochs import Schedule
from planetserve.registry.reputation import ReputationRule
from planetserve.verifier import daemon as daemon_module
from planetserve.verifier.daemon import (
    first_rechallenge,
    last_rechallenge,
    leader_start,
    rechallenge_cutoff,
)

PARAMS = replace(EPOCH_PARAMS, epoch_blocks=40, results_blocks=16, vrf_window_blocks=10, plan_window_blocks=14,
                 response_slack_seconds=3_600)
"""The localnet's epochs. The in-process chain's clock runs 5 s a block, ahead of the nodes' own: the
answers they sign by their clocks stay within the slack."""
SCHEDULE = Schedule.from_params(PARAMS)
RULE = ReputationRule.from_params(PARAMS)
MAX_EPOCHS = 16
"""Epochs played until the node is caught. Each honest member re-challenges every node (four members, at
the default `silent_escape`) from an offset in [-12, 27], 17 of the 40 in the window: a member catches it
with probability about 0.43, one of three about 0.81 an epoch, and all sixteen epochs escape about 1e-11
of the time."""


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
    number = SCHEDULE.epoch_of(height)
    return height > last_rechallenge(SCHEDULE, number) or height < leader_start(SCHEDULE, number)


@dataclass(frozen=True)
class Played:
    number: int
    cheap: list[int]
    """Heights at which the node answered a re-challenge of this epoch, revealed, with the cheap model, where
    the members' attestations tell the answer from the registered model's (a short greedy answer that both
    models end alike is no cheat)."""
    credibility: int
    """The node's C(T) this epoch."""


def test_a_node_cheating_in_the_closing_windows_meets_the_next_epochs_re_challenges(quick_family, tmp_path,
                                                                                     monkeypatch):
    monkeypatch.setattr(daemon_module, "RETRY_DELAY_S", 0.0)
    assert first_rechallenge(SCHEDULE, 2) - SCHEDULE.start(2) == -12  # sent from offset 28 of the epoch before

    def play(c: LiveCommittee) -> list[Played]:
        node, s = c.node, c.s
        assert isinstance(node, ClosingWindowNode)
        node.height = lambda: s.h.height
        played: list[Played] = []
        while len(played) < MAX_EPOCHS and not (played and played[-1].cheap):
            number = c.epoch()
            if number == 0:
                continue
            results = s.results(number)
            cheap = sorted(node.cheated[r.prompt] for r in results
                           if r.node == node.keys.public and r.prompt in node.cheated and any(
                               score < HONEST for _, score, _ in s.state.attestations(number, r.node, r.submitter)))
            # every re-challenge of the epoch came once its tags could be committed, and early enough for its
            # answer to be revealed where every member must attest it
            sent = [node.asked[r.prompt] for r in results
                    if r.node == node.keys.public and r.kind == "rechallenge" and r.prompt in node.asked]
            assert all(first_rechallenge(SCHEDULE, number) <= height < rechallenge_cutoff(SCHEDULE, number)
                       for height in sent), (number, sent)
            rep = s.state.reputation(node.keys.public)
            assert rep is not None and rep.last_epoch == number, f"epoch {number} did not score the node"
            played.append(Played(number, cheap, rep.window[-1]))
            leader = s.epoch(number).leader  # its answers of re-challenges it sent before it was elected
            assert {(r.node, r.kind) for r in results if r.submitter == leader} == {
                (c.honest.keys.public, "leader"), (node.keys.public, "leader")}  # go unrevealed
            honest = s.state.reputation(c.honest.keys.public)
            assert honest.last_epoch == number and honest.trusted, honest
        # nothing refused (the leader did not reveal a re-challenge answer of the node it went on to challenge),
        # but an attestation of a result revealed in the epoch's last blocks that landed after its end
        refused = [entry for d in c.daemons.values() for entry in d.submissions.read() if entry["code"]
                   and not (entry["type"] == "attest" and entry["code"] == Code.EXPIRED)]
        assert not refused, refused
        assert all(s.faults(m) == [] for m in s.members)
        return played

    node = make_node(quick_family, ClosingWindowNode)
    node.asked, node.cheated = {}, {}
    node.cheap = cheap_engine(quick_family, node)
    *escaped, last = live_committee(quick_family, tmp_path, PARAMS, node, play)
    assert last.cheap, f"not caught in {MAX_EPOCHS} epochs: {[*escaped, last]}"
    # caught: a re-challenge sent in the closing windows of the epoch before, or before its leader started,
    # met the cheap model, and its answer cut the node's C(T)
    assert all(unchecked_before(height) for height in last.cheap)
    assert last.credibility < RULE.abnormal, last
    # the epochs it escaped had no re-challenge there: only honest answers were scored
    assert all(not e.cheap and e.credibility >= RULE.abnormal for e in escaped), escaped
