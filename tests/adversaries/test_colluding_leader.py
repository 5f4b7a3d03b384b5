"""A member that tells a model node its challenge, and the node that takes the tip (docs/threat-model.md,
"Learns or leaks the challenges"). Every member can open every sealed challenge, so a member colluding
with a node can tell it, epoch after epoch, which request is its challenge; the node answers that one with
the model it registered and every other request as it likes. Two such nodes run here behind a real
overlay: one answers the rest with a cheaper model (tiny), the other answers nothing else at all (a node
paid for serving no one). The leader's and the members' real daemons ask through a real user relay, score
with the reference model and submit on the in-process chain; the colluding member attests its partner's
answers as honest.

Each honest member re-challenges the node on its own secret coin (`Daemon._sampled`, at the configured
share alone: `silent_escape` 1 here, where the default raises the share to every node with four members,
tests/adversaries/test_going_silent_node.py). In every epoch in
which enough coins came up (one for the cheap node, whose cheap answer is scored, unless it happens to be
the registered model's own, as a short greedy answer can be; members holding more
than a third of the power for the idle one, whose silence is reported), the node's C(T) is cut and its
organisation earns nothing for the epoch; the epochs it escapes are exactly the others. The honest node
beside it and every honest member are never touched. A colluder that withholds its attestations of the
cheap answers instead, while another member is away, lets the node escape the epoch and is faulted for
withholding them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from committee import EPOCH_PARAMS, HONEST, Script, finish
from inprocess import LiveCommittee, live_committee
from modelnodes import TippedNode, cheap_engine, make_node

from planetserve.chain.keys import KeySet
from planetserve.registry import finalization
from planetserve.registry.epochs import VALID, ChallengeResult
from planetserve.registry.reputation import ReputationRule
from planetserve.verifier import daemon as daemon_module
from planetserve.verifier.config import RECHALLENGE_SHARE
from planetserve.verifier.coverage import KEEP_SHARE
from planetserve.verifier.daemon import Daemon

PARAMS = replace(EPOCH_PARAMS, response_slack_seconds=3_600)
"""The in-process chain's clock runs 5 s a block, ahead of the nodes' own: the answers they sign by their
clocks stay within the slack."""
RULE = ReputationRule.from_params(PARAMS)
MAX_EPOCHS = 16
"""Epochs played until the node is caught. The idle node escapes an epoch with probability 0.26 (the
colluder leads) to 0.55 (an honest member leads, and two coins must come up): all sixteen about 1e-5."""


@dataclass(frozen=True)
class Played:
    number: int
    samplers: int
    """Honest members whose coin came up for the tipped node (the leader does not re-challenge)."""
    told_apart: int
    """Those of them whose reference model told its answer from the registered model's: a cheap answer
    that is the registered model's own (a short greedy one that both models end alike) is no cheat."""
    credibility: int
    """The tipped node's C(T) this epoch."""
    earned: int
    """What its organisation earned for the epoch."""


def answered(daemon: Daemon, number: int) -> dict[str, list]:
    """The daemon's entries of epoch `number` once every challenge it sent came back."""
    for future in list(daemon.pending.values()):
        future.result(timeout=300)
    return daemon.results(number)


