"""ABCI queries: lists and entries with proofs against the committed app hash, and their refusals."""

from __future__ import annotations

import json

import pytest
from harness import CHAIN_ID, AppHarness, node_body, sqlite_url
from tendermint.abci import types_pb2 as abci
from tendermint.crypto import keys_pb2

from planetserve.chain import layout, trie
from planetserve.chain.abci.app import Application
from planetserve.chain.abci.store import StateStore
from planetserve.chain.client import QueryRefused, decode_entries, holding_node
from planetserve.chain.errors import Code
from planetserve.chain.keys import KeySet
from planetserve.registry import codec
from planetserve.registry.entities import ModelNode
from planetserve.registry.params import Params


@pytest.fixture
def h(tmp_path):
    # Nodes are listed from registration (no probation): these tests read the lists, not how nodes get on them.
    h = AppHarness(sqlite_url(tmp_path), params=Params(max_query_entries=5, probation_epochs=0))
    owner = KeySet.generate()
    txs = [h.tx(owner, "register-org", {"org_id": "org1", "name": "O"})]
    for i in range(4):
        node = KeySet.generate()
        txs.append(h.tx(owner, "register-model-node",
                        node_body(node, address=f"10.0.0.{i}:7000", region="eu" if i % 2 else "us")))
    for i in range(7):
        txs.append(h.tx(KeySet.generate(), "register-user", {"address": f"10.1.0.{i}:9000", "region": "eu"}))
    results = h.block(*txs)
    assert all(r.code == 0 for r in results.tx_results)
    h.owner = owner
    return h


def verified_list(h: AppHarness, prefix: bytes) -> list[tuple[bytes, bytes]]:
    res = h.query("/prefix", prefix)
    assert res.code == 0, res.log
    assert res.height == h.store.height
    (op,) = res.proof_ops.ops
    entries = decode_entries(res.value, prefix)
    trie.verify_prefix(h.store.app_hash, prefix, entries, trie.PrefixProof.decode(op.data))
    return entries


def test_node_lists_per_model_and_region(h):
    assert len(verified_list(h, layout.node_list_prefix("gt"))) == 4
    eu = verified_list(h, layout.node_list_prefix("gt", "eu"))
    assert len(eu) == 2 and all(ModelNode.decode(v).region == "eu" for _, v in eu)
    assert verified_list(h, layout.node_list_prefix("unknown-model")) == []


def test_key_present_and_absent(h):
    res = h.query("/key", layout.org_key("org1"))
    assert res.info == "found"
    trie.verify_key(h.store.app_hash, layout.org_key("org1"), res.value,
                    trie.PrefixProof.decode(res.proof_ops.ops[0].data))
    res = h.query("/key", layout.org_key("nobody"))
    assert res.info == "absent"
    trie.verify_key(h.store.app_hash, layout.org_key("nobody"), None,
                    trie.PrefixProof.decode(res.proof_ops.ops[0].data))


def test_historical_height_is_proven_against_its_own_root(h):
    old_height, old_root = h.store.height, h.store.app_hash
    h.block(h.tx(KeySet.generate(), "register-user", {"address": "10.9.9.9:1", "region": "us"}))
    res = h.app.query(abci.RequestQuery(
        path="/prefix", data=layout.user_list_prefix("us"), height=old_height, prove=True))
    assert res.code == 0 and res.height == old_height
    trie.verify_prefix(old_root, layout.user_list_prefix("us"), [],
                       trie.PrefixProof.decode(res.proof_ops.ops[0].data))


@pytest.mark.parametrize(
    ("path", "data", "code", "words"),
    [
        ("/nope", b"x", Code.UNKNOWN_TYPE, "unknown query path"),
        ("/prefix", "é".encode(), Code.INVALID_FIELD, "ASCII"),
        ("/prefix", layout.user_list_prefix("eu"), Code.OVERSIZE, "more than 5"),
    ],
)
def test_query_refusals(h, path, data, code, words):
    res = h.query(path, data)
    assert res.code == code and words in res.log and res.codespace == "planetserve"


def test_unknown_height_is_refused(h):
    res = h.app.query(abci.RequestQuery(path="/prefix", data=b"org/", height=999, prove=True))
    assert res.code == Code.INVALID_FIELD and "no committed state at height 999" in res.log


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (b"\xc1", "malformed list"),
        (codec.pack([["k", b"v"]]), "must be bytes"),
        (codec.pack([[b"k"]]), "malformed list"),
        (codec.pack(7), "malformed list"),
    ],
)
def test_malformed_list_answers_are_refused(value, words):
    with pytest.raises(QueryRefused, match=words):
        decode_entries(value, b"nlist/")


