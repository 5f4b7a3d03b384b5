"""A model node that forwards its challenges to a peer, hoping the peer's answer is scored instead of
its own (docs/threat-model.md, "Forwarding to hide"): the node a challenge addressed answers for what
it returned, and only a listed peer is credited with an answer it computed. And the other way round,
a fast peer serving its group's challenges with a cheaper model: every answer counts against the node
that computed it, so the peer is caught on them and the honest node that forwarded to it is scored on
what it computed itself."""

from __future__ import annotations

import pytest
from committee import EPOCH_PARAMS, HONEST, TEMPERATURE, Script, expected, finish, listed
from harness import AppHarness, sqlite_url

from planetserve.chain.challenge import Challenge
from planetserve.registry import finalization
from planetserve.registry.epochs import VALID, ChallengeResult
from planetserve.registry.params import PPM, Params

WEAK = 200_000


@pytest.fixture
def s(tmp_path) -> Script:
    return Script(AppHarness(sqlite_url(tmp_path), members=4, params=EPOCH_PARAMS))


def forwarded_epoch(s: Script, delisted_for: int | None = None, peer_scores: int = WEAK
                    ) -> tuple[bytes, bytes, ChallengeResult]:
    """Epoch 1 in which node0 signs, as its own answer, the answer node1 computed for node0's challenge
    (attested `peer_scores`); node1 answers its own challenge well. With `delisted_for`, node1's
    organisation takes it off the list once the plan is committed, and the leader's results land that
    many seconds later. Returns node0, node1 and node0's stored result."""
    s.run_election_and_plan(1)
    leader = s.leader(1)
    node0, node1 = list(s.nodes)
    if delisted_for is not None:
        update = s.tx(s.owner, "update-model-node", {"node_pubkey": node1, "status": "inactive"})
        assert s.block(update) == [(0, "ok")]
        s.h.time += delisted_for - 5  # the harness's blocks are 5 seconds apart
    body = s.leader_results(1, HONEST)
    challenge = s.planned(1, node0, leader)
    returned = s.answer(node0, challenge, time=s.h.time + 5)
    computed = s.answer(node1, challenge, time=returned.time - 1)
    body["results"][0] = {**challenge.reveal(returned, served=computed).body(), "credibility": peer_scores}
    assert s.block(s.tx(leader, "submit-results", body)) == [(0, "ok")]
    assert all(c == 0 for c, _ in s.block(*s.attest_txs(1, leader.public, {node0: peer_scores, node1: HONEST})))
    result = s.state.result(1, node0, leader.public)
    assert result is not None and result.status == VALID
    return node0, node1, result


def test_a_node_that_forwards_its_challenge_is_scored_on_what_it_returned(s):
    node0, node1, result = forwarded_epoch(s)
    assert result.served_by == node1
    finish(s, 1)
    assert s.reputation(node0) == expected(WEAK)  # the forward did not hide node0
    # node1 computed two answers of one length, its own challenge's and node0's: the lower median
    assert s.reputation(node1) == expected(WEAK)
    assert s.epoch(1).scored == 2
    assert all(s.faults(m) == [] for m in s.members)


@pytest.mark.parametrize("past_slack", [False, True])
def test_a_serving_peer_off_the_list_is_credited_only_within_the_response_slack_of_leaving_it(s, past_slack):
    """node1 was taken off the list (inactive) before the results came in. Within the response slack of
    that (an honest node forwards on a view of the list a few seconds old, and the answer is revealed as
    soon as it comes back) node1 is credited with the answer it computed; past it, it is not, and node0
    answers for the answer: a node cannot have a peer long off the list answer for it."""
    slack = Params().response_slack_seconds
    node0, node1, result = forwarded_epoch(s, delisted_for=slack + past_slack)
    if past_slack:
        assert result.served_by == b"" and "not listed" in result.reason
    else:
        assert result.served_by == node1 and result.reason == ""
    back = s.tx(s.owner, "update-model-node", {"node_pubkey": node1, "status": "active"})
    assert s.block(back) == [(0, "ok")]  # listed again, so that the next plan covers it
    finish(s, 1)
    assert s.reputation(node0) == expected(WEAK)  # it computed nothing, so it answers for what it returned
    assert s.reputation(node1) == expected(HONEST if past_slack else WEAK)
    assert all(s.faults(m) == [] for m in s.members)


