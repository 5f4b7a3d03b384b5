"""Random bytes and random mutations of valid transactions: nothing crashes, nothing changes."""

from __future__ import annotations

import pytest
from harness import AppHarness, sqlite_url
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planetserve.chain.keys import KeySet

KEYS = KeySet.generate()
VALID_BODIES = [
    ("register-org", {"org_id": "org9", "name": "Org Nine"}),
    ("register-user", {"address": "10.0.0.1:9000", "region": "eu"}),
    ("heartbeat", {}),
]


@pytest.fixture(scope="module")
def h(tmp_path_factory):
    h = AppHarness(sqlite_url(tmp_path_factory.mktemp("fuzz")))
    h.block()
    return h


def assert_refused_without_change(h: AppHarness, raw: bytes) -> None:
    root = h.store.app_hash
    check = h.check(raw)
    assert check.code != 0 and check.log
    result = h.block(raw)
    assert result.tx_results[0].code != 0 and result.tx_results[0].log
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