def test_repeated_queries_are_answered_alike_and_latest_moves_on(h):
    prefix = layout.node_list_prefix("gt", "eu")
    first = h.app.query(abci.RequestQuery(path="/prefix", data=prefix, prove=True, height=0))
    again = h.app.query(abci.RequestQuery(path="/prefix", data=prefix, prove=True, height=0))
    assert first.code == 0 and again == first
    owner, node = h.owner, KeySet.generate()
    h.block(h.tx(owner, "register-model-node", node_body(node, address="10.0.9.9:7000")))
    later = h.app.query(abci.RequestQuery(path="/prefix", data=prefix, prove=True, height=0))
    assert later.height == first.height + 1
    assert len(decode_entries(later.value, prefix)) == len(decode_entries(first.value, prefix)) + 1


def test_genesis_whose_validators_differ_from_the_committee_is_refused(tmp_path):
    app = Application(StateStore(sqlite_url(tmp_path, "b.db")))
    stranger = KeySet.generate()
    with pytest.raises(ValueError, match="do not match the app_state committee"):
        app.init_chain(abci.RequestInitChain(
            chain_id=CHAIN_ID,
            validators=[abci.ValidatorUpdate(pub_key=keys_pb2.PublicKey(ed25519=stranger.public), power=10)],
            app_state_bytes=json.dumps({"committee": [{
                "operator": "11" * 32, "consensus_key": "22" * 32, "vrf_key": "33" * 32,
                "x25519_key": "44" * 32, "credential": "c", "power": 10}]}).encode(),
        ))


def test_a_prefix_ending_in_nul_selects_one_key_and_verifies(h):
    """The query the client's list paging uses to find the node that holds a list."""
    key = layout.org_key("org1")
    assert verified_list(h, key + b"\x00") == [(key, h.store.batch().get(key))]
    assert verified_list(h, layout.ORG_PREFIX + b"\x00") == []  # no key equals a list prefix


def test_the_node_holding_a_list_is_read_off_the_proof_for_its_prefix_key(h):
    """`holding_node` (list paging): at the node's opening when no key equals the prefix, or at the
    last step above the key's leaf when one does."""
    owner = h.owner
    assert all(r.code == 0 for r in h.block(*(h.tx(owner, "register-org", {"org_id": f"org1{c}", "name": c})
                                              for c in "xy")).tx_results)
    for prefix, want in ((layout.ORG_PREFIX, (layout.ORG_PREFIX + b"org1", [0, ord("x"), ord("y")])),
                         (layout.org_key("org1"), (layout.org_key("org1"), [0, ord("x"), ord("y")]))):
        res = h.query("/prefix", prefix + b"\x00")
        assert holding_node(prefix, trie.PrefixProof.decode(res.proof_ops.ops[0].data)) == want
    alone = layout.org_key("org1x")  # one entry: no node holds more
    res = h.query("/prefix", alone + b"\x00")
    with pytest.raises(QueryRefused, match="yet no trie node holds more than one of its entries"):
        holding_node(alone, trie.PrefixProof.decode(res.proof_ops.ops[0].data))


def test_queries_on_another_thread_see_whole_commits_and_change_no_app_hash(tmp_path):
    """Queries run on worker threads while blocks execute (server.py): each answer is the list of one
    committed height, proven against that height's app hash, whatever commits meanwhile (the latest
    height, the one before it through the undo log, older ones through the trie, and cached answers),
    and the blocks' app hashes are those of the same blocks run without queries."""
    import threading

    h = AppHarness(sqlite_url(tmp_path), params=Params(probation_epochs=0))
    h.block()
    prefix = layout.user_list_prefix("eu")
    expected = {h.store.height: 0}  # height -> users in the list
    stop, failures, checked = threading.Event(), [], [0]

    def reader() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            latest = h.store.height
            height = (0, latest, latest - 1, latest - 2, 1)[n % 5]
            res = h.app.query(abci.RequestQuery(path="/prefix", data=prefix, height=max(height, 0), prove=True))
            try:
                assert res.code == 0, res.log
                entries = decode_entries(res.value, prefix)
                trie.verify_prefix(h.store.root_at(res.height), prefix, entries,
                                   trie.PrefixProof.decode(res.proof_ops.ops[0].data))
                assert len(entries) == expected[res.height], (res.height, len(entries))
            except Exception as exc:  # reported by the main thread
                failures.append(exc)
                return
            checked[0] += 1

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        users = 0
        for _ in range(30):
            txs = [h.tx(KeySet.generate(), "register-user", {"address": f"10.2.{users + i}.1:9000", "region": "eu"})
                   for i in range(4)]
            users += len(txs)
            expected[h.store.height + 1] = users
            assert all(r.code == 0 for r in h.block(*txs).tx_results)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not failures, failures[0]
    assert checked[0] >= 30
    assert all(mine == replayed for mine, replayed in h.replay(sqlite_url(tmp_path, "replay.db")))
