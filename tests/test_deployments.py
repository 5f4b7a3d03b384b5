"""Deployments deploy and heal (chain/abci/deployments.py), on the real application: `deploy-model`
assigns only nodes registered for the deployed model and refuses what it cannot deliver; a node that
leaves its share (inactive, another model, too little memory) is replaced in the transaction that
changes it, a whole-model deployment shrinks and a pipeline is planned again over the remaining and
standby nodes, and what is no longer served is refunded; the same blocks give the same app hashes."""

from __future__ import annotations

import pytest
from deployers import A100, ACME, FUNDS, HOUR, Chain, events

from planetserve.chain import layout
from planetserve.chain.errors import Code
from planetserve.registry import credits, rules
from planetserve.registry.credits import Deployment

LAYER_MIB = 1_000


@pytest.fixture
def c(tmp_path) -> Chain:
    return Chain(tmp_path)


def test_a_model_no_node_serves_is_refused_and_nodes_of_other_models_are_never_assigned(c):
    code, log = c.deploy("third", nodes=1)
    assert code == Code.UNAVAILABLE and "no listed, unassigned A100 node is registered for model 'third'" in log
    others = c.register("other", 2)
    code, log = c.deploy("other", nodes=3)
    assert code == Code.UNAVAILABLE and "asks for 3 A100 node(s) holding model 'other'; 2 listed" in log
    assert c.s.state.credits(ACME).balance == FUNDS  # refusals cost nothing
    assert c.deploy("other", nodes=2) == (0, "ok")
    assert sorted(c.deployment(c.s.state.get_int(layout.NEXT_DEPLOYMENT_KEY)).nodes) == sorted(others)
    # the five gt nodes serve gt only: every one of them, and nothing else, can be assigned it
    code, log = c.deploy("gt", nodes=6)
    assert code == Code.UNAVAILABLE and "5 listed, unassigned ones serve it" in log
    assert sorted(c.assigned()) == sorted(others)


def test_an_assigned_node_that_leaves_is_replaced_in_its_transaction(c, tmp_path):
    assert c.deploy("gt", nodes=2) == (0, "ok")
    before = c.deployment()
    leaving = next(n for n in before.nodes if n in c.org1)
    standby = sorted(set(c.s.nodes) - set(before.nodes))
    result = c.update(leaving, status="inactive")
    [healed] = events(result, "deployment_healed")
    # the standby node with the lowest sha256(deployment id || key) takes its place, as deploy-model picks
    [replacement] = rules.hash_sample((1).to_bytes(8, "big"), standby, 1)
    assert healed == {"deployment_id": "1", "left": leaving.hex(), "reasons": "inactive",
                      "joined": replacement.hex(), "nodes": "2", "stages": "0", "refund": "0"}
    after = c.deployment()
    assert after.nodes == tuple(sorted({*before.nodes, replacement} - {leaving}))
    assert (after.cost, after.expires_at) == (before.cost, before.expires_at)
    assert leaving not in c.assigned() and c.s.state.deployment_of(replacement) == after
    # back active, it is a standby node like any other; nothing heals again
    assert events(c.update(leaving, status="active"), "deployment_healed") == []
    assert c.replays(tmp_path)


def test_a_deployment_without_standby_nodes_shrinks_then_ends_with_a_refund(c, tmp_path):
    others = c.register("other", 2)
    assert c.deploy("other", nodes=2) == (0, "ok")
    deployment = c.deployment()
    cost = credits.cost(A100, 2, HOUR)
    assert deployment.cost == cost and c.s.state.credits(ACME).balance == FUNDS - cost

    result = c.update(others[0], model_id="gt")  # it now serves another model
    left = deployment.expires_at - c.h.time
    first = credits.cost(A100, 1, left)  # one server released for the time left
    assert events(result, "deployment_healed") == [{
        "deployment_id": "1", "left": others[0].hex(), "reasons": "other-model", "joined": "",
        "nodes": "1", "stages": "0", "refund": str(first)}]
    assert c.deployment().nodes == (others[1],) and c.deployment().cost == cost - first

    result = c.update(others[1], status="inactive")
    second = credits.cost(A100, 1, deployment.expires_at - c.h.time)
    assert events(result, "deployment_ended") == [{
        "deployment_id": "1", "left": others[1].hex(), "reasons": "inactive", "joined": "",
        "nodes": "0", "stages": "0", "refund": str(second)}]
    assert c.deployment() is None and c.assigned() == []
    account = c.s.state.credits(ACME)
    assert account.balance == FUNDS - cost + first + second and account.spent == cost - first - second
    assert c.replays(tmp_path)


