"""Every refusal of CheckTx and FinalizeBlock has its own code and a readable log; nothing changes."""

from __future__ import annotations

import pytest
from harness import CHAIN_ID, AppHarness, node_body, relaxed, sqlite_url

from planetserve.chain import layout
from planetserve.chain import tx as txlib
from planetserve.chain.abci.app import Application
from planetserve.chain.abci.state import State
from planetserve.chain.abci.store import StateStore
from planetserve.chain.errors import Code
from planetserve.chain.keys import KeySet
from planetserve.registry import codec
from planetserve.registry.params import Params

PARAMS = Params(user_ttl_seconds=60, probation_epochs=0)
"""Nodes are listed from registration, so that a test can see an update take one off the list."""


@pytest.fixture
def h(tmp_path):
    return AppHarness(sqlite_url(tmp_path), params=PARAMS)


def code(h: AppHarness, raw: bytes, seconds: int = 5) -> int:
    """The result code of a block holding one transaction."""
    return h.block(raw, seconds=seconds).tx_results[0].code


def test_valid_registrations_commit(h):
    owner, node, user = KeySet.generate(), KeySet.generate(), KeySet.generate()
    result = h.block(
        h.tx(owner, "register-org", {"org_id": "org1", "name": "Org One"}),
        h.tx(owner, "register-model-node", node_body(node)),
        h.tx(user, "register-user", {"address": "10.0.0.9:9000", "region": "eu"}),
    )
    assert [r.code for r in result.tx_results] == [0, 0, 0]
    st = State(h.store.batch())
    assert st.org("org1").owner == owner.public
    assert st.node(node.public).model_id == "gt"
    assert st.user(user.public).expires_at == h.time + 60
    assert h.store.app_hash == result.app_hash


@pytest.mark.parametrize(
    ("raw", "code", "words"),
    [
        (b"\xc1garbage", Code.UNDECODABLE, "undecodable"),
        (codec.pack([1, "x"]), Code.UNDECODABLE, "7-element"),
        (b"\x00" * 20_000, Code.OVERSIZE, "exceeds the limit"),
    ],
)
def test_envelope_refusals(h, raw, code, words):
    res = h.check(raw)
    assert res.code == code and words in res.log


def test_non_canonical_encoding_is_refused(h):
    keys = KeySet.generate()
    raw = txlib.build(keys, CHAIN_ID, "register-org", {"org_id": "o", "name": "n"}, 0)
    # the same array, but the sequence 0 spelled as a 2-byte uint8 instead of a fixint
    fields = codec.unpack(raw)
    loose = b"\x97" + b"".join(codec.pack(f) for f in fields[:4]) + b"\xcc\x00"
    loose += b"".join(codec.pack(f) for f in fields[5:])
    assert codec.unpack(raw) == fields
    res = h.check(loose)
    assert res.code == Code.UNDECODABLE and "canonical" in res.log


def test_signature_chain_sequence_and_type(h):
    keys, other = KeySet.generate(), KeySet.generate()
    body = {"org_id": "org1", "name": "Org One"}
    good = txlib.Tx("register-org", body, keys.public, 0, CHAIN_ID)
    forged = txlib.Tx("register-org", body, keys.public, 0, CHAIN_ID, other.sign(good.sign_bytes())).encode()
    assert h.check(forged).code == Code.BAD_SIGNATURE
    assert h.check(h.tx(keys, "register-org", body, sequence=0, chain_id="other")).code == Code.WRONG_CHAIN_ID
    assert h.check(h.tx(keys, "no-such-type", {}, sequence=0)).code == Code.UNKNOWN_TYPE
    res = h.check(h.tx(keys, "register-org", body, sequence=3))
    assert res.code == Code.BAD_SEQUENCE and "out of order" in res.log
    first = h.tx(keys, "register-org", body)
    assert h.block(first).tx_results[0].code == 0
    res = h.check(first)
    assert res.code == Code.BAD_SEQUENCE and "replayed" in res.log
    assert h.block(first).tx_results[0].code == Code.BAD_SEQUENCE


