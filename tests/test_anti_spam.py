"""A client that floods the ledger (docs/threat-model.md, "Client"): registrations from fresh keys, with
no proof of work or with one that costs nothing, a registered key sending as fast as it can, and
refused transactions from fresh keys, which used to leave an account record each, forever. The
application, in process (tests/harness.py), with the limits as a chain sets them."""

from __future__ import annotations

from dataclasses import replace

import pytest
from committee import EPOCH_PARAMS, Script
from harness import CHAIN_ID, AppHarness, sqlite_url
from tendermint.abci import types_pb2 as abci

from planetserve.chain import tx as txlib
from planetserve.chain.abci.state import State
from planetserve.chain.errors import Code
from planetserve.chain.keys import KeySet
from planetserve.registry import work
from planetserve.registry.params import Params

USER = {"address": "10.0.0.1:9000", "region": "eu"}
CHEAP = {"user_work_bits": 6, "org_work_bits": 6}
"""Proofs of work these tests can afford to solve by the dozen; the limits under test stay as set."""


def committed(h: AppHarness) -> dict[bytes, bytes]:
    return dict(h.store.batch().iterate(b""))


def unsolved(kind: str, signer: bytes, bits: int) -> int:
    """A nonce that does not meet `bits` for this key."""
    return next(n for n in range(1 << 20) if not work.meets(CHAIN_ID, kind, signer, n, bits))


def test_a_registration_needs_the_chains_proof_of_work_bound_to_its_key(tmp_path):
    h = AppHarness(sqlite_url(tmp_path), params=Params(user_work_bits=12, org_work_bits=14), limits=True)
    h.block()
    before = committed(h)
    user, other = KeySet.generate(), KeySet.generate()
    for kind, body in (("register-user", USER), ("register-org", {"org_id": "o", "name": "O"})):
        bits = 12 if kind == "register-user" else 14
        missing = h.tx(user, kind, {**body, "work": unsolved(kind, user.public, bits)}, sequence=0)
        response = h.check(missing)
        assert response.code == Code.INSUFFICIENT_WORK, response.log
        assert f"{bits} leading zero bits" in response.log
        assert h.block(missing).tx_results[0].code == Code.INSUFFICIENT_WORK
        # one key's solution buys nothing for another key
        theirs = work.solve(CHAIN_ID, kind, other.public, bits)
        if not work.meets(CHAIN_ID, kind, user.public, theirs, bits):
            stolen = h.tx(user, kind, {**body, "work": theirs}, sequence=0)
            assert h.block(stolen).tx_results[0].code == Code.INSUFFICIENT_WORK
    # refused registrations of a fresh key leave nothing, not even its account
    assert committed(h) == before
    solved = h.tx(user, "register-user", {**USER, "work": work.solve(CHAIN_ID, "register-user", user.public, 12)},
                  sequence=0)
    assert h.check(solved).code == 0
    assert [(r.code, r.log) for r in h.block(solved).tx_results] == [(0, "ok")]
    assert State(h.store.batch()).user(user.public) is not None


def test_a_signer_outside_the_committee_gets_a_few_transactions_a_window_and_members_are_not_limited(tmp_path):
    params = Params(max_signer_txs=3, rate_window_blocks=5, **CHEAP)
    h = AppHarness(sqlite_url(tmp_path), params=params, limits=True)
    user, member = KeySet.generate(), h.members[0]
    h.block(h.tx(user, "register-user", USER))  # height 1, window 0 (heights 0-4)
    beats = [h.tx(user, "heartbeat", {}) for _ in range(3)]
    assert [h.check(raw).code for raw in beats] == [0, 0, Code.RATE_LIMITED]
    refusal = h.check(beats[2])
    assert "sent 3 transactions in blocks 0..4" in refusal.log and "retry from block 5" in refusal.log
    results = h.block(*beats).tx_results  # height 2
    assert [r.code for r in results] == [0, 0, Code.RATE_LIMITED]
    assert State(h.store.batch()).sequence(user.public) == 4  # the refused one still took its sequence
    # a member sends what it must, however much
    models = [h.tx(member, "register-model", {"model_id": f"m{i}", "name": "m"}) for i in range(6)]
    assert [h.check(raw).code for raw in models] == [0] * 6
    assert [r.code for r in h.block(*models).tx_results] == [0] * 6  # height 3
    h.block()  # height 4
    assert list(h.store.batch().iterate(b"rate/000000000000/"))
    assert [r.code for r in h.block(h.tx(user, "heartbeat", {})).tx_results] == [0]  # height 5, window 1
    assert not list(h.store.batch().iterate(b"rate/000000000000/")), "the last window's counts stay"


def test_registrations_per_block_are_capped_in_the_mempool_and_in_the_block(tmp_path):
    h = AppHarness(sqlite_url(tmp_path), params=Params(max_registrations_per_block=3, **CHEAP), limits=True)
    h.block()
    keys = [KeySet.generate() for _ in range(5)]
    txs = [h.tx(k, "register-user", USER) for k in keys]
    assert [h.check(raw).code for raw in txs] == [0, 0, 0, Code.RATE_LIMITED, Code.RATE_LIMITED]
    assert "the mempool holds the 3 registrations a block allows" in h.check(txs[4]).log
    results = h.block(*txs).tx_results
    assert [r.code for r in results] == [0, 0, 0, Code.RATE_LIMITED, Code.RATE_LIMITED]
    assert "this block has the 3 registrations" in results[3].log
    st = State(h.store.batch())
    assert [st.sequence(k.public) for k in keys] == [1, 1, 1, 0, 0]
    # the next block takes them, and the mempool admits them again after the commit
    assert [h.check(raw).code for raw in txs[3:]] == [0, 0]
    assert [r.code for r in h.block(*txs[3:]).tx_results] == [0, 0]


