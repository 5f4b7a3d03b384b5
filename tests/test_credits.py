"""Contribution credits: earned per finalized epoch by verified, trusted nodes' organisations, spent
on deployments (the seed's 5 servers x 30 days = 30 servers x 5 days), and every refusal."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import replace

import pytest
from committee import EPOCH_PARAMS, PLAN_PART, Script
from google.protobuf.timestamp_pb2 import Timestamp
from harness import GENESIS_TIME, AppHarness, node_body, sqlite_url

from planetserve.chain import layout
from planetserve.chain.abci.app import Application
from planetserve.chain.abci.state import State
from planetserve.chain.abci.store import StateStore
from planetserve.chain.errors import Code
from planetserve.chain.keys import KeySet
from planetserve.registry import credits
from planetserve.registry.entities import Model
from planetserve.registry.genesis import GenesisOrganisation, parse_app_state

DAY = 86_400
A100 = credits.DEFAULT_PRICES["A100"]


def test_five_servers_for_thirty_days_buy_thirty_servers_for_five_days():
    assert credits.earned(A100, 30 * DAY) * 5 == credits.cost(A100, 30, 5 * DAY)
    assert credits.format_credits(credits.cost(A100, 1, 3600)) == f"{A100}.000"


def test_assignment_is_deterministic_and_not_the_callers_order():
    nodes = [bytes([i]) * 32 for i in range(20)]
    chosen = credits.assign_nodes(7, nodes, 5)
    assert chosen == credits.assign_nodes(7, list(reversed(nodes)), 5)
    assert len(set(chosen)) == 5 and set(chosen) <= set(nodes)
    assert chosen != credits.assign_nodes(8, nodes, 5)


@pytest.fixture
def s(tmp_path) -> Script:
    return Script(AppHarness(sqlite_url(tmp_path), members=4, params=EPOCH_PARAMS), nodes=5)


def register_other_org(s: Script, org_id: str, count: int) -> KeySet:
    owner = KeySet.generate()
    txs = [s.tx(owner, "register-org", {"org_id": org_id, "name": org_id})]
    for i in range(count):
        node = KeySet.generate()
        txs.append(s.tx(owner, "register-model-node",
                        node_body(node, org_id, address=f"10.0.1.{i}:7000", capacity=1, region="us")))
    assert all(c == 0 for c, _ in s.block(*txs))
    return owner


def deploy(s: Script, owner: KeySet, org_id: str = "org1", **overrides) -> tuple[int, str]:
    body = {"org_id": org_id, "model_id": "gt", "hardware": "A100", "nodes": 30, "seconds": 5 * DAY}
    return s.block(s.tx(owner, "deploy-model", {**body, **overrides}))[0]


def earn_thirty_days(s: Script, meanwhile: Callable[[], None] = lambda: None, last: Sequence[bytes] = ()) -> None:
    """Epoch 1 scores org1's five nodes, and its last block, holding `last`, comes 30 days after its
    first; `meanwhile` runs once the epoch has started."""
    s.h.block()  # the epoch's first block records its start time
    start = s.epoch(1).start_time
    meanwhile()
    leader = s.epoch(1).leader
    assert s.block(s.tx(s.leader(1), "submit-results", s.leader_results(1, 800_000))) == [(0, "ok")]
    assert all(c == 0 for c, _ in s.block(*s.attest_txs(1, leader, dict.fromkeys(s.nodes, 800_000))))
    s.run_to(s.schedule.end(1))
    assert all(r.code == 0 for r in s.h.block(*last, seconds=start + 30 * DAY - s.h.time).tx_results)
    assert s.epoch(1).finalized


def test_credits_are_earned_then_spent_on_a_deployment_that_expires(s):
    s.run_election_and_plan(1)
    other = register_other_org(s, "org2", 30)  # after epoch 1's cutoff: not in its plan
    earn_thirty_days(s)
    account = s.state.credits("org1")
    assert account.balance == account.earned == 5 * credits.earned(A100, 30 * DAY)
    assert s.state.credits("org2").balance == 0

    refusals = {
        "unknown model": (deploy(s, s.owner, model_id="nope"), Code.UNKNOWN_ENTITY, "not registered"),
        "unpriced class": (deploy(s, s.owner, hardware="TPU9"), Code.INVALID_FIELD, "no price"),
        "too many": (deploy(s, s.owner, nodes=1_001), Code.INVALID_FIELD, "nodes"),
        "too long": (deploy(s, s.owner, seconds=91 * DAY), Code.INVALID_FIELD, "seconds"),
        "too short": (deploy(s, s.owner, seconds=59), Code.INVALID_FIELD, "'seconds': must be an integer in 60.."),
        "not owner": (deploy(s, other), Code.UNAUTHORIZED, "does not own"),
        "over-ask": (deploy(s, s.owner, nodes=36, seconds=60), Code.UNAVAILABLE, "35 listed"),
        "no credits": (deploy(s, other, org_id="org2", nodes=1, seconds=60), Code.INSUFFICIENT_CREDITS,
                       "has 0.000"),
        "over budget": (deploy(s, s.owner, seconds=5 * DAY + 1), Code.INSUFFICIENT_CREDITS, "costs"),
    }
    for name, ((code, log), want, words) in refusals.items():
        assert code == want and words in log, (name, code, log)
    assert s.state.credits("org1") == account  # refusals spent nothing

    code, log = deploy(s, s.owner)
    assert code == 0, log
    account = s.state.credits("org1")
    assert account.balance == 0 and account.spent == account.earned
    deployment = s.state.deployment(1)
    assert deployment.org_id == "org1" and len(deployment.nodes) == 30
    assigned = [k for k, _ in s.h.store.batch().iterate(layout.ASSIGNED_PREFIX)]
    assert len(assigned) == 30

    s.h.block(seconds=5 * DAY)
    assert s.state.deployment(1) is None
    assert list(s.h.store.batch().iterate(layout.ASSIGNED_PREFIX)) == []


def test_a_node_taken_off_the_list_during_the_epoch_earns_nothing_for_it(s):
    """An organisation set a planned node inactive once the epoch started (it answers its challenge,
    serves no users, takes no deployment) and active again before the epoch's end: it was paid for the
    whole epoch. A node off the list for part of an epoch earns nothing for it; the others earn as before."""
    s.run_election_and_plan(1)
    away = next(iter(s.nodes))

    def off_and_on() -> None:
        for status in ("inactive", "active"):
            assert s.block(s.tx(s.owner, "update-model-node", {"node_pubkey": away, "status": status})) \
                == [(0, "ok")]

    earn_thirty_days(s, off_and_on)
    account = s.state.credits("org1")
    assert account.earned == (len(s.nodes) - 1) * credits.earned(A100, 30 * DAY)


def test_a_node_off_the_list_from_before_the_epoch_until_its_last_block_earns_nothing_for_it(s):
    """Set inactive once the setup block had fixed the plan (so it is still challenged) but before the
    epoch began, and active again in the epoch's last block: the time it last left the list came before
    the epoch, and it was paid for an epoch spent wholly off the list. A node must have been on the list
    since the epoch's start."""
    away = next(iter(s.nodes))
    s.run_to(s.schedule.setup_height(0))
    s.h.block()
    plan_txs, _ = s.plan_txs(1)
    assert all(code == 0 for code, _ in s.block(*plan_txs, *s.vrf_txs(1)))
    assert s.block(s.tx(s.owner, "update-model-node", {"node_pubkey": away, "status": "inactive"})) == [(0, "ok")]
    s.run_to(s.schedule.start(1))
    earn_thirty_days(s, last=[s.tx(s.owner, "update-model-node", {"node_pubkey": away, "status": "active"})])
    assert s.state.credits("org1").earned == (len(s.nodes) - 1) * credits.earned(A100, 30 * DAY)
    assert away in {n.pubkey for n in s.state.iterate_nodes() if s.state.listed(n)}  # back, for the next