def test_field_entity_and_authorization_refusals(h):
    owner, stranger, node = KeySet.generate(), KeySet.generate(), KeySet.generate()
    assert h.block(h.tx(owner, "register-org", {"org_id": "org1", "name": "Org One"})).tx_results[0].code == 0
    before = h.registry_state()
    cases = [
        (owner, "register-org", {"org_id": "org2"}, Code.INVALID_FIELD, "'name': missing"),
        (owner, "register-org", {"org_id": "org2", "name": "x", "extra": 1}, Code.INVALID_FIELD, "unknown field"),
        (owner, "register-org", {"org_id": "bad id!", "name": "x"}, Code.INVALID_FIELD, "'org_id'"),
        (owner, "register-org", {"org_id": "org1", "name": "again"}, Code.ALREADY_EXISTS, "already registered"),
        (stranger, "register-user", {"address": "nohost", "region": "eu"}, Code.INVALID_FIELD, "host:port"),
        # digits outside ASCII: which of them str.isdigit() knows depends on the Python version
        (stranger, "register-user", {"address": "10.0.0.1:\u0668\u0660", "region": "eu"}, Code.INVALID_FIELD,
         "port in 1-65535"),
        (stranger, "register-user", {"address": "10.0.0.1:\U00011f51\U00011f50", "region": "eu"},
         Code.INVALID_FIELD, "port in 1-65535"),
        (stranger, "heartbeat", {}, Code.UNKNOWN_ENTITY, "not registered"),
        (owner, "register-model-node", node_body(node, org_id="missing"), Code.UNKNOWN_ENTITY, "organisation"),
        (stranger, "register-model-node", node_body(node), Code.UNAUTHORIZED, "does not own"),
        (owner, "register-model-node", node_body(node, model_id="nope"), Code.UNKNOWN_ENTITY, "model"),
        (owner, "register-model-node", node_body(node, pop=b"\x01" * 64), Code.INVALID_FIELD, "pop"),
        (owner, "register-model-node", node_body(node, capacity=0), Code.INVALID_FIELD, "capacity"),
        (stranger, "register-model", {"model_id": "m2", "name": "x"}, Code.UNAUTHORIZED, "committee"),
        (stranger, "vote-member", {"proposal_id": 1, "approve": True}, Code.UNAUTHORIZED, "committee"),
    ]
    for signer, tx_type, body, code, words in cases:
        raw = h.tx(signer, tx_type, body)
        res = h.check(raw)
        assert (res.code, words in res.log) == (code, True), (tx_type, res.code, res.log)
        assert res.codespace == "planetserve"
        result = h.block(raw).tx_results[0]
        assert result.code == code, (tx_type, result.log)
    assert h.registry_state() == before


def test_user_expiry_and_heartbeat(h):
    user = KeySet.generate()
    register = {"address": "1.2.3.4:5", "region": "eu"}
    assert code(h, h.tx(user, "register-user", register)) == 0
    assert code(h, h.tx(user, "register-user", register)) == Code.ALREADY_EXISTS
    assert code(h, h.tx(user, "heartbeat", {"region": "us"}), seconds=30) == 0
    st = State(h.store.batch())
    assert st.user(user.public).region == "us"
    assert st.user(user.public).expires_at == h.time + 60
    h.block(seconds=61)
    assert State(h.store.batch()).user(user.public) is None
    assert not list(h.store.batch().iterate(layout.user_list_prefix()))
    assert code(h, h.tx(user, "heartbeat", {})) == Code.UNKNOWN_ENTITY
    assert code(h, h.tx(user, "register-user", register)) == 0


def test_expired_user_in_mempool_gets_expired_code(h):
    user = KeySet.generate()
    h.block(h.tx(user, "register-user", {"address": "1.2.3.4:5", "region": "eu"}))
    h.block(seconds=59)
    # The mempool checks against the last committed block time; advance it past expiry without a sweep.
    h.app.committed_time += 10
    res = h.check(h.tx(user, "heartbeat", {}))
    assert res.code == Code.EXPIRED and "expired" in res.log