@pytest.mark.parametrize("forwarded", ["before the delisting", "past the response slack"])
def test_a_re_challenge_forwarded_to_a_peer_the_finalization_delists_counts_against_the_peer(s, forwarded):
    """A member re-challenges node0 in epoch 1's closing windows (a sampled re-challenge of epoch 2) and
    node0 forwards it to its listed peer node1, which answers it badly, as it answered its own challenge;
    epoch 1's finalization delists node1, and the member reveals the answer at epoch 2's start. node1 is
    credited with it and node0 is scored on what it computed itself. A forward made, and revealed, past
    the response slack after the delisting is node0's to answer for."""
    s.run_election_and_plan(1)
    node0, node1 = list(s.nodes)
    honest_epoch_scores = {node0: HONEST, node1: 0}
    assert s.block(s.tx(s.leader(1), "submit-results", s.leader_results(1, honest_epoch_scores))) == [(0, "ok")]
    assert all(c == 0 for c, _ in s.block(*s.attest_txs(1, s.epoch(1).leader, honest_epoch_scores)))
    s.run_to(s.schedule.setup_height(1))
    s.h.block()
    plan_txs, _ = s.plan_txs(2)
    assert all(c == 0 for c, _ in s.block(*plan_txs, *s.vrf_txs(2)))
    member = next(m for k, m in sorted(s.members.items()) if k != s.epoch(2).leader)
    early = Challenge.new("Asked before the epoch: how do tides work?", TEMPERATURE)
    assert node1 in listed(s) and s.h.height + 1 == s.schedule.end(1)
    returned = s.answer(node0, early, time=s.h.time + 5)
    assert s.block(s.tx(member, "commit-rechallenge", {"epoch": 2, "tags": [early.tag(node0)]})) == [(0, "ok")]
    assert node1 not in listed(s) and s.epoch(1).finalized
    if forwarded == "past the response slack":
        s.h.time += Params().response_slack_seconds
        returned = s.answer(node0, early, time=s.h.time + 5)
    served = s.answer(node1, early, time=returned.time - 1)
    reveal = {"epoch": 2, "kind": "rechallenge", "results": [early.reveal(returned, served=served)]}
    assert s.block(s.tx(member, "submit-results", reveal)) == [(0, "ok")]
    result = s.state.result(2, node0, member.public)
    assert result.served_by == (node1 if forwarded == "before the delisting" else b"")
    assert s.block(s.tx(s.leader(2), "submit-results", s.leader_results(2, honest_epoch_scores))) == [(0, "ok")]
    assert all(c == 0 for c, _ in s.block(*s.attest_txs(2, s.epoch(2).leader, honest_epoch_scores),
                                          *s.attest_txs(2, member.public, {node0: 0})))
    finish(s, 2)
    if forwarded == "before the delisting":
        assert s.reputation(node0) == expected(HONEST, HONEST)
    else:
        assert s.reputation(node0) == expected(HONEST, 0)
    assert s.reputation(node1) == expected(0, 0)
    assert all(s.faults(m) == [] for m in s.members)


