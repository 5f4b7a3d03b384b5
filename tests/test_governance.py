"""Parameter changes and upgrades by committee vote, in the real Application: applied at their stated
height with more than 2/3 of the power and never without it; an app older than an upgrade halts at its
height and the newer app goes on from the same state, with the same app hashes as one that ran it all.
tests/test_network_governance.py runs both on four real validators."""

from __future__ import annotations

from pathlib import Path

import pytest
from committee import EPOCH_PARAMS, HONEST, Script, honest_epoch
from harness import AppHarness, events, sqlite_url
from tendermint.abci import types_pb2 as abci

from planetserve.chain.abci.app import Application
from planetserve.chain.abci.governance import UpgradeNeeded
from planetserve.chain.abci.state import State, members
from planetserve.chain.abci.store import StateStore
from planetserve.chain.errors import Code
from planetserve.chain.keys import KeySet
from planetserve.chain.layout import NEXT_PROPOSAL_KEY
from planetserve.registry.params import Params

MARK = b"upgraded/v2"


class AppV2(Application):
    """The next version of the app: its migration "v2" writes a mark into the state."""

    VERSION = 2
    MIGRATIONS = {"v2": lambda st: st.put_int(MARK, 1)}  # noqa: RUF012 (a class's table, as Application's)


def committee(tmp_path: Path) -> AppHarness:
    return AppHarness(sqlite_url(tmp_path), members=4)


def codes(result: abci.ResponseFinalizeBlock) -> list[int]:
    return [r.code for r in result.tx_results]


def vote(h: AppHarness, voters: range, proposal_id: int, approve: bool = True) -> abci.ResponseFinalizeBlock:
    return h.block(*(h.tx(h.members[i], "vote-member", {"proposal_id": proposal_id, "approve": approve})
                     for i in voters))


def test_a_parameter_change_applies_at_its_height_and_one_without_two_thirds_never_does(tmp_path: Path) -> None:
    h = committee(tmp_path)
    before = h.app.params.max_signer_txs
    at = 8
    assert codes(h.block(h.tx(h.members[0], "propose-params",
                              {"height": at, "changes": {"max_signer_txs": before + 5}}))) == [0]
    assert codes(h.block(h.tx(h.members[1], "propose-params",
                              {"height": at, "changes": {"user_ttl_seconds": 1234}}))) == [0]
    approved = vote(h, range(1, 3), 1)  # with the proposer's: 30 of 40, more than 2/3
    assert events(approved, "params_scheduled") == [{"height": "8", "names": "max_signer_txs"}]
    assert codes(vote(h, range(0, 1), 2)) == [0]  # 20 of 40: pending
    while h.height < at - 1:
        h.block()
    assert State(h.store.batch()).params().max_signer_txs == before  # not before its height
    applied = h.block()
    assert h.height == at
    assert events(applied, "params_changed") == [{"height": "8", "names": "max_signer_txs"}]
    params = State(h.store.batch()).params()
    assert params.max_signer_txs == before + 5 and params.user_ttl_seconds == Params().user_ttl_seconds
    assert h.app.params == params
    late = vote(h, range(2, 3), 2)  # the second proposal expired at the block before its height
    assert late.tx_results[0].code == Code.UNKNOWN_ENTITY
    assert State(h.store.batch()).params() == params  # and stays
    assert [a == b for a, b in h.replay(sqlite_url(tmp_path, "replay.db"))] == [True] * h.height


@pytest.mark.parametrize(("body", "message"), [
    ({"height": 3, "changes": {"no_such": 1}}, "unknown parameter"),
    ({"height": 3, "changes": {"max_signer_txs": 0}}, "must be a positive integer"),
    ({"height": 3, "changes": {"results_blocks": 100}}, "must be less than epoch_blocks"),
    ({"height": 3, "changes": {}}, "must name at least one parameter"),
    ({"height": 2, "changes": {"max_signer_txs": 3}}, "must be after the next block"),
    ({"height": 3, "changes": {"epoch_blocks": 50}}, "field 'epoch_blocks': is set by the genesis alone: it "
                                                     "numbers every epoch from the first block"),
    ({"height": 86, "changes": {"plan_window_blocks": 20, "max_signer_txs": 3}},
     "must be an epoch's first block to change plan_window_blocks (inside an epoch the block that sets up the "
     "next could be skipped); the next epoch after it starts at 101"),
])
def test_parameter_changes_that_could_never_apply_are_refused(tmp_path: Path, body: dict, message: str) -> None:
    h = committee(tmp_path)
    result = h.block(h.tx(h.members[0], "propose-params", body))
    assert result.tx_results[0].code != 0 and message in result.tx_results[0].log


