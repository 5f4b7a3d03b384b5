"""Model nodes as their own processes (`planetserve node model`) on a real four-validator network:
they register through their organisation, form their group from the verified node list, forward to
the holder of a prefix, sign with the registered key, and drop a delisted member."""

from __future__ import annotations

import pytest
from chainnet import ledger, start_network
from modelnodes import SHARED, signed
from roles import NodeProcess, init_home, planetserve
from waiting import wait_until

from planetserve.chain.keys import KeySet
from planetserve.chain.messages import RegisterOrg, UpdateModelNode

pytestmark = pytest.mark.network


def test_model_nodes_register_group_forward_and_sign(tmp_path, quick_family):
    net = start_network(tmp_path / "net")
    nodes: list[NodeProcess] = []
    try:
        client = ledger(net)
        owner = KeySet.generate()
        owner_path = tmp_path / "acme.json"
        owner.save(owner_path)
        assert client.submit(owner, RegisterOrg("acme", "ACME")).outcome.ok
        homes = [tmp_path / f"mn{i}" for i in range(3)]
        for home in homes:
            init_home(home, net, quick_family)

        # without the organisation's key an unregistered node explains how to register
        refused = planetserve("node", "model", "--home", str(homes[2]))
        assert refused.returncode == 1 and "is not registered" in refused.stderr
        assert "register-model-node" in refused.stderr

        nodes = [NodeProcess(home, owner_path, wait=False) for home in homes[:2]]  # both register at once
        for node in nodes:
            node.wait_ready()
        assert [n.ready["registration"] for n in nodes] == ["registered", "registered"]
        keys = [n.ready["node"] for n in nodes]
        listing, listed = client.nodes("gt")
        assert listing.verified and {n.pubkey.hex() for n in listed} == set(keys)
        wait_until(lambda: all(set(n.status()["group"]) == set(keys) for n in nodes))

        # a restart finds its registration in place
        nodes[1].stop()
        nodes[1] = NodeProcess(homes[1], None)
        assert nodes[1].ready["registration"] == "existing"

        first = signed(nodes[0].complete(SHARED + "What is a tuple?", planetserve={"no_forward": True}))
        assert first.node.hex() == keys[0]
        registered = client.node(first.node)
        assert registered is not None and registered.address == first.address  # the registered key signed

        wait_until(lambda: nodes[1].status()["tree_size"] > 0)
        nodes[1].complete("Warm up.", planetserve={"no_forward": True})  # a latency sample of its own
        wait_until(lambda: nodes[1].status()["load"]["latency"] > 0)
        answer = nodes[1].complete(SHARED + "What is a set?")
        assert signed(answer).node.hex() == keys[1]  # the entry node answers for what node 0 computed
        assert answer["planetserve"]["served_by"] == keys[0] and answer["planetserve"]["route"] == "hit"
        assert nodes[1].status()["routes"].get("hit") == 1

        # the organisation delists node 0: node 1 drops it from its group and stops forwarding to it
        done = client.submit(owner, UpdateModelNode(bytes.fromhex(keys[0]), status="inactive"))
        assert done.outcome.ok, done.outcome.log
        wait_until(lambda: nodes[1].status()["group"] == [keys[1]])
        again = nodes[1].complete(SHARED + "What is a frozenset?")
        assert signed(again).node.hex() == keys[1]
    finally:
        for node in nodes:
            node.stop()
        net.close()