def test_every_answer_counts_against_the_node_that_computed_it():
    """The pure rule: a node that computed attested answers (its own, or as a serving peer) gets their
    median; a planned node that computed none answers for what it returned; a serving peer that is not
    planned is scored after every planned node."""
    challenged, peer, planned_peer, member = b"a" * 32, b"p" * 32, b"q" * 32, b"m" * 32

    def result(node: bytes, credibility: int, served_by: bytes) -> ChallengeResult:
        return ChallengeResult(node, member, "leader", VALID, "", "prompt", b"s" * 32, {}, credibility, 1,
                               served_by)

    evidence = finalization.Evidence(
        leader=member, plan_nodes=[challenged, planned_peer],
        results={challenged: [result(challenged, WEAK, peer)],
                 planned_peer: [result(planned_peer, HONEST, challenged)]},
        attestations={(challenged, member): [(member, WEAK, 3)], (planned_peer, member): [(member, HONEST, 0)]},
        reports={}, power={member: 1}, tolerance=0, attest_before=2, absent=frozenset())
    verdicts, findings = finalization.decide(evidence)
    # `challenged` computed planned_peer's answer; planned_peer computed nothing and answers for what it
    # returned; `peer`, not planned, computed challenged's
    assert [(v.node, v.credibility) for v in verdicts] == [(challenged, HONEST), (planned_peer, HONEST),
                                                           (peer, WEAK)]
    assert findings == []


def test_a_node_that_computed_nothing_answers_for_everything_it_returned():
    """All three of a node's results were computed by peers, one of them a cheat: the node answers for
    everything it returned (the cheat's answer among it), and each peer for what it computed."""
    node, cheap, honest1, honest2, member = b"n" * 32, b"c" * 32, b"h" * 32, b"i" * 32, b"m" * 32
    results = [ChallengeResult(node, member, "leader", VALID, "", "p", b"s" * 32, {}, 0, 1, cheap)]
    results += [ChallengeResult(node, m, "rechallenge", VALID, "", "p", b"s" * 32, {}, -1, 1, peer)
                for m, peer in ((b"x" * 32, honest1), (b"y" * 32, honest2))]
    attestations = {(node, member): [(member, 0, 0)], (node, b"x" * 32): [(member, HONEST, 0)],
                    (node, b"y" * 32): [(member, HONEST, 0)]}
    evidence = finalization.Evidence(leader=member, plan_nodes=[node], results={node: results},
                                     attestations=attestations, reports={}, power={member: 1}, tolerance=0,
                                     attest_before=2, absent=frozenset())
    verdicts, _ = finalization.decide(evidence)
    assert [(v.node, v.credibility) for v in verdicts] == [(node, 0), (cheap, 0), (honest1, HONEST),
                                                           (honest2, HONEST)]


def test_a_fast_peer_serving_its_groups_challenges_with_a_cheaper_model_is_caught_on_them(s):
    """node1 (fast, cheap) computes node0's challenge and every re-challenge of node0, badly; its own
    challenge it answers well (a question any model ends at once). It is scored on everything it
    computed; node0, which forwarded in good faith, answers for its leader result only while it
    computed nothing, and here it computed one re-challenge itself, well."""
    node0, node1, _ = forwarded_epoch(s, peer_scores=0)
    leader = s.leader(1)
    members = [m for k, m in s.members.items() if k != leader.public]
    own = {m.public: Challenge.new(f"Member {i} asks: how do tides work?", TEMPERATURE)
           for i, m in enumerate(members)}
    commits = [s.tx(m, "commit-rechallenge", {"epoch": 1, "tags": [own[m.public].tag(node0)]}) for m in members]
    assert all(c == 0 for c, _ in s.block(*commits))
    reveals = []
    for i, m in enumerate(members):
        returned = s.answer(node0, own[m.public])
        served = s.answer(node1, own[m.public], time=returned.time - 1) if i else None
        reveals.append(s.tx(m, "submit-results", {"epoch": 1, "kind": "rechallenge", "results": [
            own[m.public].reveal(returned, served=served)]}))
    assert all(c == 0 for c, _ in s.block(*reveals))
    scores = {m.public: HONEST if i == 0 else 0 for i, m in enumerate(members)}
    for submitter, score in scores.items():
        assert all(c == 0 for c, _ in s.block(*s.attest_txs(1, submitter, {node0: score})))
    finish(s, 1)
    # node1 computed: its own (HONEST), node0's leader challenge (0) and two re-challenges (0, 0)
    assert s.reputation(node1) == expected(0)
    assert not s.state.reputation(node1).trusted
    # node0 computed one re-challenge itself: that is what it is scored on
    assert s.reputation(node0) == expected(HONEST)
    assert all(s.faults(m) == [] for m in s.members)


