"""Random bytes and random mutations of valid transactions: nothing crashes, nothing changes."""

from __future__ import annotations

import pytest
from harness import AppHarness, sqlite_url
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planetserve.chain.errors import Code
from planetserve.chain.keys import KeySet
from planetserve.chain.messages import MESSAGES
from planetserve.chain.messages import epochs as epoch_messages
from planetserve.registry.params import Params

KEYS = KeySet.generate()
VALID_BODIES = [
    ("register-org", {"org_id": "org9", "name": "Org Nine"}),
    ("register-user", {"address": "10.0.0.1:9000", "region": "eu"}),
    ("heartbeat", {}),
]


@pytest.fixture(scope="module")
def h(tmp_path_factory):
    # epochs long enough that no empty block changes state through the epoch timeline
    h = AppHarness(sqlite_url(tmp_path_factory.mktemp("fuzz")), params=Params(epoch_blocks=10**9))
    h.block()
    return h


def assert_refused_without_change(h: AppHarness, raw: bytes) -> None:
    root = h.store.app_hash
    check = h.check(raw)
    assert check.code not in (Code.OK, Code.INTERNAL) and check.log  # refused, not a handler crash
    result = h.block(raw)
    assert result.tx_results[0].code not in (Code.OK, Code.INTERNAL) and result.tx_results[0].log
    assert result.app_hash == root


settings_ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@settings_
@given(st.binary(max_size=2048))
def test_random_bytes(h, raw):
    assert_refused_without_change(h, raw)


@settings_
@given(st.data())
def test_mutations_of_valid_transactions(h, data):
    tx_type, body = data.draw(st.sampled_from(VALID_BODIES))
    raw = bytearray(h.tx(KEYS, tx_type, body, sequence=0))
    kind = data.draw(st.sampled_from(["flip", "truncate", "insert", "delete"]))
    pos = data.draw(st.integers(0, len(raw) - 1))
    if kind == "flip":
        raw[pos] ^= data.draw(st.integers(1, 255))
    elif kind == "truncate":
        del raw[pos:]
    elif kind == "insert":
        raw[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
    else:
        del raw[pos]
    assert_refused_without_change(h, bytes(raw))


FIELD_NAMES = ["org_id", "name", "address", "region", "model_id", "node_pubkey", "pop", "hardware",
               "capacity", "status", "action", "operator", "consensus_key", "vrf_key", "x25519_key",
               "credential", "power", "proposal_id", "approve", "epoch", "proof", "entries", "final",
               "kind", "results", "scores", "node", "reason", "commitment", "extra"]
MEMBER_TYPES = {"register-model", "propose-member", "vote-member",
                *(t for t, m in MESSAGES.items() if m.__module__ == epoch_messages.__name__)}
values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=80) | st.binary(max_size=80),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)


@settings_
@given(st.sampled_from(sorted(MESSAGES)),
       st.dictionaries(st.sampled_from(FIELD_NAMES), values, max_size=9))
def test_signed_random_bodies_never_crash_and_refusals_change_nothing(h, tx_type, body):
    signer = h.members[0] if tx_type in MEMBER_TYPES else KEYS
    root = h.store.app_hash
    before = h.registry_state()
    result = h.block(h.tx(signer, tx_type, body)).tx_results[0]
    assert result.code in {c.value for c in Code}
    if result.code != 0:
        assert result.code != Code.INTERNAL, result.log
        assert h.registry_state() == before
    else:
        assert h.store.app_hash != root
