"""An honest verification epoch on a real four-validator network, the committee scripted here:
every member proves its VRF over RPC, the leader plans, results and attestations commit, and every
validator ends with the same reputations and app hashes."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from chainnet import assert_same_app_hashes, ledger, member_keys, start_network
from click.testing import CliRunner

from planetserve.chain import vrf
from planetserve.chain.challenge import Challenge, open_plan_entry, sign_response
from planetserve.chain.keys import KeySet
from planetserve.cli import main
from planetserve.registry import epochs, reputation
from planetserve.registry.credits import format_credits
from planetserve.registry.params import Params

pytestmark = pytest.mark.network

PARAMS = Params(epoch_blocks=40, results_blocks=15, vrf_window_blocks=15, plan_window_blocks=15)
SCHEDULE = epochs.Schedule.from_params(PARAMS)
CREDIBILITY = 750_000


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    cluster = start_network(tmp_path_factory.mktemp("epochs"), params=PARAMS)
    yield cluster
    cluster.close()


def in_parallel(fn, items):
    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(fn, items))


def test_an_honest_epoch_end_to_end(net):
    clients = [ledger(net, i) for i in range(4)]
    members = [member_keys(net, i) for i in range(4)]
    by_key = {m.public: m for m in members}
    owner, nodes = KeySet.generate(), [KeySet.generate() for _ in range(2)]
    client = clients[0]
    assert client.submit(owner, "register-org", {"org_id": "org-e", "name": "Org E"}).outcome.code == 0
    for i, node in enumerate(nodes):
        done = client.submit(owner, "register-model-node", client.model_node_body(
            "org-e", node, model_id="gt", address=f"127.0.0.1:{7100 + i}", hardware="cpu", capacity=2,
            region="local"))
        assert done.outcome.code == 0, done.outcome.log

    # epoch 0's windows: VRF proofs from every member, the plan of epoch 1 from epoch 0's leader
    net.wait_for_height(SCHEDULE.setup_height(0), timeout=120)
    client.min_height = SCHEDULE.setup_height(0)
    seed = client.epoch(1).seed
    leader0 = by_key[client.epoch(0).leader]
    _, committee = client.committee()
    challenges = {n.public: Challenge.new(f"Epoch one asks node {i}: what makes bread rise?")
                  for i, n in enumerate(nodes)}
    plan = {"epoch": 1, "final": True,
            "entries": [c.plan_entry(n, committee) for n, c in sorted(challenges.items())]}
    outcomes = in_parallel(
        lambda i: clients[i].submit(members[i], "submit-vrf",
                                    {"epoch": 1, "proof": vrf.prove(bytes(members[i].vrf), seed)}),
        range(4))
    assert [o.outcome.code for o in outcomes] == [0] * 4, [o.outcome.log for o in outcomes]
    done = client.submit(leader0, "commit-plan", plan)
    assert done.outcome.code == 0, done.outcome.log

    # epoch 1: the elected leader reads its sealed prompts, challenges the nodes, submits results
    net.wait_for_height(SCHEDULE.start(1), timeout=120)
    client.min_height = SCHEDULE.start(1)
    epoch1 = client.epoch(1)
    outputs = {m.public: vrf.proof_to_hash(vrf.prove(bytes(m.vrf), seed)) for m in members}
    assert epoch1.election == "vrf" and epoch1.leader == min(outputs, key=lambda k: (outputs[k], k))
    leader = by_key[epoch1.leader]
    _, planned = client.plan(1)
    assert sorted(p.node for p in planned) == sorted(challenges)
    results = []
    for entry in planned:
        challenge = open_plan_entry(entry, leader.public, leader.x25519)
        node = next(n for n in nodes if n.public == entry.node)
        response = sign_response(node, challenge.prompt, [5, 6, 7], "Yeast makes gas.", "gt",
                                 int(time.time()), "127.0.0.1:7100")
        results.append({**challenge.reveal(response), "credibility": CREDIBILITY})
    done = client.submit(leader, "submit-results", {"epoch": 1, "kind": "leader", "results": results})
    assert done.outcome.code == 0, done.outcome.log
    scores = [[n.public, leader.public, CREDIBILITY] for n in nodes]
    outcomes = in_parallel(
        lambda i: clients[i].submit(members[i], "attest", {"epoch": 1, "scores": scores}), range(4))
    assert [o.outcome.code for o in outcomes] == [0] * 4, [o.outcome.log for o in outcomes]

    # the end of epoch 1 finalizes it: every validator verifies the same reputations
    end = SCHEDULE.end(1)
    net.wait_for_height(end + 1, timeout=120)
    rule = reputation.ReputationRule.from_params(PARAMS)
    value, _ = reputation.update(rule, rule.initial, CREDIBILITY, ())
    for c in clients:
        c.min_height = end
        assert c.epoch(1).finalized and c.epoch(1).scored == 2
        assert [c.reputation(n.public).value for n in nodes] == [value, value]
    assert_same_app_hashes(net, end)

    runner = CliRunner()
    shown = runner.invoke(main, ["query", "reputation", nodes[0].public.hex(), "--node", net.rpc_url(1),
                                 "--genesis", str(net.spec.genesis_path), "--json"])
    assert shown.exit_code == 0, shown.output
    assert f'"value": {value}' in shown.output
    shown = runner.invoke(main, ["query", "epoch", "1", "--node", net.rpc_url(2),
                                 "--genesis", str(net.spec.genesis_path)])
    assert shown.exit_code == 0 and "vrf" in shown.output and epoch1.leader.hex() in shown.output
    shown = runner.invoke(main, ["query", "credits", "org-e", "--node", net.rpc_url(3),
                                 "--genesis", str(net.spec.genesis_path), "--json"])
    assert shown.exit_code == 0, shown.output
    account = clients[3].credits("org-e")
    assert account.earned > 0 and account.spent == 0 and f'"earned": "{format_credits(account.earned)}"' in shown.output