def play(s: Script, daemons: dict[bytes, Daemon], colluder: KeySet, tipped: TippedNode, honest: bytes,
         number: int, withhold: bool = False, away: bytes | None = None) -> Played:
    """Epoch `number`, from its start to its end and the next one's plan. At its start every member but
    the leader commits a challenge of each planned node, as the daemon does (`_commit_tags`); each sends
    only those its coin picks. The colluder attests its partner's answers as honest, or, `withhold`ing,
    attests none of its re-challenged ones; the member `away` does nothing at all."""
    node = tipped.keys.public
    tipped.told.add(s.planned(number, node, colluder).prompt)  # the colluder opens its copy: the tip
    leader = s.leader(number)
    present = {member: daemon for member, daemon in daemons.items() if member != away}
    own = {member: dict(zip((honest, node), daemon._fresh("gt", 2), strict=True))
           for member, daemon in present.items() if member != leader.public}
    tagged = s.block(*(s.tx(s.members[member], "commit-rechallenge",
                            {"epoch": number, "tags": [c.tag(planned) for planned, c in challenges.items()]})
                       for member, challenges in own.items()))
    assert all(code == 0 for code, _ in tagged), tagged
    lead = daemons[leader.public]
    for planned in (honest, node):
        lead._ask((number, planned, "leader"), s.planned(number, planned, leader), s.state.node(planned))
    entries = answered(lead, number)["leader"]
    assert s.block(s.tx(leader, "submit-results", {"epoch": number, "kind": "leader", "results": entries})) \
        == [(0, "ok")]

    samplers = 0
    for member, challenges in own.items():
        daemon = daemons[member]
        for planned, challenge in challenges.items():
            if (member == colluder.public and planned == node) or not daemon._sampled(number, planned):
                continue
            samplers += planned == node
            daemon._ask((number, planned, "rechallenge"), challenge, s.state.node(planned))
    reveals = [s.tx(s.members[member], "submit-results", {"epoch": number, "kind": "rechallenge",
                                                          "results": entries})
               for member, daemon in present.items() if (entries := answered(daemon, number)["rechallenge"])]
    assert all(code == 0 for code, _ in s.block(*reveals))

    valid = [r for r in s.results(number) if r.status == VALID]
    attestations = []
    for member, daemon in present.items():
        covering = member == colluder.public
        scores = [[r.node, r.submitter, *((HONEST, 0) if covering and r.node == node
                                          else daemon._attested_score(number, r))]
                  for r in valid if not (covering and withhold and r.node == node and r.kind == "rechallenge")]
        attestations.append(s.tx(s.members[member], "attest", {"epoch": number, "scores": sorted(scores)}))
    assert all(code == 0 for code, _ in s.block(*attestations))

    before = s.state.credits("org2").earned
    finish(s, number)
    assert s.state.reputation(honest).window[-1] == HONEST and s.state.reputation(honest).trusted
    told_apart = sum(daemons[member].scores.get((number, node, member), (HONEST, 0))[0] < HONEST
                     for member in own if member != colluder.public)
    return Played(number, samplers, told_apart, s.state.reputation(node).window[-1],
                  s.state.credits("org2").earned - before)


Epochs = Callable[[Script, dict[bytes, Daemon], KeySet, TippedNode, bytes], list[Played]]
"""Plays epochs from the first: the chain, the members' daemons, the colluder (epoch 1's leader), the
tipped node and the honest node's key."""


def collude(quick_family: Path, tmp_path: Path, cheap: bool, epochs: Epochs, share: float = RECHALLENGE_SHARE,
            ) -> tuple[Script, KeySet, list[Played]]:
    """An honest node and a tipped one (answering the rest with tiny where `cheap`) behind a real overlay,
    four members' real daemons reading the in-process chain, and the epochs played (the test, not the
    daemons' ticks, drives each epoch)."""

    def play(c: LiveCommittee) -> tuple[Script, KeySet, list[Played]]:
        assert isinstance(c.node, TippedNode)
        c.s.run_election_and_plan(1)
        colluder = c.s.leader(1)
        return c.s, colluder, epochs(c.s, c.daemons, colluder, c.node, c.honest.keys.public)

    tipped = make_node(quick_family, TippedNode)
    tipped.told = set()
    tipped.cheap = cheap_engine(quick_family, tipped) if cheap else None
    return live_committee(quick_family, tmp_path, PARAMS, tipped, play, share, KEEP_SHARE)


@pytest.mark.parametrize("cheap", [True, False], ids=["cheap", "idle"])
def test_a_node_told_its_challenge_by_a_colluding_member_is_caught_wherever_it_cheats(
        quick_family, tmp_path, monkeypatch, cheap):
    monkeypatch.setattr(daemon_module, "RETRY_DELAY_S", 0.0)

    def caught(epoch: Played) -> bool:
        """Enough coins came up: one scored cheap answer that is not the registered model's own, or reports
        from more than a third of the power (four members of equal power)."""
        return epoch.told_apart >= 1 if cheap else 3 * epoch.samplers > 4

    def until_caught(s: Script, daemons: dict[bytes, Daemon], colluder: KeySet, tipped: TippedNode,
                     honest: bytes) -> list[Played]:
        played: list[Played] = []
        while len(played) < MAX_EPOCHS and not (played and caught(played[-1])):
            played.append(play(s, daemons, colluder, tipped, honest, len(played) + 1))
        return played

    s, colluder, played = collude(quick_family, tmp_path, cheap, until_caught)
    *escaped, last = played
    assert caught(last), f"not caught in {MAX_EPOCHS} epochs: {played}"
    # an epoch without enough coins is one the node escapes: its told answer alone is scored, and paid
    assert all(not caught(e) and e.credibility == HONEST and e.earned > 0 for e in escaped), escaped
    # caught: cut, and nothing earned for the epoch
    assert last.earned == 0
    assert last.credibility < RULE.abnormal if cheap else last.credibility == 0
    honest_members = [m for m in s.members if m != colluder.public]
    assert all(s.faults(m) == [] for m in honest_members)
    # the colluder's cover is on the record: where the node's cheap answer was scored, its attestation
    # of it strays from the median; where the node answered nothing else, there was nothing to cover
    assert ("deviating-attestation" in s.faults(colluder.public)) == cheap