def big(c: Chain, memories: list[int]) -> list[bytes]:
    """Register model big (8 layers of LAYER_MIB) and org1 nodes of it declaring these memories."""
    c.s.register_model(model_id="big", name="Big", layers=8, layer_mib=LAYER_MIB)
    return [key for memory in memories for key in c.register("big", 1, memory_mib=memory, gflops=100_000)]


def covers(deployment: Deployment) -> bool:
    """Every pipeline of the deployment holds the 8 layers once, in order."""
    pipelines: dict[int, list[tuple[int, int]]] = {}
    for _, start, end, pipe in deployment.stages:
        pipelines.setdefault(pipe, []).append((start, end))
    return bool(pipelines) and all(
        [r[0] for r in sorted(ranges)] == [0, *(r[1] for r in sorted(ranges)[:-1])] and max(ranges)[1] == 8
        for ranges in pipelines.values())


def test_a_pipeline_stage_that_leaves_is_reallocated_over_the_remaining_and_standby_nodes(c, tmp_path):
    nodes = big(c, [4 * LAYER_MIB] * 3)  # two of them hold the 8 layers; the third stands by
    assert c.deploy("big", nodes=2) == (0, "ok")
    before = c.deployment()
    assert len(before.stages) == 2 and covers(before)
    [standby] = set(nodes) - set(before.nodes)
    leaving, remaining = before.nodes
    result = c.update(leaving, status="inactive")
    [healed] = events(result, "deployment_healed")
    assert (healed["left"], healed["reasons"], healed["joined"]) == (leaving.hex(), "inactive", standby.hex())
    assert (healed["nodes"], healed["stages"], healed["refund"]) == ("2", "2", "0")
    after = c.deployment()
    assert sorted(after.nodes) == sorted([remaining, standby]) and covers(after)
    assert {key for key, *_ in after.stages} == set(after.nodes)
    assert sorted(c.assigned()) == sorted(after.nodes)
    assert c.replays(tmp_path)


def test_a_pipeline_that_cannot_be_formed_again_ends_with_a_refund(c, tmp_path):
    big(c, [4 * LAYER_MIB] * 2)
    assert c.deploy("big", nodes=2) == (0, "ok")
    deployment = c.deployment()
    shrinking, _ = deployment.nodes
    result = c.update(shrinking, memory_mib=LAYER_MIB)  # it can no longer hold its 4 layers
    refund = credits.cost(A100, 2, deployment.expires_at - c.h.time)
    [ended] = events(result, "deployment_ended")
    assert (ended["left"], ended["reasons"], ended["nodes"], ended["refund"]) == (
        shrinking.hex(), "too-small", "0", str(refund))
    assert c.deployment() is None and c.assigned() == []
    account = c.s.state.credits(ACME)
    assert account.spent == deployment.cost - refund and account.balance == FUNDS - account.spent
    assert c.replays(tmp_path)


@pytest.mark.postgres
def test_healing_gives_the_same_app_hashes_on_postgresql(c, pg_url):
    """A whole-model replacement and a pipeline planned again, replayed block by block on PostgreSQL."""
    nodes = big(c, [4 * LAYER_MIB] * 3)
    assert c.deploy("gt", nodes=2) == (0, "ok")
    assert c.deploy("big", nodes=2) == (0, "ok")
    whole, pipeline = c.deployment(1), c.deployment(2)
    c.update(next(n for n in whole.nodes if n in c.org1), status="inactive")
    c.update(pipeline.nodes[0], status="inactive")
    assert c.deployment(1).nodes != whole.nodes and set(c.deployment(2).nodes) < set(nodes)
    pairs = c.h.replay(pg_url)
    assert len(pairs) == c.h.height and all(here == there for here, there in pairs)
