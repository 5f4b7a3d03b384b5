"""A client that wants to take a validator down through its public RPC: it floods CheckTx with well-signed
transactions whose bodies decode into as many Python objects as 16 KB can make.

- Bodies of 15,800 empty lists (1.1 MiB of objects, about 14 ms of decoding and canonical re-encoding
  each) are refused as undecodable once more arrays and maps than one per 16 bytes are built
  (`tx.max_containers`): no valid transaction comes near that, the densest of each kind included.
- The densest junk that passes that bound, at a wrong sequence: the application used to keep every
  transaction whose signature verified, decoded, in a 100,000-entry cache, before it checked the
  sequence (300 such transactions held 331 MiB; the full cache about 108 GiB). Now it checks the sequence
  first and remembers only the digests of transactions that passed every envelope check, so the flood
  leaves nothing behind, and honest transactions keep being accepted."""

from __future__ import annotations

import gc
import tracemalloc

from harness import CHAIN_ID, AppHarness, sqlite_url

from planetserve.chain import tx as txlib
from planetserve.chain.errors import Code
from planetserve.chain.keys import KeySet
from planetserve.chain.messages.epochs import Attest, CommitPlan, PlanItem, SubmitResults, Unanswered
from planetserve.registry import codec
from planetserve.registry.params import Params

FLOOD = 100
LISTS = 15_800
"""Empty lists in the body of the old flood: one byte each on the wire, about 70 bytes each once decoded."""
BOUND = 2 << 20
"""What the whole flood may leave in the process (bytes); the old cache kept about 1 MiB per transaction."""
MAX_TX = Params().max_tx_bytes


def containers(value) -> int:
    if isinstance(value, list):
        return 1 + sum(map(containers, value))
    if isinstance(value, dict):
        return 1 + sum(map(containers, value.values()))
    return 0


def densest_junk(keys: KeySet, sequence: int) -> bytes:
    """A heartbeat as close to the byte limit as it goes, with as many empty lists as the container bound
    lets a transaction of its size hold, and padding for the rest."""
    def build(lists: int, pad: int) -> bytes:
        return txlib.build(keys, CHAIN_ID, "heartbeat", {"junk": [[] for _ in range(lists)], "pad": bytes(pad)},
                           sequence)

    lists = txlib.max_containers(MAX_TX) - 3  # the envelope, the body and the list of lists
    raw = build(lists, 1_000)
    raw = build(lists, 1_000 + MAX_TX - len(raw))
    assert len(raw) == MAX_TX and containers(codec.unpack(raw)) == txlib.max_containers(len(raw))
    return raw


def densest(make, size: int = MAX_TX) -> bytes:
    """The longest transaction `make(count)` builds within the byte limit."""
    count = 1
    while len(make(count + 1)) <= size:
        count += 1
    return make(count)


def test_the_densest_valid_transactions_decode_within_the_container_bound():
    """Each message that holds a list, built as densely as it can be (the shortest valid entries, as
    many as the byte limit takes): far fewer arrays and maps than the bound allows."""
    signer = KeySet.generate()

    def tx(message) -> bytes:
        return txlib.sign(signer, CHAIN_ID, message, 0)

    built = {
        "attest": densest(lambda n: tx(Attest(1, tuple((bytes(32), bytes(32), 0, 0) for _ in range(n))))),
        "submit-results": densest(lambda n: tx(SubmitResults(1, "leader", tuple(
            Unanswered(bytes(32), "") for _ in range(n))))),
        "commit-plan": densest(lambda n: tx(CommitPlan(1, (PlanItem(bytes(32), bytes(32), tuple(
            (b"", bytes(80)) for _ in range(n)), bytes(41)),), False))),
    }
    # bytes that look like container heads (in keys, signatures, padding) make the decoder count, not refuse
    heads = bytes(range(0x80, 0xA0)) * 400
    built["heartbeat"] = txlib.build(signer, CHAIN_ID, "heartbeat", {"pad": heads}, 0)
    assert len(heads) > txlib.max_containers(len(built["heartbeat"]))
    for name, raw in built.items():
        held = containers(codec.unpack(raw))
        assert len(raw) <= MAX_TX and 3 * held <= txlib.max_containers(len(raw)), (name, held, len(raw))
        assert txlib.decode(raw, MAX_TX).type == name


def test_a_body_of_empty_lists_is_refused_before_it_is_decoded(tmp_path):
    h = AppHarness(sqlite_url(tmp_path))
    attacker = KeySet.generate()
    raw = txlib.build(attacker, CHAIN_ID, "heartbeat", {"junk": [[] for _ in range(LISTS)]}, 0)
    assert len(raw) <= MAX_TX
    response = h.check(raw)
    bound = txlib.max_containers(len(raw))
    assert response.code == Code.UNDECODABLE, response.log
    assert f"more than {bound} arrays and maps in a transaction of {len(raw)} bytes" in response.log
    assert [r.code for r in h.block(raw).tx_results] == [Code.UNDECODABLE]  # a proposer's block too
    # the same account's honest transaction, at the sequence the junk claimed, passes
    assert h.check(h.tx(attacker, "register-org", {"org_id": "acme", "name": "ACME"}, sequence=0)).code == Code.OK


def test_a_checktx_flood_at_a_wrong_sequence_leaves_nothing_and_honest_transactions_pass(tmp_path):
    h = AppHarness(sqlite_url(tmp_path))
    attacker = KeySet.generate()
    flood = [densest_junk(attacker, 1_000 + i) for i in range(FLOOD)]
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