def test_a_colluding_member_that_withholds_its_attestations_is_faulted_for_it(quick_family, tmp_path, monkeypatch):
    """Rather than attest its partner's cheap answers as honest (a `deviating-attestation`), the colluder
    attests none of them, while another member is away: two of four members attest them, not more than
    2/3 of the power, so they do not count and the node escapes the epoch. The chain records the
    withholding against the colluder; the away member's validator missed the epoch, which is its fault
    already; the members who attested are not touched. Every present member re-challenges every node
    (share 1), so the epoch has re-challenges to withhold."""
    monkeypatch.setattr(daemon_module, "RETRY_DELAY_S", 0.0)

    def withheld(s: Script, daemons: dict[bytes, Daemon], colluder: KeySet, tipped: TippedNode,
                 honest: bytes) -> list[Played]:
        away = min(m for m in s.members if m != colluder.public)
        s.h.absent = {s.h.consensus[list(s.members).index(away)].public}
        return [play(s, daemons, colluder, tipped, honest, 1, withhold=True, away=away)]

    s, colluder, [epoch] = collude(quick_family, tmp_path, True, withheld, share=1.0)
    away = min(m for m in s.members if m != colluder.public)
    assert epoch.samplers == 2 and epoch.credibility == HONEST and epoch.earned > 0  # escaped the epoch
    assert s.faults(colluder.public) == ["withheld-attestation"]
    assert s.faults(away) == ["missed-blocks"]
    assert all(s.faults(m) == [] for m in s.members if m not in (colluder.public, away))


@pytest.mark.parametrize(("height", "attesters", "absent", "withheld"), [
    (7, 2, {"c"}, ["d"]), (7, 2, set(), ["c", "d"]), (7, 3, set(), []), (8, 2, set(), [])],
    ids=["away-excused", "both", "attested", "late"])
def test_members_that_leave_a_timely_result_unattested_withheld_it(height, attesters, absent, withheld):
    """The pure rule: four members of equal power, results due for attestation below height 8. A result
    that two attested (not more than 2/3) was withheld by each other member whose validator was not
    absent, one finding each; none where three attested, or where it came at height 8."""
    node, (a, b, c, d) = b"n" * 32, (bytes([x]) * 32 for x in b"abcd")
    names = {a: "a", b: "b", c: "c", d: "d"}
    answer = ChallengeResult(node, a, "leader", VALID, "", "p", b"s" * 32, {"token_ids": [5]}, HONEST, height)
    evidence = finalization.Evidence(
        leader=a, plan_nodes=[node], results={node: [answer]},
        attestations={(node, a): [(m, HONEST, 0) for m in (a, b, c)[:attesters]]}, reports={},
        power=dict.fromkeys((a, b, c, d), 1), tolerance=0, attest_before=8,
        absent=frozenset(m for m in (c, d) if names[m] in absent))
    _, findings = finalization.decide(evidence)
    assert [(names[f.operator], f.kind) for f in findings] == [(name, "withheld-attestation") for name in withheld]


@pytest.mark.parametrize(("reporters", "cut"), [(1, False), (2, True)])
def test_reports_from_more_than_a_third_of_the_power_cut_a_node_whatever_it_answered(reporters, cut):
    """The pure rule at its threshold, three members of equal power: the node's one answer, attested
    honest, is cut by reports from two of them, not from one (who may be the faulty one); the answer's
    tokens count toward its evidence either way."""
    node, leader, *others = b"n" * 32, b"a" * 32, b"b" * 32, b"c" * 32
    answer = ChallengeResult(node, leader, "leader", VALID, "", "p", b"s" * 32, {"token_ids": [5, 6, 7]},
                             HONEST, 1)
    evidence = finalization.Evidence(
        leader=leader, plan_nodes=[node], results={node: [answer]},
        attestations={(node, leader): [(m, HONEST, 1) for m in (leader, *others)]},
        reports={node: tuple(others[:reporters])}, power=dict.fromkeys((leader, *others), 1), tolerance=0,
        attest_before=2, absent=frozenset())
    [verdict], findings = finalization.decide(evidence)
    assert (verdict.credibility, verdict.scored) == ((0, False) if cut else (HONEST, True))
    assert (verdict.checked, verdict.deviations) == (3, 1) and findings == []
