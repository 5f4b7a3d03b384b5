"""Key rotation on four real validators: a running model node process rotated by `planetserve node
rotate-key` switches to its new key at the next epoch's first block without reloading its model,
keeps its registration, listing and reputation, signs its answers with the new key, and its old key is
refused; a member rotated by `planetserve chain rotate-keys` swaps its validator's consensus key, and
its validator signs blocks under the new key, which the light client follows (tests/test_key_rotation.py
has the ledger's rules over whole epochs in process)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from chainnet import LISTED_AT_ONCE, assert_same_app_hashes, ledger, start_network
from modelnodes import SHARED, signed
from roles import NodeProcess, init_home, planetserve
from waiting import wait_until

from planetserve.chain.keys import KeySet
from planetserve.chain.messages import RegisterOrg, UpdateModelNode
from planetserve.node.home import KEYS_FILE, NEXT_KEYS_FILE

pytestmark = pytest.mark.network

SHORT_EPOCHS = replace(LISTED_AT_ONCE, epoch_blocks=20, results_blocks=8, vrf_window_blocks=4, plan_window_blocks=4)
"""Epochs of about 7 s at these blocks' pace: a rotation takes effect at the next one's first block."""


def test_a_running_model_node_rotates_its_key_keeps_its_standing_and_its_old_key_is_refused(
        tmp_path: Path, quick_family: Path) -> None:
    net = start_network(tmp_path / "net", params=SHORT_EPOCHS)
    node: NodeProcess | None = None
    try:
        client = ledger(net)
        owner = KeySet.generate()
        owner_path = tmp_path / "acme.json"
        owner.save(owner_path)
        assert client.submit(owner, RegisterOrg("acme", "ACME")).outcome.ok
        home = tmp_path / "mn"
        init_home(home, net, quick_family)
        node = NodeProcess(home, owner_path)
        old = bytes.fromhex(node.ready["node"])
        registered, standing = client.node(old), client.reputation(old)
        assert registered is not None and standing is not None

        sent = planetserve("node", "rotate-key", "--home", str(home), "--org-keys", str(owner_path), "--json")
        assert sent.returncode == 0, sent.stderr
        rotation = json.loads(sent.stdout)
        new, height = bytes.fromhex(rotation["new"]), rotation["height"]
        assert rotation["node"] == old.hex() and height % SHORT_EPOCHS.epoch_blocks == 1
        assert (home / NEXT_KEYS_FILE).exists()
        again = planetserve("node", "rotate-key", "--home", str(home), "--org-keys", str(owner_path))
        assert again.returncode == 1 and "already rotates" in again.stderr
        assert signed(node.complete(SHARED + "What is a list?")).node == old  # the old key until then

        # at the rotation height the ledger moves the node; the running process follows by itself
        wait_until(lambda: client.node(new) is not None, timeout=60)
        assert client.rpc.latest_height() >= height
        switched = node.wait_ready()
        assert switched["node"] == new.hex() and switched["registration"] == "rotated"
        assert client.node(old) is None
        assert client.node(new) == replace(registered, pubkey=new)
        assert client.reputation(new) == replace(standing, node=new)
        _, listed = client.nodes("gt")
        assert [n.pubkey for n in listed] == [new]
        answer = signed(node.complete(SHARED + "What is a dict?"))
        assert answer.node == new and client.node(answer.node).address == answer.address
        assert not (home / NEXT_KEYS_FILE).exists()
        assert KeySet.load(home / KEYS_FILE).public == new  # the old key's file is gone

        # the old key is refused from the rotation height on
        refused = client.submit(owner, UpdateModelNode(old, capacity=1)).outcome
        assert not refused.ok and "was rotated to" in refused.log and "refused" in refused.log

        # a restart serves under the new key, registered as it is
        node.stop()
        node = NodeProcess(home, None)
        assert node.ready["node"] == new.hex() and node.ready["registration"] == "existing"
        assert_same_app_hashes(net, height + 1)
    finally:
        if node is not None:
            node.stop()
        net.close()