def test_non_owner_cannot_update_node(h):
    owner, stranger, node = KeySet.generate(), KeySet.generate(), KeySet.generate()
    h.block(h.tx(owner, "register-org", {"org_id": "org1", "name": "O"}),
            h.tx(owner, "register-model-node", node_body(node)))
    res = h.block(h.tx(stranger, "update-model-node", {"node_pubkey": node.public, "capacity": 9}))
    assert res.tx_results[0].code == Code.UNAUTHORIZED
    assert len(list(h.store.batch().iterate(layout.node_list_prefix("gt")))) == 1
    res = h.block(h.tx(owner, "update-model-node", {"node_pubkey": node.public, "status": "inactive"}))
    assert res.tx_results[0].code == 0
    assert not list(h.store.batch().iterate(layout.node_list_prefix("gt")))
    again = h.block(h.tx(owner, "register-model-node", node_body(node)))
    assert again.tx_results[0].code == Code.ALREADY_EXISTS


def test_committee_admission_needs_more_than_two_thirds(tmp_path):
    h = AppHarness(sqlite_url(tmp_path), members=4)
    candidate, consensus = KeySet.generate(), KeySet.generate()
    body = {"action": "add", "operator": candidate.public, "consensus_key": consensus.public,
            "vrf_key": bytes(candidate.vrf.verify_key), "x25519_key": bytes(candidate.x25519.public_key),
            "credential": "University X", "power": 10}
    res = h.block(h.tx(h.members[0], "propose-member", body))
    assert res.tx_results[0].code == 0 and not res.validator_updates
    res = h.block(h.tx(h.members[1], "vote-member", {"proposal_id": 1, "approve": True}))
    assert not res.validator_updates  # 20 of 40 is not more than 2/3
    again = h.block(h.tx(h.members[1], "vote-member", {"proposal_id": 1, "approve": True}))
    assert again.tx_results[0].code == Code.ALREADY_EXISTS
    res = h.block(h.tx(h.members[2], "vote-member", {"proposal_id": 1, "approve": True}))
    assert [(u.pub_key.ed25519, u.power) for u in res.validator_updates] == [(consensus.public, 10)]
    assert State(h.store.batch()).member(candidate.public).credential == "University X"
    late = h.block(h.tx(h.members[3], "vote-member", {"proposal_id": 1, "approve": True}))
    assert late.tx_results[0].code == Code.UNKNOWN_ENTITY
    # removal: 5 members of power 10; 4 yes votes (40 of 50) are needed
    res = h.block(h.tx(h.members[0], "propose-member", {"action": "remove", "operator": h.members[3].public}))
    for voter in (h.members[1], h.members[2]):
        assert not h.block(h.tx(voter, "vote-member", {"proposal_id": 2, "approve": True})).validator_updates
    res = h.block(h.tx(candidate, "vote-member", {"proposal_id": 2, "approve": True}))
    assert [(u.pub_key.ed25519, u.power) for u in res.validator_updates] == [(h.consensus[3].public, 0)]


def test_rejection_by_a_third_drops_the_proposal(tmp_path):
    h = AppHarness(sqlite_url(tmp_path), members=3)
    body = {"action": "remove", "operator": h.members[2].public}
    h.block(h.tx(h.members[0], "propose-member", body))
    res = h.block(h.tx(h.members[2], "vote-member", {"proposal_id": 1, "approve": False}))
    assert res.tx_results[0].code == 0
    assert State(h.store.batch()).proposal(1) is None