def test_an_epoch_window_changed_at_an_epochs_first_block_sets_up_the_next_epoch_under_it(tmp_path: Path) -> None:
    """A wider plan window from epoch 1's first block moves the block that makes epoch 2's record ten
    blocks earlier; the epochs go on (the same change voted for mid-epoch, after the new setup block
    but before the old one, left epochs 1 and 2 without records)."""
    h = committee(tmp_path)
    assert (h.app.params.epoch_blocks, h.app.params.plan_window_blocks) == (100, 14)
    assert codes(h.block(h.tx(h.members[0], "propose-params", {"height": 101, "changes": {"plan_window_blocks": 24}}))) == [0]
    assert events(vote(h, range(1, 3), 1), "params_scheduled") == [{"height": "101", "names": "plan_window_blocks"}]
    while h.height < 176:
        h.block()
    st = State(h.store.batch())
    assert st.params().plan_window_blocks == 24 and st.epoch(1) is not None and st.epoch(2) is None
    h.block()  # 177: the last 24 blocks of epoch 1 begin
    assert State(h.store.batch()).epoch(2).start_height == 201


def test_only_members_propose_and_an_upgrade_must_raise_the_version(tmp_path: Path) -> None:
    h = committee(tmp_path)
    outsider = h.block(h.tx(KeySet.generate(), "propose-params", {"height": 9, "changes": {"max_signer_txs": 3}}))
    assert outsider.tx_results[0].code == Code.UNAUTHORIZED
    same = h.block(h.tx(h.members[0], "propose-upgrade", {"name": "v1", "app_version": 1, "height": 9}))
    assert same.tx_results[0].code != 0 and "app_version" in same.tx_results[0].log


def test_an_old_app_halts_at_the_upgrade_height_and_the_new_one_goes_on_from_the_same_state(
        tmp_path: Path) -> None:
    h = committee(tmp_path)
    at = 6
    h.block(h.tx(h.members[0], "propose-upgrade", {"name": "v2", "app_version": 2, "height": at}))
    scheduled = vote(h, range(1, 3), 1)
    assert events(scheduled, "upgrade_scheduled") == [{"name": "v2", "app_version": "2", "height": "6"}]
    while h.height < at - 1:
        h.block()
    assert h.app.info(abci.RequestInfo()).app_version == 1
    with pytest.raises(UpgradeNeeded, match="UPGRADE 'v2' NEEDED at height 6: this app is version 1"):
        h.block()
    h.height -= 1  # the block did not happen: the operator starts the new app, CometBFT replays it
    h.time -= 5
    h.app = AppV2(h.store)
    upgraded = h.block(h.tx(KeySet.generate(), "register-user", {"address": "10.6.0.1:9000", "region": "eu"}))
    assert codes(upgraded) == [0]
    assert events(upgraded, "upgraded") == [{"name": "v2", "app_version": "2"}]
    assert upgraded.consensus_param_updates.version.app == 2
    assert State(h.store.batch()).get_int(MARK) == 1
    assert h.app.info(abci.RequestInfo()).app_version == 2
    assert not h.block().HasField("consensus_param_updates")
    with StateStore(sqlite_url(tmp_path, "v2.db")) as store:  # a validator that ran version 2 all along
        app = AppV2(store)
        app.init_chain(h.genesis)
        for request, app_hash in h.blocks:
            assert app.finalize_block(request).app_hash == app_hash
            app.commit(abci.RequestCommit())


EXPIRY = Params(credential_ttl_seconds=60, epoch_blocks=10, results_blocks=3, vrf_window_blocks=2,
                plan_window_blocks=2)
"""Credentials good for 60 s, at 5 s a block: they lapse at block 12, and take effect at the end of the
epoch of blocks 11-20."""


