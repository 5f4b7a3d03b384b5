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
from planetserve.verifier.daemon import OVERDUE, Daemon
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
        claims = daemon.results(1, overdue=True)["leader"]
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