def test_an_organisation_without_credits_is_refused_before_the_nodes_are_read(s):
    """Reading every node and reputation to find the available ones took 93 ms with 8,000 nodes, and a
    refusal in CheckTx counts against no signer: an organisation without credits asked again and again
    at one sequence. The least a deployment of its length costs is checked first: with no node of the
    model available it is refused for its credits, where it was refused after the read, as unavailable."""
    s.run_election_and_plan(1)
    other = register_other_org(s, "org2", 1)
    earn_thirty_days(s)
    code, log = deploy(s, other, org_id="org2", hardware="H100", nodes=1, seconds=60)  # no H100 node
    assert code == Code.INSUFFICIENT_CREDITS and "has 0.000" in log
    code, log = deploy(s, s.owner, hardware="H100", nodes=1, seconds=60)  # org1 can pay: read, and refused
    assert code == Code.UNAVAILABLE and "no listed, unassigned H100 node" in log


def test_an_organisation_without_trusted_nodes_cannot_deploy(s):
    owner = KeySet.generate()
    assert s.block(s.tx(owner, "register-org", {"org_id": "empty", "name": "No nodes"})) == [(0, "ok")]
    code, log = deploy(s, owner, org_id="empty", nodes=1, seconds=60)
    assert code == Code.LOW_REPUTATION and "below" in log