def test_the_mempool_share_of_signers_outside_the_committee_is_bounded(tmp_path):
    h = AppHarness(sqlite_url(tmp_path), params=Params(mempool_non_member_txs=4, **CHEAP), limits=True)
    users = [KeySet.generate() for _ in range(6)]
    h.block(*(h.tx(u, "register-user", USER) for u in users))
    beats = [h.tx(u, "heartbeat", {}) for u in users]
    assert [h.check(raw).code for raw in beats] == [0] * 4 + [Code.RATE_LIMITED] * 2
    assert "share for signers outside the committee is full" in h.check(beats[5]).log
    member = h.members[0]
    assert h.check(h.tx(member, "register-model", {"model_id": "m", "name": "m"})).code == 0
    # after a block, rechecks count again: what the mempool kept is rechecked first, the rest refused
    h.block()
    recheck = [h.app.check_tx(abci.RequestCheckTx(tx=raw, type=abci.RECHECK)).code for raw in beats[:4]]
    assert recheck == [0] * 4 and h.check(beats[4]).code == Code.RATE_LIMITED


def test_state_grows_a_bounded_amount_per_accepted_registration_and_not_at_all_for_refused_ones(tmp_path):
    h = AppHarness(sqlite_url(tmp_path), params=Params(user_work_bits=8), limits=True)
    h.block()
    start = committed(h)
    # a flood of transactions from fresh keys that all fail: no proof of work, heartbeats of no user,
    # organisations' nodes they do not own
    flood = []
    for _ in range(60):
        k = KeySet.generate()
        flood.append(txlib.build(k, CHAIN_ID, "register-user",
                                 {**USER, "work": unsolved("register-user", k.public, 8)}, 0))
        flood.append(txlib.build(KeySet.generate(), CHAIN_ID, "heartbeat", {}, 0))
    assert all(r.code != 0 for r in h.block(*flood).tx_results)
    assert committed(h) == start, "refused transactions of fresh keys wrote state"
    accepted = 40
    users = [KeySet.generate() for _ in range(accepted)]
    assert all(r.code == 0 for r in h.block(*(h.tx(u, "register-user", USER) for u in users)).tx_results)
    after = committed(h)
    new = {k: v for k, v in after.items() if start.get(k) != v}
    grown = sum(len(k) + len(v) for k, v in new.items())
    # acct/, user/, ulist/, uexp/ and the window's count: five entries, about 500 bytes, per user
    assert len(new) <= 5 * accepted + 2
    assert grown <= 600 * accepted, f"{grown / accepted:.0f} bytes per registration"


@pytest.fixture
def s(tmp_path):
    return Script(AppHarness(sqlite_url(tmp_path), members=4, params=replace(EPOCH_PARAMS, **CHEAP), limits=True))


def test_proposals_carry_the_committees_work_first_and_registrations_last_within_the_limits(s):
    h = s.h
    cap = h.app.params.max_registrations_per_block
    user = KeySet.generate()
    h.block(h.tx(user, "register-user", USER))
    s.run_to(s.schedule.setup_height(0) + 1)
    flood = [h.tx(KeySet.generate(), "register-user", USER) for _ in range(cap + 20)]
    beat = h.tx(user, "heartbeat", {})
    member = s.members[sorted(s.members)[1]]
    model = h.tx(member, "register-model", {"model_id": "m", "name": "m"})  # the member's sequence n
    vrfs = s.vrf_txs(1)  # its VRF proof takes n + 1: the two must stay in this order
    mempool = [*flood[:30], beat, *flood[30:], model, *vrfs]
    proposal = list(h.app.prepare_proposal(abci.RequestPrepareProposal(txs=mempool, max_tx_bytes=1 << 20)).txs)
    assert proposal == [model, *vrfs, beat, *flood[:cap]]
    answer = h.app.process_proposal(abci.RequestProcessProposal(txs=proposal))
    assert answer.status == abci.ResponseProcessProposal.ACCEPT
    # a small block: the committee's work fills it first
    size = sum(len(raw) for raw in (model, *vrfs))
    small = list(h.app.prepare_proposal(abci.RequestPrepareProposal(txs=mempool, max_tx_bytes=size)).txs)
    assert small == [model, *vrfs]
    results = h.block(*proposal).tx_results
    assert all(r.code == 0 for r in results), [r.log for r in results if r.code]
    s.run_to(s.schedule.start(1) + 1)
    assert s.epoch(1).election == "vrf"


def test_the_limits_give_the_same_app_hashes_on_postgresql(tmp_path, pg_url):
    h = AppHarness(sqlite_url(tmp_path), params=Params(max_signer_txs=2, rate_window_blocks=3,
                                                       max_registrations_per_block=2, **CHEAP), limits=True)
    users = [KeySet.generate() for _ in range(4)]
    h.block(*(h.tx(u, "register-user", USER) for u in users))
    for _ in range(4):
        h.block(*(h.tx(u, "heartbeat", {}) for u in users[:2] for _ in range(3)),
                h.tx(KeySet.generate(), "heartbeat", {}))
    assert all(here == there for here, there in h.replay(pg_url))