def test_the_nodes_own_answer_on_re_challenge_outweighs_its_forwarded_one(s):
    """node0 forwarded the leader's challenge to an honest peer (whose answer would score well), then
    answered the members' re-challenges itself, badly: its C(T) is its own answer's."""
    node0, node1, forwarded = forwarded_epoch(s, peer_scores=HONEST)
    leader = s.leader(1)
    members = [m for k, m in s.members.items() if k != leader.public]
    own = {m.public: Challenge.new(f"Member {i} asks: how do tides work?", TEMPERATURE)
           for i, m in enumerate(members)}
    commits = [s.tx(m, "commit-rechallenge", {"epoch": 1, "tags": [own[m.public].tag(node0)]})
               for m in members]
    assert all(c == 0 for c, _ in s.block(*commits))
    reveals = [s.tx(m, "submit-results", {"epoch": 1, "kind": "rechallenge", "results": [
        own[m.public].reveal(s.answer(node0, own[m.public]))]}) for m in members]
    assert all(c == 0 for c, _ in s.block(*reveals))
    first = min(m.public for m in members)
    assert all(c == 0 for c, _ in s.block(*(tx for m in members for tx in s.attest_txs(
        1, m.public, {node0: WEAK if m.public == first else HONEST}))))
    finish(s, 1)
    assert s.reputation(node0) == expected(WEAK)
    assert s.reputation(node1) == expected(HONEST)
    assert all(s.faults(m) == [] for m in s.members)


def test_answers_that_any_model_ends_at_once_cannot_outvote_a_deviating_one():
    """A cheap serving peer's own challenges are questions every model ends at once (one token, scored
    1); the one long answer it computed for a peer scores 0. C(T) is the product of its answers: any
    deviating answer lowers it, and no number of clean ones raises it back; the tokens and deviations
    behind it are counted."""
    peer, other, member = b"p" * 32, b"o" * 32, b"m" * 32

    def result(node: bytes, submitter: bytes, kind: str, tokens: int, served_by: bytes = b"") -> ChallengeResult:
        return ChallengeResult(node, submitter, kind, VALID, "", "p", b"s" * 32,
                               {"token_ids": list(range(tokens))}, -1, 1, served_by)

    own = [result(peer, member, "leader", 1)] + [result(peer, bytes([i]) * 32, "rechallenge", 1) for i in (1, 2)]
    served = [result(other, member, "leader", 32, served_by=peer)]
    scores = {(peer, r.submitter): [(member, PPM, 0)] for r in own} | {(other, member): [(member, 0, 20)]}
    evidence = finalization.Evidence(leader=member, plan_nodes=[other, peer], results={peer: own, other: served},
                                     attestations=scores, reports={}, power={member: 1}, tolerance=0,
                                     attest_before=2, absent=frozenset())
    verdicts, _ = finalization.decide(evidence)
    assert [(v.node, v.credibility, v.checked, v.deviations) for v in verdicts] == [(other, 0, 32, 20),
                                                                                      (peer, 0, 35, 20)]
    assert finalization.product([PPM, PPM, PPM]) == PPM
    assert finalization.product([PPM, 500_000, 500_000]) == 250_000
    assert finalization.product([333_333, 333_333]) == finalization.product([333_333, 333_333]) == 111_110
    assert finalization.product([HONEST] + [PPM] * 50) == HONEST
    with pytest.raises(ValueError):
        finalization.product([])
