"""A model node punished to untrusted comes back under a fresh key (docs/threat-model.md,
"Whitewashing"): trust is earned. A new key starts at most at its organisation's reputation, which
the punished node's record keeps down even once the node is taken out of service; every new key, of an
old organisation or of a new one, is challenged every epoch but is not listed, credited as a serving
peer or deployed until it has ended `probation_epochs` consecutive scored epochs trusted."""

from __future__ import annotations

from dataclasses import replace

import pytest
from committee import EPOCH_PARAMS, HONEST, RULE, Script, expected, honest_epoch, listed
from harness import AppHarness, sqlite_url

from planetserve.chain.errors import Code
from planetserve.chain.keys import KeySet
from planetserve.registry import credits
from planetserve.registry.epochs import VALID, Reputation
from planetserve.registry.genesis import GenesisOrganisation

PROBATION = replace(EPOCH_PARAMS, probation_epochs=3)
CHEAT = 0
"""The credibility of a cheating node's answers."""


@pytest.fixture
def s(tmp_path) -> Script:
    return Script(AppHarness(sqlite_url(tmp_path), members=4, params=PROBATION))


def run_epoch(s: Script, number: int, cheats: frozenset[bytes] = frozenset()) -> None:
    """Epoch `number` with every planned node scored: CHEAT for the `cheats`, HONEST for the others."""
    honest_epoch(s, number, {n: CHEAT if n in cheats else HONEST for n in s.planned_nodes(number)})


def standing(s: Script, node: bytes) -> Reputation:
    record = s.state.reputation(node)
    assert record is not None, "every registered node has a reputation record"
    return record


def register(s: Script, owner: KeySet, org_id: str, new_org: bool = False) -> bytes:
    """A fresh key of `owner`'s organisation `org_id`, registered first when `new_org`."""
    if new_org:
        assert s.block(s.tx(owner, "register-org", {"org_id": org_id, "name": org_id})) == [(0, "ok")]
    return s.register_node(owner, org_id)


def punish(s: Script) -> tuple[bytes, bytes]:
    """node0 and node1 pass probation honestly in epochs 1-3; in epoch 4 node0 cheats and falls
    untrusted. Returns (node0, node1) at the start of epoch 5."""
    node0, node1 = list(s.nodes)
    s.run_election_and_plan(1)
    for number in range(1, 4):
        run_epoch(s, number)
    assert listed(s) == sorted([node0, node1])
    run_epoch(s, 4, frozenset({node0}))
    assert standing(s, node0).value == expected(HONEST, HONEST, HONEST, CHEAT) < RULE.untrusted
    assert listed(s) == [node1]
    return node0, node1


def test_an_honest_new_node_is_challenged_and_listed_after_exactly_its_probation(s):
    node0, node1 = list(s.nodes)
    assert all(standing(s, n) == Reputation(n, RULE.initial, (), 0, 0, True, 3) for n in s.nodes)
    assert listed(s) == []  # trusted at the initial reputation, but on probation
    # the plan of epoch 1 must challenge the nodes on probation: one that leaves node0 out is refused
    s.run_to(s.schedule.setup_height(0))
    s.h.block()
    planner = s.members[s.epoch(1).plan_leader]
    body, _ = s.plan(1, [node1])
    code, log = s.block(s.tx(planner, "commit-plan", body))[0]
    assert code == Code.INVALID_FIELD and "omits 1 of the 2 node(s)" in log
    plan_txs, _ = s.plan_txs(1)
    assert all(c == 0 for c, _ in s.block(*plan_txs, *s.vrf_txs(1)))
    s.run_to(s.schedule.start(1))
    for number in range(1, 4):
        assert s.planned_nodes(number) == sorted([node0, node1])
        assert listed(s) == []
        run_epoch(s, number)
        assert [standing(s, n).probation for n in s.nodes] == [3 - number] * 2
    assert listed(s) == sorted([node0, node1])  # after exactly 3 trusted epochs
    assert all(s.reputation(n) == expected(HONEST, HONEST, HONEST) for n in s.nodes)
    assert all(s.faults(m) == [] for m in s.members)


