"""A model node paid for serving no one: it answers in the few blocks where the leader's challenge comes
(from `SETTLE_BLOCKS` into the epoch) and refuses every other request, users' and members' re-challenges
alike (docs/threat-model.md, "Told its challenge by a colluding member"). Each re-challenge it refuses is
a member's report, and reports from members holding more than a third of the power cut its C(T). A
member's daemon re-challenges at once every node another member found without a valid answer, so one
member's report brings the others': the node is cut in an epoch in which a single member's coin came up
for it, where before the coins of members holding more than a third of the power had to.

Four members' real daemons tick block by block on the in-process chain (`LiveCommittee`); the node and an
honest one beside it are real model nodes behind a real user relay."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from committee import EPOCH_PARAMS
from inprocess import LiveCommittee, live_committee
from modelnodes import make_node

from planetserve.node.api.openai import overloaded
from planetserve.node.model_node import ModelNode
from planetserve.registry.epochs import VALID, Schedule
from planetserve.verifier import daemon as daemon_module
from planetserve.verifier.daemon import SETTLE_BLOCKS

PARAMS = replace(EPOCH_PARAMS, epoch_blocks=40, results_blocks=16, vrf_window_blocks=10, plan_window_blocks=14,
                 response_slack_seconds=3_600)
"""The localnet's epochs; the in-process chain's clock runs ahead of the nodes' own, within the slack."""
SCHEDULE = Schedule.from_params(PARAMS)
ANSWERING = range(SETTLE_BLOCKS, SETTLE_BLOCKS + 4)
"""The offsets at which the node answers: where the leader's challenge comes."""
SHARE = 1 / 3
"""Each member's coin for re-challenging a node whatever the leader's result: a third, so that epochs in
which one member's coin comes up and another's does not are common."""
MAX_EPOCHS = 16
"""Epochs played until one in which a member whose coin did not come up reported the node: about one in
two, so all sixteen miss about 1e-5 of the time."""


class SilentNode(ModelNode):
    """Refuses (503, as an overloaded node would) every request but those in the `ANSWERING` offsets of
    its epoch, by the ledger's height."""

    height: Callable[[], int]

    async def produce(self, job, prompt_ids, generation, options, *, whole=False):  # type: ignore[no-untyped-def]
        if SCHEDULE.offset(self.height() + 1) not in ANSWERING:
            raise overloaded()
        return await super().produce(job, prompt_ids, generation, options, whole=whole)


@dataclass(frozen=True)
class Played:
    number: int
    reporters: list[bytes]
    followers: list[bytes]
    """Reporters whose own coin did not come up for the node, in an epoch whose leader had its valid
    answer: they re-challenged it on another member's report."""
    credibility: int


def test_one_members_report_brings_every_members_re_challenge(quick_family, tmp_path, monkeypatch):
    monkeypatch.setattr(daemon_module, "RETRY_DELAY_S", 0.0)

    def play(c: LiveCommittee) -> list[Played]:
        node, s = c.node, c.s
        assert isinstance(node, SilentNode)
        node.height = lambda: s.h.height
        key = node.keys.public
        played: list[Played] = []
        while len(played) < MAX_EPOCHS and not (played and played[-1].followers):
            number = c.epoch()
            if number == 0:
                continue
            reporters = s.state.reports(number, key)
            leader = s.epoch(number).leader
            answered = any(r.submitter == leader and r.status == VALID for r in c.results(number) if r.node == key)
            followers = [m for m in reporters if answered and m != leader and not c.daemons[m]._sampled(number, key)]
            rep = s.state.reputation(key)
            assert rep is not None and rep.last_epoch == number, f"epoch {number} did not score the node"
            played.append(Played(number, reporters, followers, rep.window[-1]))
            honest = s.state.reputation(c.honest.keys.public)
            assert honest.last_epoch == number and honest.trusted, honest
        assert all(s.faults(m) == [] for m in s.members)
        return played

    node = make_node(quick_family, SilentNode)
    *before, last = live_committee(quick_family, tmp_path, PARAMS, node, play, share=SHARE)
    assert last.followers, f"no member followed another's report in {MAX_EPOCHS} epochs: {[*before, last]}"
    # one member's coin was enough: the others re-challenged the node on its report, and it was cut
    assert len(last.reporters) >= 2 and last.credibility == 0, last
    # every epoch in which members holding more than a third of the power reported it cut it, and no other
    assert all((len(e.reporters) >= 2) == (e.credibility == 0) for e in before), before
