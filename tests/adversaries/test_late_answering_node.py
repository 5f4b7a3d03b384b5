"""Model nodes that answer the leader's challenges late and the members' re-challenges on time, so that an
honest leader is faulted for each of them until the chain takes its power (docs/threat-model.md, "Framing
the leader"). The leader's challenges come first in an epoch and the re-challenges after, so a node can
tell them apart by time alone. The leader's real daemon claims each challenge still out `GIVE_UP_BLOCKS`
before its results window closes as unanswered, instead of leaving the node out; the members'
re-challenges score the nodes; and the leader's claims, which the members' answers contradict, are
recorded as unconfirmed reports that count nothing toward its removal."""

from __future__ import annotations

from dataclasses import replace

from committee import EPOCH_PARAMS, HONEST, TEMPERATURE, Script, expected, finish, listed
from harness import AppHarness, sqlite_url
from relaystandin import relay  # noqa: F401 - the fixture

from planetserve.chain.abci.state import members
from planetserve.chain.challenge import Challenge
from planetserve.chain.messages.epochs import Unanswered
from planetserve.registry.entities import ModelNode
from planetserve.verifier.daemon import LATE, OVERDUE, Daemon
from planetserve.verifier.overlay import OverlayChannel

PARAMS = replace(EPOCH_PARAMS, member_fault_window=4, member_fault_limit=2)
"""Two counted faults in an epoch take a member's power: fewer than the nodes below."""


def test_nodes_that_answer_the_leader_late_neither_fault_it_nor_take_its_power(relay, tmp_path):  # noqa: F811
    s = Script(AppHarness(sqlite_url(tmp_path), members=4, params=PARAMS), nodes=3)
    s.run_election_and_plan(1)
    leader = s.leader(1)
    relay.delay = 5.0  # every answer to the leader comes after its window has closed
    daemon = Daemon(leader, None, {}, OverlayChannel(relay.url), None, tmp_path / "leader", attempts=1)
    try:
        for node in s.nodes:
            registered = ModelNode(node, "org1", "gt", "h:1", "cpu", 1, "eu", "active", 0)
            daemon._ask((1, node, "leader"), s.planned(1, node, leader), registered)
        assert daemon.results(1) == {"leader": [], "rechallenge": []}  # still in time: waiting
        claims = daemon.results(1, overdue={"leader"})["leader"]
    finally:
        daemon.pool.shutdown(wait=False, cancel_futures=True)
    assert claims == [Unanswered(node, OVERDUE) for node in sorted(s.nodes)] and not daemon.pending
    body = {"epoch": 1, "kind": "leader", "results": [claim.body() for claim in claims]}
    assert s.block(s.tx(leader, "submit-results", body)) == [(0, "ok")]

    others = [m for k, m in s.members.items() if k != leader.public]
    own = {(m.public, node): Challenge.new(f"Member {i} asks node {j}: why do leaves fall?", TEMPERATURE)
           for i, m in enumerate(others) for j, node in enumerate(s.nodes)}
    assert all(c == 0 for c, _ in s.block(*[
        s.tx(m, "commit-rechallenge", {"epoch": 1, "tags": [own[m.public, node].tag(node)]})
        for m in others for node in s.nodes]))
    assert all(c == 0 for c, _ in s.block(*[  # answered on time, every one
        s.tx(m, "submit-results", {"epoch": 1, "kind": "rechallenge", "results": [
            own[m.public, node].reveal(s.answer(node, own[m.public, node])).body() for node in s.nodes]})
        for m in others]))
    assert all(c == 0 for c, _ in s.block(*(tx for m in others
                                            for tx in s.attest_txs(1, m.public, dict.fromkeys(s.nodes, HONEST)))))
    finish(s, 1)

    assert s.faults(leader.public) == ["unconfirmed-report"] * len(s.nodes)  # recorded, not "skipped-node"
    assert s.state.faults_in(leader.public, range(0, 2)) == 0
    assert s.epoch(1).faults == 0  # the epoch's record counts none of them either (the dashboard shows it)
    assert leader.public in members(s.h.store.batch())
    assert not any(e.type == "member_removed" for r in s.h.responses for e in r.events)
    assert all(s.faults(m) == [] for m in s.members if m != leader.public)
    for node in s.nodes:  # scored on the members' re-challenges, and listed
        assert s.reputation(node) == expected(HONEST) and node in listed(s)


def test_a_node_holding_back_its_answers_to_re_challenges_is_reported_rather_than_revealed_late(
        relay, tmp_path):  # noqa: F811
    """The node answers the leader on time and each member's re-challenge only once the epoch's closing
    windows have opened, where a revealed answer could be left unattested by a colluding member without
    a fault (`finalization`'s `attest_before`). The members' real daemons do not wait for it: at
    `rechallenge_cutoff` each claims its re-challenge still out unanswered, naming its commitment. Two
    such claims are reports from more than a third of the power: the node is cut for the epoch, though
    the leader's answer was attested honest."""
    s = Script(AppHarness(sqlite_url(tmp_path), members=4, params=PARAMS), nodes=1)
    s.run_election_and_plan(1)
    leader = s.leader(1)
    (node,) = s.nodes
    assert s.block(s.tx(leader, "submit-results", s.leader_results(1, HONEST))) == [(0, "ok")]
    assert all(c == 0 for c, _ in s.block(*s.attest_txs(1, leader.public, {node: HONEST})))
    relay.delay = 5.0  # every answer comes long after the cutoff
    registered = ModelNode(node, "org1", "gt", "h:1", "cpu", 1, "eu", "active", 0)
    claims = []
    for i, member in enumerate([m for k, m in s.members.items() if k != leader.public][:2]):
        (tmp_path / f"m{i}").mkdir()
        daemon = Daemon(member, None, {}, OverlayChannel(relay.url), None, tmp_path / f"m{i}", attempts=1)
        challenge = Challenge.new(f"Member {i} asks: why do leaves fall?", TEMPERATURE)
        daemon.journal.add(1, node, challenge)
        assert s.block(s.tx(member, "commit-rechallenge", {"epoch": 1, "tags": [challenge.tag(node)]})) == [(0, "ok")]
        try:
            daemon._ask((1, node, "rechallenge"), challenge, registered)
            assert daemon.results(1) == {"leader": [], "rechallenge": []}  # before the cutoff: waiting
            [claim] = daemon.results(1, overdue={"rechallenge"})["rechallenge"]
        finally:
            daemon.pool.shutdown(wait=False, cancel_futures=True)
        assert claim == Unanswered(node, LATE, challenge.commitment) and not daemon.pending
        claims.append(s.tx(member, "submit-results", {"epoch": 1, "kind": "rechallenge", "results": [claim.body()]}))
    assert s.block(*claims) == [(0, "ok")] * 2
    finish(s, 1)
    assert s.reputation(node) == expected(0)
    assert all(s.faults(m) == [] for m in s.members)