def test_dishonest_nodes_earn_nothing_and_block_their_organisation(s):
    s.run_election_and_plan(1)
    leader = s.epoch(1).leader
    assert s.block(s.tx(s.leader(1), "submit-results", s.leader_results(1, 100_000))) == [(0, "ok")]
    assert all(c == 0 for c, _ in s.block(*s.attest_txs(1, leader, dict.fromkeys(s.nodes, 100_000))))
    s.run_to(s.schedule.end(1) + 1)
    assert s.epoch(1).finalized
    assert s.state.credits("org1").earned == 0
    code, log = deploy(s, s.owner, nodes=1, seconds=60)
    assert code == Code.LOW_REPUTATION


def sized_nodes(s: Script, memories: list[int], model_id: str = "big") -> list[bytes]:
    """org1 nodes of the model that declare their memory (MiB) and compute, in the Script's region."""
    keys = [KeySet.generate() for _ in memories]
    assert all(c == 0 for c, _ in s.block(*[s.tx(s.owner, "register-model-node", node_body(
        k, model_id=model_id, address=f"10.0.2.{i}:7000", capacity=1, memory_mib=memory, gflops=100_000))
        for i, (k, memory) in enumerate(zip(keys, memories, strict=True))]))
    return [k.public for k in keys]


def test_a_model_no_node_holds_whole_is_split_into_layer_pipelines(s):
    s.run_election_and_plan(1)
    earn_thirty_days(s)
    member = next(iter(s.members.values()))
    half = s.block(s.tx(member, "register-model", {"model_id": "big", "name": "Big", "layers": 8}))
    assert half[0][0] == Code.INVALID_FIELD and "both layers and layer_mib" in half[0][1]
    s.register_model(model_id="big", name="Big", layers=8, layer_mib=1_000)
    assert s.state.model("big").layers == 8
    # no node is registered for big: the gt nodes are not assigned a deployment of it; then, in the
    # same block, a node of big that declares no memory registers
    body = {"org_id": "org1", "model_id": "big", "hardware": "A100", "nodes": 5, "seconds": 60}
    undeclared = KeySet.generate()
    (code, log), registered = s.block(s.tx(s.owner, "deploy-model", body), s.tx(
        s.owner, "register-model-node", node_body(undeclared, model_id="big", address="10.0.3.1:7000")))
    assert code == Code.UNAVAILABLE and "no listed, unassigned A100 node is registered for model 'big'" in log
    assert registered == (0, "ok")
    # no node holds big whole, and no pipeline can be formed
    code, log = deploy(s, s.owner, model_id="big", nodes=5, seconds=60)
    assert code == Code.UNAVAILABLE and "no pipeline can be formed" in log
    nodes = sized_nodes(s, [3_000, 3_000, 2_000, 4_000, 4_500])  # 3 + 3 + 2 and 4 + 4 layers
    code, log = deploy(s, s.owner, model_id="big", nodes=1, seconds=60)
    assert code == Code.UNAVAILABLE and "fits in 1 node(s)" in log
    before = s.state.credits("org1")
    assert deploy(s, s.owner, model_id="big", nodes=5, seconds=3_600) == (0, "ok")
    deployment = next(d for d in (s.state.deployment(i) for i in range(1, 4)) if d is not None)
    assert sorted(deployment.nodes) == sorted(nodes)
    pipelines: dict[int, list[tuple[int, int]]] = {}
    for node, start, end, pipe in deployment.stages:
        assert deployment.stage_of(node) == (start, end, pipe)
        pipelines.setdefault(pipe, []).append((start, end))
    for ranges in pipelines.values():  # each pipeline covers the 8 layers once, in order
        ranges.sort()
        assert ranges[0][0] == 0 and ranges[-1][1] == 8
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    assert sorted(len(r) for r in pipelines.values()) == [2, 3]
    assert s.state.credits("org1").spent - before.spent == credits.cost(A100, 5, 3_600)
    assert deployment.stage_of(next(iter(s.nodes))) is None

    # a pipeline is challenged like one node: its entry stage is planned, its later stages are not
    entries = credits.pipelines([deployment])
    assert sorted(len(later) for later in entries.values()) == [1, 2]
    s.run_to(s.schedule.setup_height(2))
    s.h.block()
    planner = s.members[s.epoch(3).plan_leader]
    follower = next(iter(next(iter(entries.values()))))
    body, _ = s.plan(3, [follower])
    code, log = s.block(s.tx(planner, "commit-plan", {**body, "final": False}))[0]
    assert code == Code.INVALID_FIELD and "not among the nodes this plan must cover" in log
    body, _ = s.plan(3, [*s.nodes, undeclared.public, *entries])
    rows = body["entries"]  # sealed copies are padded: the plan goes in parts of PLAN_PART entries
    parts = [{**body, "entries": rows[i:i + PLAN_PART], "final": i + PLAN_PART >= len(rows)}
             for i in range(0, len(rows), PLAN_PART)]
    assert s.block(*(s.tx(planner, "commit-plan", p) for p in parts)) == [(0, "ok")] * len(parts)  # entries cover the pipelines
    # a node that holds the model whole is deployed as before, whole
    whole = sized_nodes(s, [9_000])
    assert deploy(s, s.owner, model_id="big", nodes=1, seconds=60) == (0, "ok")
    latest = max((d for d in (s.state.deployment(i) for i in range(1, 6)) if d is not None),
                 key=lambda d: d.deployment_id)
    assert latest.nodes == tuple(whole) and latest.stages == ()


