"""Carrying state into a new genesis, in the real Application: a chain that goes on from its own export
reaches the exported app hash at InitChain and the same hashes after; a new chain from another's
registry has its users and organisations and a committee of its own; exports that are not whole are
refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from committee import EPOCH_PARAMS, Script
from google.protobuf.timestamp_pb2 import Timestamp
from harness import CHAIN_ID, AppHarness, sqlite_url
from tendermint.abci import types_pb2 as abci
from tendermint.crypto import keys_pb2

from planetserve.chain import layout
from planetserve.chain.abci.app import Application
from planetserve.chain.abci.state import State, members
from planetserve.chain.abci.store import StateStore
from planetserve.chain.errors import Code
from planetserve.chain.keys import KeySet
from planetserve.chain.messages import RotateNodeKey
from planetserve.cli import main
from planetserve.genesis.export import ExportError, export_genesis, registry_of
from planetserve.registry.entities import Member
from planetserve.registry.errors import InvalidField
from planetserve.registry.genesis import AppState, parse_app_state

CONSENSUS = {"block": {"max_bytes": "4194304", "max_gas": "-1"}, "version": {"app": "0"}}


def populated(tmp_path: Path) -> tuple[AppHarness, list[KeySet]]:
    h = AppHarness(sqlite_url(tmp_path), members=2)
    users = [KeySet.generate() for _ in range(5)]
    owner = KeySet.generate()
    h.block(*(h.tx(k, "register-user", {"address": f"10.7.0.{i}:9000", "region": "eu"}) for i, k in enumerate(users)),
            h.tx(owner, "register-org", {"org_id": "acme", "name": "Acme"}))
    h.block()
    return h, users


def init_request(doc: dict, initial_height: int) -> abci.RequestInitChain:
    app_state = parse_app_state(doc["app_state"])
    return abci.RequestInitChain(
        chain_id=doc["chain_id"], initial_height=initial_height, app_state_bytes=json.dumps(doc["app_state"]).encode(),
        validators=[abci.ValidatorUpdate(pub_key=keys_pb2.PublicKey(ed25519=m.consensus_key), power=m.power)
                    for m in app_state.committee])


def test_a_chain_goes_on_from_its_export_with_the_same_app_hashes(tmp_path: Path) -> None:
    h, users = populated(tmp_path)
    doc = export_genesis(h.store, {"chain_id": CHAIN_ID, "consensus_params": CONSENSUS})
    assert doc["initial_height"] == "3" and len(doc["validators"]) == 2 and doc["consensus_params"]["version"] == {
        "app": "1"}
    with StateStore(sqlite_url(tmp_path, "next.db")) as store:
        app = Application(store)
        assert app.init_chain(init_request(doc, 3)).app_hash == h.store.app_hash
        h.block(h.tx(KeySet.generate(), "register-user", {"address": "10.7.1.1:9000", "region": "eu"}))
        request, app_hash = h.blocks[-1]
        assert app.finalize_block(request).app_hash == app_hash
        app.commit(abci.RequestCommit())
        assert all(State(store.batch()).user(k.public) is not None for k in users)


def test_a_new_chain_takes_the_registry_of_an_export_and_a_committee_of_its_own(tmp_path: Path) -> None:
    h, users = populated(tmp_path)
    path = tmp_path / "exported.json"
    path.write_text(json.dumps(export_genesis(h.store, {"chain_id": CHAIN_ID, "consensus_params": CONSENSUS})))
    registry = registry_of(path, "planetserve-next")
    assert registry and all(k.startswith(layout.REGISTRY_PREFIXES) for k, _ in registry)
    assert not any(k.startswith((layout.MEMBER_PREFIX, b"epoch/")) for k, _ in registry)
    newcomer = KeySet.generate()
    member = Member(newcomer.public, KeySet.generate().public, bytes(newcomer.vrf.verify_key),
                    bytes(newcomer.x25519.public_key), "new committee", 10)
    fresh = AppState(h.app.params, (member,), models=(), exported=registry)
    doc = {"chain_id": "planetserve-next", "app_state": fresh.to_json()}
    with StateStore(sqlite_url(tmp_path, "new.db")) as store:
        app = Application(store)
        app.init_chain(init_request(doc, 1))
        st = State(app.block)
        assert all(st.user(k.public) is not None for k in users)
        assert st.org("acme") is not None
        assert list(members(app.block)) == [newcomer.public]
        assert st.epoch(0) is not None


def test_exports_that_are_not_whole_are_refused(tmp_path: Path) -> None:
    h, _ = populated(tmp_path)
    doc = export_genesis(h.store, {"chain_id": CHAIN_ID, "consensus_params": CONSENSUS})
    swapped = json.loads(json.dumps(doc))
    swapped["app_state"]["exported"][:2] = swapped["app_state"]["exported"][1::-1]
    with pytest.raises(InvalidField, match="keys out of order"):
        parse_app_state(swapped["app_state"])
    stranger = parse_app_state(doc["app_state"]).committee[0]
    other = json.loads(json.dumps(doc))
    other["app_state"]["committee"][0]["credential"] = stranger.credential + " (changed)"
    with StateStore(sqlite_url(tmp_path, "other.db")) as store, \
            pytest.raises(ValueError, match="committee is not the genesis committee"):
        Application(store).init_chain(init_request(other, 3))
    not_export = tmp_path / "plain.json"
    not_export.write_text(json.dumps({"app_state": {"committee": []}}))
    with pytest.raises(ExportError, match="is not a genesis written by"):
        registry_of(not_export, "planetserve-next")
    with StateStore(sqlite_url(tmp_path, "empty.db")) as store, pytest.raises(ExportError, match="no committed"):
        export_genesis(store, {"chain_id": CHAIN_ID, "consensus_params": CONSENSUS})


def test_an_export_with_a_node_rotation_pending_gives_no_registry_until_it_took_effect(tmp_path: Path) -> None:
    """The rotation is due at a height of the exported chain: a new network would keep the node under its
    old key and its new key reserved, so the registry is refused until the rotation has happened."""
    s = Script(AppHarness(sqlite_url(tmp_path), members=4, params=EPOCH_PARAMS))
    old = next(iter(s.nodes))
    new = KeySet.generate()
    [result] = s.h.block(s.tx(s.owner, "rotate-node-key",
                              RotateNodeKey.signed(CHAIN_ID, "org1", s.nodes[old], new).body())).tx_results
    assert result.code == 0, result.log
    due = s.schedule.start(1)
    path = tmp_path / "exported.json"
    path.write_text(json.dumps(export_genesis(s.h.store, {"chain_id": CHAIN_ID, "consensus_params": CONSENSUS})))
    with pytest.raises(ExportError) as refused:
        registry_of(path, "planetserve-next")
    assert str(refused.value) == (
        f"{path} holds 1 node rotation(s) not yet in effect ({old.hex()[:16]}… → {new.public.hex()[:16]}…), due "
        f"by height {due} of the exported chain: a new network would keep those nodes under their old keys; "
        f"export again once the chain is past that height")
    s.run_to(due + 1)  # block `due` moved the node
    path.write_text(json.dumps(export_genesis(s.h.store, {"chain_id": CHAIN_ID, "consensus_params": CONSENSUS})))
    nodes = [k for k, _ in registry_of(path, "planetserve-next") if k.startswith(layout.key("node", ""))]
    assert layout.key("node", new.public.hex()) in nodes and layout.key("node", old.hex()) not in nodes


def test_a_transaction_signed_on_the_exported_chain_is_refused_by_the_new_one(tmp_path: Path) -> None:
    """Whoever holds a transaction of the old chain that it never committed (one in its mempool when it
    stopped, say) replays it on a new network that carried the accounts and their sequences over. The new
    network has a chain id of its own, so the transaction names the wrong chain (and its signature covers
    the name); under the old id the export is
    refused."""
    h, users = populated(tmp_path)
    path = tmp_path / "exported.json"
    path.write_text(json.dumps(export_genesis(h.store, {"chain_id": CHAIN_ID, "consensus_params": CONSENSUS})))
    with pytest.raises(ExportError, match=f"is an export of chain '{CHAIN_ID}': give the new network a chain id"):
        registry_of(path, CHAIN_ID)
    newcomer = KeySet.generate()
    member = Member(newcomer.public, KeySet.generate().public, bytes(newcomer.vrf.verify_key),
                    bytes(newcomer.x25519.public_key), "new committee", 10)
    fresh = AppState(h.app.params, (member,), models=(), exported=registry_of(path, "planetserve-next"))
    with StateStore(sqlite_url(tmp_path, "new.db")) as store:
        app = Application(store)
        app.init_chain(init_request({"chain_id": "planetserve-next", "app_state": fresh.to_json()}, 1))
        replayed = h.tx(users[0], "heartbeat", {}, sequence=1)  # signed for the old chain, never sent there
        own = h.tx(users[0], "heartbeat", {}, sequence=1, chain_id="planetserve-next")
        block = app.finalize_block(abci.RequestFinalizeBlock(txs=[replayed, own], height=1,
                                                             time=Timestamp(seconds=h.time + 5)))
        assert [r.code for r in block.tx_results] == [Code.WRONG_CHAIN_ID, 0]  # the sequence was open to both


def test_genesis_init_from_an_export_needs_a_chain_id_of_its_own(tmp_path: Path) -> None:
    h, _ = populated(tmp_path)
    path = tmp_path / "exported.json"
    path.write_text(json.dumps(export_genesis(h.store, {"chain_id": "planetserve-local",
                                                        "consensus_params": CONSENSUS})))
    for named, message in [((), "--from-export needs --chain-id"),
                           (("--chain-id", "planetserve-local"), "is an export of chain 'planetserve-local'")]:
        out = tmp_path / f"net{len(named)}"
        done = CliRunner().invoke(main, ["genesis", "init", str(out), "-n", "1", "--from-export", str(path), *named])
        assert done.exit_code == 1 and message in done.output, done.output
        assert not out.exists()
    done = CliRunner().invoke(main, ["genesis", "init", str(tmp_path / "next"), "-n", "1", "--from-export", str(path),
                                     "--chain-id", "planetserve-next", "--json"])
    assert done.exit_code == 0, done.output
    assert json.loads(done.output)["chain_id"] == "planetserve-next"