def test_a_punished_node_under_a_new_key_of_its_organisation_starts_at_its_mark(s):
    """node0 is punished, taken out of service, and its operator registers a fresh key in the same
    organisation: the key starts at node0's reputation, untrusted, and is listed only after a full
    probation; the honest node1 of that organisation keeps its place all along."""
    node0, node1 = punish(s)
    mark = standing(s, node0).value
    deactivate = s.tx(s.owner, "update-model-node", {"node_pubkey": node0, "status": "inactive"})
    assert s.block(deactivate) == [(0, "ok")]
    node2 = register(s, s.owner, "org1")
    assert standing(s, node2) == Reputation(node2, mark, (), 0, 0, False, 3)
    assert listed(s) == [node1]
    run_epoch(s, 5, frozenset({node0}))  # its plan was committed before node2 registered
    assert node2 not in s.planned_nodes(5) and node0 not in s.planned_nodes(6)
    for number in range(6, 9):
        assert node2 in s.planned_nodes(number) and node2 not in listed(s)
        run_epoch(s, number)
    assert standing(s, node2).value == expected(HONEST, HONEST, HONEST, start=mark)
    assert listed(s) == sorted([node1, node2])
    assert s.reputation(node1) == expected(*[HONEST] * 8)  # never penalised
    assert all(s.faults(m) == [] for m in s.members)


def test_a_fresh_organisation_does_not_skip_probation_and_cheating_on_it_starts_it_over(s):
    """After node0's punishment its operator registers a new organisation (free) and a key in it: the
    key starts at the initial reputation, is challenged but not listed, cheats once while on
    probation, and must then end three more epochs trusted before it is listed. node0 keeps cheating
    and stays off the list."""
    node0, node1 = punish(s)
    operator = KeySet.generate()
    node3 = register(s, operator, "fresh", new_org=True)
    assert standing(s, node3) == Reputation(node3, RULE.initial, (), 0, 0, True, 3)
    run_epoch(s, 5, frozenset({node0}))
    assert node3 not in s.planned_nodes(5) and node3 in s.planned_nodes(6)
    run_epoch(s, 6, frozenset({node0}))  # node3's first scored epoch: trusted, one down
    assert standing(s, node3).probation == 2 and node3 not in listed(s)
    run_epoch(s, 7, frozenset({node0, node3}))
    assert not standing(s, node3).trusted and standing(s, node3).probation == 3
    for number in range(8, 11):
        assert node3 in s.planned_nodes(number) and node3 not in listed(s)
        run_epoch(s, number, frozenset({node0}))
    assert standing(s, node3).trusted and standing(s, node3).probation == 0
    assert listed(s) == sorted([node1, node3])
    assert s.reputation(node1) == expected(*[HONEST] * 10)  # never penalised
    assert all(s.faults(m) == [] for m in s.members)


def test_a_node_on_probation_is_not_credited_as_a_serving_peer(s):
    """node0 forwards its challenge to node1, which is on probation: node0 answers for the answer, and
    node1 is not credited with it (only listed nodes may be forwarded to)."""
    node0, node1 = list(s.nodes)
    s.run_election_and_plan(1)
    leader = s.leader(1)
    body = s.leader_results(1, HONEST)
    challenge = s.planned(1, node0, leader)
    returned = s.answer(node0, challenge)
    computed = s.answer(node1, challenge, time=returned.time - 1)
    body["results"][list(s.nodes).index(node0)] = {**challenge.reveal(returned, served=computed).body(),
                                                  "credibility": HONEST}
    assert s.block(s.tx(leader, "submit-results", body)) == [(0, "ok")]
    result = s.state.result(1, node0, leader.public)
    assert result is not None and result.status == VALID
    assert result.served_by == b"" and "on probation" in result.reason


def test_a_node_on_probation_serves_no_deployment(tmp_path):
    owner = KeySet.generate()
    rich = GenesisOrganisation("rich", "Rich", owner.public, 100 * credits.CREDIT_SECONDS)
    s = Script(AppHarness(sqlite_url(tmp_path), members=4, params=PROBATION, organisations=(rich,)), nodes=0)
    node = register(s, owner, "rich")
    deploy = {"org_id": "rich", "model_id": "gt", "hardware": "A100", "nodes": 1, "seconds": 60}
    code, log = s.block(s.tx(owner, "deploy-model", deploy))[0]
    assert code == Code.UNAVAILABLE and "no listed, unassigned" in log
    s.run_election_and_plan(1)
    for number in range(1, 4):
        run_epoch(s, number)
    assert listed(s) == [node]
    assert s.block(s.tx(owner, "deploy-model", deploy)) == [(0, "ok")]
    assert s.state.deployment(1).nodes == (node,)



@pytest.mark.postgres
def test_probation_gives_the_same_app_hashes_on_postgresql(s, pg_url):
    node0, _ = punish(s)
    assert s.block(s.tx(s.owner, "update-model-node", {"node_pubkey": node0, "status": "inactive"})) == [(0, "ok")]
    register(s, s.owner, "org1")
    run_epoch(s, 5)
    register(s, KeySet.generate(), "fresh", new_org=True)
    for number in range(6, 9):
        run_epoch(s, number)
    pairs = s.h.replay(pg_url)
    assert len(pairs) == s.h.height
    assert all(here == there for here, there in pairs), next(
        i for i, (here, there) in enumerate(pairs, 1) if here != there)