def removed(result: abci.ResponseFinalizeBlock) -> list[tuple[str, str]]:
    return [(e["operator"], e["reason"]) for e in events(result, "member_removed")]


def test_a_lapsed_credential_takes_the_members_power_at_the_epoch_end_unless_renewed(tmp_path: Path) -> None:
    h = AppHarness(sqlite_url(tmp_path), members=4, params=EXPIRY)
    renewed, *others = h.members
    for _ in range(10):
        assert not removed(h.block())  # the first epoch ends before the credentials lapse
    h.block(h.tx(renewed, "propose-member", {"action": "renew", "operator": renewed.public,
                                             "credential": "member 0, audited again"}))
    renewal = vote(h, range(1, 3), 1)
    assert events(renewal, "member_renewed") == [{"operator": renewed.public.hex(), "expires_at": str(h.time + 60)}]
    while h.height < 19:
        assert not removed(h.block())
    end = h.block()
    assert sorted(removed(end)) == sorted((m.public.hex(), "credential lapsed") for m in others)
    assert sorted((u.pub_key.ed25519, u.power) for u in end.validator_updates) == sorted(
        (c.public, 0) for c in h.consensus[1:])
    left = members(h.store.batch())
    assert list(left) == [renewed.public] and left[renewed.public].credential == "member 0, audited again"


def test_the_last_member_keeps_its_power_when_every_credential_lapses(tmp_path: Path) -> None:
    h = AppHarness(sqlite_url(tmp_path), members=3, params=EXPIRY)
    while h.height < 19:
        h.block()
    end = h.block()
    assert len(removed(end)) == 2
    assert len(members(h.store.batch())) == 1


def test_a_vote_shortening_the_reputation_window_applies_without_halting_the_chain(tmp_path):
    """Nodes' stored windows hold the last five credibilities when a vote lowers `reputation_window` to
    three: the next finalization keeps each node's last three (every validator raised there before, and
    the chain halted), and the nodes are scored on."""
    s = Script(AppHarness(sqlite_url(tmp_path), members=4, params=EPOCH_PARAMS))
    s.run_election_and_plan(1)
    for number in range(1, 6):
        honest_epoch(s, number, dict.fromkeys(s.nodes, HONEST))
    node = next(iter(s.nodes))
    assert len(s.state.reputation(node).window) == 5
    proposer, *others = s.members.values()
    height = s.h.height + 3
    assert s.block(s.tx(proposer, "propose-params", {"height": height, "changes": {"reputation_window": 3}})) \
        == [(0, "ok")]
    proposal = s.state.get_int(NEXT_PROPOSAL_KEY)
    assert s.block(*(s.tx(m, "vote-member", {"proposal_id": proposal, "approve": True}) for m in others[:2])) \
        == [(0, "ok")] * 2
    honest_epoch(s, 6, dict.fromkeys(s.nodes, HONEST))
    assert s.state.params().reputation_window == 3
    scored = s.state.reputation(node)
    assert scored.epochs == 6 and len(scored.window) == 3


def test_a_member_has_at_most_eight_proposals_pending(tmp_path):
    """Every block reads each pending proposal to expire it, and nothing bounded how many a member sent
    (5,000 a block made each block take a second, and 40,000 pending added 270 ms to an empty block): a
    member's ninth pending proposal is refused as rate-limited until one of its own is settled."""
    s = Script(AppHarness(sqlite_url(tmp_path), members=4, params=EPOCH_PARAMS))
    spammer, other, third, _ = s.members.values()

    def propose(member, value: int) -> bytes:
        return s.tx(member, "propose-params", {"height": s.h.height + 500, "changes": {"max_signer_txs": value}})

    first = s.state.get_int(NEXT_PROPOSAL_KEY) + 1
    assert s.block(*(propose(spammer, 20 + i) for i in range(8))) == [(0, "ok")] * 8
    code, log = s.block(propose(spammer, 40))[0]
    assert code == Code.RATE_LIMITED and "signer has 8 proposals pending" in log
    assert s.block(propose(other, 41)) == [(0, "ok")]
    reject = {"proposal_id": first, "approve": False}
    assert s.block(s.tx(other, "vote-member", reject), s.tx(third, "vote-member", reject)) == [(0, "ok")] * 2
    assert s.block(propose(spammer, 42)) == [(0, "ok")]
