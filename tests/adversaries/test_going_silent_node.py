"""A model node paid for serving no one: a colluding member opens the plan and tells it its challenge
each epoch; it answers that one request with the model it registered and refuses every other, users'
and members' re-challenges alike (docs/threat-model.md, "Drops requests or stays silent"). Each
re-challenge it refuses is a member's report, and reports from members holding more than a third of the
power cut its C(T). At the configured share of two thirds, four members' coins left it unreported in
26% of epochs (55% where the colluder does not lead); daemons at the default `silent_escape`, 0.01
(`SILENT_ESCAPE`), raise the share until a silent node escapes at most that share of epochs, counting on
neither the leader nor a colluding third of the power (verifier/coverage.py): with four members, every
member re-challenges every node.

Four members' real daemons, at their defaults, tick side by side on the in-process chain
(`LiveCommittee`); the node and an honest one beside it are real model nodes behind a real user relay."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from committee import EPOCH_PARAMS
from inprocess import LiveCommittee, live_committee
from modelnodes import TippedNode, make_node

from planetserve.node.api.openai import ApiError, overloaded
from planetserve.registry.epochs import INVALID, PLAN_COMMITTED, VALID
from planetserve.verifier import daemon as daemon_module

PARAMS = replace(EPOCH_PARAMS, epoch_blocks=40, results_blocks=16, vrf_window_blocks=10, plan_window_blocks=14,
                 response_slack_seconds=3_600)
"""The localnet's epochs; the in-process chain's clock runs ahead of the nodes' own, within the slack."""
EPOCHS = 3
"""Scored epochs played: at the configured share alone, the two or three honest members but the leader
all re-challenge the node in one epoch with probability at most 0.67 ** 2, in all three with 9%."""


@dataclass(frozen=True)
class Played:
    number: int
    leader_answered: bool
    honest: set[bytes]
    """The members but the epoch's leader and the colluder."""
    reporters: set[bytes]
    """Members that revealed a re-challenge of the node it did not answer."""
    credibility: int

    def __repr__(self) -> str:
        name = lambda keys: sorted(k.hex()[:8] for k in keys)  # noqa: E731
        return (f"epoch {self.number}: leader answered {self.leader_answered}, honest followers "
                f"{name(self.honest)}, reporters {name(self.reporters)}, C(T) {self.credibility}")


def as_the_relay() -> ApiError:
    """What a user relay answers when it cannot send now: a verifier tries such a challenge again later."""
    return ApiError(503, "Only 0 anonymous path(s) survive; 3 are needed.", type="server_error",
                    code="too_few_paths")


@pytest.mark.parametrize(("refusal", "epochs"), [(overloaded, EPOCHS), (as_the_relay, 1)],
                         ids=["overloaded", "as the relay"])
def test_a_node_silent_on_all_but_its_told_challenge_is_re_challenged_and_reported_by_every_honest_member(
        quick_family, tmp_path, monkeypatch, refusal, epochs):
    """Refusing as an overloaded node, or in the relay's words that it cannot send now (which a relay
    marks as its own, so a node saying them is not believed: it was tried again and never reported)."""
    monkeypatch.setattr(daemon_module, "RETRY_DELAY_S", 0.0)

    def play(c: LiveCommittee) -> list[Played]:
        node, s = c.node, c.s
        assert isinstance(node, TippedNode) and node.cheap is None
        key = node.keys.public
        colluder = min(s.members)
        reference = c.daemons[colluder].references["gt"]

        def tell() -> None:
            """The colluder opens its copy of each committed plan's challenge of the node: the tip."""
            for number in {c.schedule.epoch_of(s.h.height + 1), c.schedule.epoch_of(s.h.height + 1) + 1}:
                record = s.state.epoch(number)
                if record is not None and record.plan_status == PLAN_COMMITTED:
                    told = s.planned(number, key, s.members[colluder])
                    earlier = told.turns()[:-1]  # sent first, each as a completion or a chat
                    node.told |= {told.prompt, *earlier, *(reference.chat_prompt(t) for t in earlier)}

        played: list[Played] = []
        while len(played) < epochs:
            number = c.epoch(tell)
            if number == 0:
                continue
            leader = s.epoch(number).leader
            results = [r for r in s.results(number) if r.node == key]
            rep = s.state.reputation(key)
            assert rep is not None and rep.last_epoch == number, f"epoch {number} did not score the node"
            played.append(Played(
                number, any(r.submitter == leader and r.kind == "leader" and r.status == VALID for r in results),
                set(s.members) - {leader, colluder},
                {r.submitter for r in results if r.kind == "rechallenge" and r.status == INVALID},
                rep.window[-1]))
            honest = s.state.reputation(c.honest.keys.public)
            assert honest.last_epoch == number and honest.trusted, honest
        assert all(s.faults(m) == [] for m in s.members), {m.hex()[:8]: s.faults(m) for m in s.members}
        return played

    node = make_node(quick_family, TippedNode)
    node.told = set()  # and no cheap engine: it answers nothing else
    node.refusal = refusal
    played = live_committee(quick_family, tmp_path, PARAMS, node, play)
    # the leader had the node's answer to its challenge; every honest member but the leader re-challenged the
    # node and was refused, and their reports alone, more than a third of the power, cut it every epoch
    for e in played:
        assert e.leader_answered and e.honest <= e.reporters and 3 * len(e.honest) > 4 and e.credibility == 0, e