def test_genesis_organisations_exist_with_their_owner_and_credits(tmp_path):
    h = AppHarness(sqlite_url(tmp_path, "plain.db"))
    owner, node = KeySet.generate(), KeySet.generate()
    endowed = 500 * credits.CREDIT_SECONDS
    app_state = replace(
        parse_app_state(json.loads(h.genesis.app_state_bytes)),
        models=(Model("gt", "reference", 0), Model("big", "large", 0, 80, 1_700)),
        organisations=(GenesisOrganisation("zeta", "Zeta", owner.public),
                       GenesisOrganisation("acme", "Acme", owner.public, endowed)),
    )
    h.genesis.app_state_bytes = json.dumps(app_state.to_json()).encode()
    h.genesis.time.CopyFrom(Timestamp(seconds=GENESIS_TIME))
    h.store = StateStore(sqlite_url(tmp_path))
    h.app = Application(h.store)
    h.app.init_chain(h.genesis)

    # the genesis owner acts on its organisation as if it had registered it
    result = h.block(h.tx(owner, "register-model-node", node_body(node, "acme", model_id="big", capacity=1)))
    assert [r.code for r in result.tx_results] == [0]
    st = State(h.store.batch())
    acme = st.org("acme")
    assert acme is not None and (acme.owner, acme.registered_at) == (owner.public, GENESIS_TIME)
    assert st.credits("acme") == credits.Credits("acme", balance=endowed, earned=0, spent=0)
    assert st.credits("zeta").balance == 0 and st.org("zeta").owner == owner.public
    assert (st.model("big").layers, st.model("big").layer_mib) == (80, 1_700)
    answer = h.query("/key", layout.credits_key("acme"))
    assert credits.Credits.decode(answer.value).balance == endowed
    assert all(here == there for here, there in h.replay(sqlite_url(tmp_path, "replay.db")))
