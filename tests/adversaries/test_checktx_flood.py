"""A client that wants to take a validator down through its public RPC: it floods CheckTx with well-signed
transactions at a wrong sequence whose bodies decode into as many Python objects as 16 KB can make
(16,000 empty lists, 1.1 MiB of objects each). The application used to keep every transaction whose
signature verified, decoded, in a 100,000-entry cache, before it checked the sequence: 300 of them held
331 MiB, the full cache about 108 GiB. Now it checks the sequence first and remembers only the digests
of transactions that passed every envelope check, so the flood leaves nothing behind, and honest
transactions keep being accepted."""

from __future__ import annotations

import gc
import tracemalloc

from harness import CHAIN_ID, AppHarness, sqlite_url

from planetserve.chain import tx as txlib
from planetserve.chain.errors import Code
from planetserve.chain.keys import KeySet

FLOOD = 100
LISTS = 15_800
"""Empty lists in each body: one byte each on the wire, about 70 bytes each once decoded."""
BOUND = 2 << 20
"""What the whole flood may leave in the process (bytes); the old cache kept about 1 MiB per transaction."""


def test_a_checktx_flood_at_a_wrong_sequence_leaves_nothing_and_honest_transactions_pass(tmp_path):
    h = AppHarness(sqlite_url(tmp_path))
    attacker = KeySet.generate()
    flood = [txlib.build(attacker, CHAIN_ID, "heartbeat", {"junk": [[] for _ in range(LISTS)]}, 1_000 + i)
             for i in range(FLOOD)]
    assert all(len(raw) <= h.app.params.max_tx_bytes for raw in flood)
    gc.collect()
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        codes = [h.check(raw).code for raw in flood]
        gc.collect()
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert codes == [Code.BAD_SEQUENCE] * FLOOD
    assert after - before < BOUND, f"the flood left {(after - before) >> 10} KiB behind"
    # honest traffic flows on: a fresh organisation registers, checked and committed
    owner = KeySet.generate()
    registration = h.tx(owner, "register-org", {"org_id": "acme", "name": "ACME"})
    assert h.check(registration).code == Code.OK
    assert [(r.code, r.log) for r in h.block(registration).tx_results] == [(0, "ok")]


def test_a_forged_signature_is_refused_and_never_remembered(tmp_path):
    """A transaction at the right sequence whose signature does not verify is refused as such, every
    time it comes (nothing marks it as verified)."""
    h = AppHarness(sqlite_url(tmp_path))
    signer = KeySet.generate()
    good = txlib.decode(h.tx(signer, "register-org", {"org_id": "acme", "name": "ACME"}, sequence=0), 1 << 16)
    forged = txlib.Tx(good.type, good.body, good.signer, good.sequence, good.chain_id, bytes(64)).encode()
    for _ in range(3):
        response = h.check(forged)
        assert response.code == Code.BAD_SIGNATURE and "does not verify" in response.log
    assert [r.code for r in h.block(forged).tx_results] == [Code.BAD_SIGNATURE]
