"""Key rotation on four real validators: a running model node process rotated by `planetserve node
rotate-key` switches to its new key at the next epoch's first block without reloading its model,
keeps its registration, listing and reputation, signs its answers with the new key, and its old key is
refused (rotated again while stopped, it starts under the newest key); a member rotated by
`planetserve chain rotate-keys` swaps its validator's consensus key, and its validator signs blocks
under the new key, which the light client follows (tests/test_key_rotation.py has the ledger's rules
over whole epochs in process)."""

from __future__ import annotations

import base64
import json
from dataclasses import replace
from pathlib import Path

import pytest
from chainnet import SHORT_EPOCHS, assert_same_app_hashes, ledger, member_keys, start_network
from click.testing import CliRunner, Result
from modelnodes import SHARED, signed
from roles import NodeProcess, acme_network
from waiting import wait_until

from planetserve.chain.abci.epochs import validator_address
from planetserve.chain.client import LedgerClient
from planetserve.chain.keys import KeySet, retired_key_file
from planetserve.chain.messages import ProposeParams, UpdateModelNode
from planetserve.cli import main
from planetserve.genesis.network import KEYS_FILE as MEMBER_KEYS_FILE
from planetserve.genesis.network import consensus_pubkey
from planetserve.localnet.cluster import Cluster
from planetserve.node.home import KEYS_FILE, NEXT_KEYS_FILE

pytestmark = pytest.mark.network



def cli(*args: str) -> Result:
    """A command run in this process: quick enough to act within an epoch of these short ones."""
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def at_epoch_start(client: LedgerClient) -> None:
    """Wait for an epoch's first blocks, so that a rotation sent now leaves the whole epoch to check
    what holds before it takes effect."""
    wait_until(lambda: (client.rpc.latest_height() - 1) % SHORT_EPOCHS.epoch_blocks < 2, timeout=60,
               interval=0.05)


def test_a_running_model_node_rotates_its_key_keeps_its_standing_and_its_old_key_is_refused(
        tmp_path: Path, quick_family: Path) -> None:
    with acme_network(tmp_path, quick_family, SHORT_EPOCHS) as (net, client, node, _):
        home, owner_path = tmp_path / "mn", tmp_path / "acme.json"
        old = bytes.fromhex(node.ready["node"])
        registered, standing = client.node(old), client.reputation(old)
        assert registered is not None and standing is not None

        at_epoch_start(client)
        sent = cli("node", "rotate-key", "--home", str(home), "--org-keys", str(owner_path), "--json")
        assert sent.exit_code == 0, sent.output
        rotation = json.loads(sent.stdout)
        new, height = bytes.fromhex(rotation["new"]), rotation["height"]
        assert rotation["node"] == old.hex() and height % SHORT_EPOCHS.epoch_blocks == 1
        assert (home / NEXT_KEYS_FILE).exists()
        again = cli("node", "rotate-key", "--home", str(home), "--org-keys", str(owner_path))
        assert again.exit_code == 1 and "already rotates" in again.stderr
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
        refused = client.submit(KeySet.load(owner_path), UpdateModelNode(old, capacity=1)).outcome
        assert not refused.ok and "was rotated to" in refused.log and "refused" in refused.log

        # rotated again while it is stopped: it starts under the newest key, registered as it is
        node.stop()
        at_epoch_start(client)
        sent = cli("node", "rotate-key", "--home", str(home), "--org-keys", str(owner_path), "--json")
        assert sent.exit_code == 0, sent.output
        newest = bytes.fromhex(json.loads(sent.stdout)["new"])
        wait_until(lambda: client.node(newest) is not None, timeout=60)
        restarted = NodeProcess(home, None)
        try:
            assert restarted.ready["node"] == newest.hex() and restarted.ready["registration"] == "existing"
            assert signed(restarted.complete(SHARED + "What is a set?")).node == newest
        finally:
            restarted.stop()
        assert client.reputation(newest) == replace(standing, node=newest)
        assert_same_app_hashes(net, height + 1)


def signed_by(net: Cluster, address: bytes) -> bool:
    """Whether the latest commit carries a signature of the validator at `address`."""
    commit = net.rpc(0).commit()["commit"]
    return any(bytes.fromhex(sig.get("validator_address") or "00") == address and sig.get("signature")
               for sig in commit["signatures"])


def test_a_member_rotates_its_keys_and_its_validator_signs_under_the_new_consensus_key(tmp_path: Path) -> None:
    net = start_network(tmp_path / "net", params=SHORT_EPOCHS, timeout_commit="100ms", timeout_propose="500ms")
    try:
        client = ledger(net)
        home = net.spec.validators[3].home
        rpc = ("--node", net.rpc_url(0))
        old_operator, old_consensus = member_keys(net, 3), consensus_pubkey(home)
        early = cli("chain", "rotate-keys", "--home", str(home), "--finish", *rpc)
        assert early.exit_code == 1 and "no prepared rotation" in early.stderr

        at_epoch_start(client)
        sent = cli("chain", "rotate-keys", "--home", str(home), *rpc, "--json")
        assert sent.exit_code == 0, sent.output
        rotation = json.loads(sent.stdout)
        height, new_operator = rotation["height"], bytes.fromhex(rotation["new_operator"])
        assert rotation["operator"] == old_operator.public.hex() and height % SHORT_EPOCHS.epoch_blocks == 1
        not_yet = cli("chain", "rotate-keys", "--home", str(home), "--finish", *rpc)
        assert not_yet.exit_code == 1 and f"due at height {height}" in not_yet.stderr
        assert consensus_pubkey(home) == old_consensus  # nothing moved

        wait_until(lambda: any(m.operator == new_operator for m in client.committee()[1]), timeout=60)
        net.stop(3)
        done = cli("chain", "rotate-keys", "--home", str(home), "--finish", *rpc, "--json")
        assert done.exit_code == 0, done.output
        new_consensus = consensus_pubkey(home)
        assert json.loads(done.stdout)["consensus_key"] == new_consensus.hex() != old_consensus.hex()
        assert member_keys(net, 3).public == new_operator
        assert KeySet.load(retired_key_file(home / "config" / MEMBER_KEYS_FILE)).public == old_operator.public
        net.start(3)

        # the validator signs under its new key, the set holds it and not the old one, and a light
        # client that starts from the genesis follows the change through the rotated validator's RPC
        wait_until(lambda: signed_by(net, validator_address(new_consensus)), timeout=60)
        _, validators = client.rpc.validators()
        keys = {v["pub_key"]["value"] for v in validators}
        assert len(keys) == 4 and consensus_b64(new_consensus) in keys and consensus_b64(old_consensus) not in keys
        listing, committee = ledger(net, 3).committee()
        assert listing.verified and new_operator in {m.operator for m in committee}
        assert old_operator.public not in {m.operator for m in committee}

        # the old operator key is no member from the rotation height on; the new one is
        at = client.rpc.latest_height() + 50
        refused = client.submit(old_operator, ProposeParams(at, {"user_ttl_seconds": 999})).outcome
        assert not refused.ok and "not a committee member" in refused.log
        assert client.submit(member_keys(net, 3), ProposeParams(at, {"user_ttl_seconds": 999})).outcome.ok
        assert_same_app_hashes(net, height + 2)
    finally:
        net.close()


def consensus_b64(key: bytes) -> str:
    return base64.b64encode(key).decode()