def test_failed_tx_consumes_only_its_sequence(h):
    """A refused transaction of an account consumes its sequence and nothing else; a key without an
    account whose transactions are all refused gets none (a flood of them leaves no record)."""
    keys = KeySet.generate()
    h.block()
    everything = dict(h.store.batch().iterate(b""))
    bad = h.tx(keys, "register-org", {"org_id": "org1"})
    assert h.block(bad).tx_results[0].code == Code.INVALID_FIELD
    assert dict(h.store.batch().iterate(b"")) == everything
    assert State(h.store.batch()).sequence(keys.public) == 0
    assert h.block(h.tx(keys, "register-org", {"org_id": "org1", "name": "Org One"})).tx_results[0].code == 0
    before = h.registry_state()
    bad = h.tx(keys, "register-org", {"org_id": "org2"})
    assert h.block(bad).tx_results[0].code == Code.INVALID_FIELD
    assert h.registry_state() == before
    assert State(h.store.batch()).sequence(keys.public) == 2


def test_a_transaction_refused_by_check_tx_leaves_its_sequence_free(h):
    keys = KeySet.generate()
    bad = h.tx(keys, "register-org", {"org_id": "org1", "name": "bad\x01name"}, sequence=0)
    assert h.check(bad).code == Code.INVALID_FIELD
    good = h.tx(keys, "register-org", {"org_id": "org1", "name": "Org One"}, sequence=0)
    assert h.check(good).code == 0  # the refused transaction never entered the mempool
    assert h.check(h.tx(keys, "heartbeat", {}, sequence=0)).code == Code.BAD_SEQUENCE  # the good one did


def test_recheck_validates_the_envelope_and_sequence_only(h):
    from tendermint.abci import types_pb2 as abci

    a, b = KeySet.generate(), KeySet.generate()
    first = h.tx(a, "register-org", {"org_id": "same", "name": "A"})
    second = h.tx(b, "register-org", {"org_id": "same", "name": "B"})
    assert h.check(first).code == 0 and h.check(second).code == Code.ALREADY_EXISTS
    h.block(first)
    recheck = abci.RequestCheckTx(tx=first, type=abci.RECHECK)
    res = h.app.check_tx(recheck)
    assert res.code == Code.BAD_SEQUENCE and "replayed" in res.log
    pending = h.tx(b, "register-org", {"org_id": "same", "name": "B"}, sequence=0)
    assert h.app.check_tx(abci.RequestCheckTx(tx=pending, type=abci.RECHECK)).code == 0
    assert code(h, pending) == Code.ALREADY_EXISTS


def test_a_database_read_failure_stops_the_block_instead_of_failing_the_transaction(h, tmp_path):
    """A driver error while a handler reads state would be code 12 on this validator only (the
    others commit the transaction): it must stop the app, which CometBFT then replays."""
    import sqlite3

    from tendermint.abci import types_pb2 as abci

    from planetserve.chain.abci.store import StoreError

    keys = KeySet.generate()
    raw = h.tx(keys, "register-user", {"address": "10.0.0.1:9000", "region": "eu"})
    with sqlite3.connect(tmp_path / "state.db") as other:
        other.execute("ALTER TABLE state_kv RENAME TO state_kv_gone")
    request = abci.RequestFinalizeBlock(txs=[raw], height=h.height + 1)
    with pytest.raises(StoreError, match="state database read failed: no such table: state_kv"):
        h.app.finalize_block(request)


def test_init_chain_repeated_before_the_first_commit_keeps_the_genesis_state(h, tmp_path):
    """CometBFT restarted after FinalizeBlock(1) and before Commit(1) runs InitChain again, then
    FinalizeBlock(1): the block must be applied to the genesis state, not to an empty one."""
    from tendermint.abci import types_pb2 as abci

    first = abci.RequestFinalizeBlock(height=1)
    h.app.finalize_block(first)
    h.app.init_chain(h.genesis)
    replayed = h.app.finalize_block(first).app_hash
    h.app.commit(abci.RequestCommit())
    with StateStore(sqlite_url(tmp_path, "once.db")) as store:
        app = Application(store)
        app.init_chain(h.genesis)
        assert app.finalize_block(first).app_hash == replayed
    assert State(h.store.batch()).params() == relaxed(PARAMS)

