"""Key rotation through the real Application, over whole epochs with a scripted committee: a model node
moves to a new key at the next epoch's first block and keeps its reputation, its place in the plan and
its verification; a member moves its operator, consensus, VRF and X25519 keys and keeps its faults,
votes and leadership; every old key is refused from the rotation height on, and every forgery of the
rotation itself is refused. tests/test_network_key_rotation.py rotates on four real validators."""

from __future__ import annotations

from dataclasses import replace

import pytest
from committee import EPOCH_PARAMS, HONEST, Script, honest_epoch, listed
from harness import AppHarness, events, node_body, sqlite_url

from planetserve.chain.abci.state import members
from planetserve.chain.challenge import SealedPromptError, open_plan_entry
from planetserve.chain.errors import Code
from planetserve.chain.keys import KeySet
from planetserve.chain.messages import RotateMemberKey, RotateNodeKey
from planetserve.chain.messages.registry import node_rotation_message
from planetserve.registry.errors import InvalidField

CHAIN_ID = "planetserve-test"


@pytest.fixture
def s(tmp_path) -> Script:
    return Script(AppHarness(sqlite_url(tmp_path), members=4, params=EPOCH_PARAMS))


def test_a_rotated_node_keeps_its_reputation_plan_and_verification_and_its_old_key_is_refused(s, tmp_path):
    old, other = list(s.nodes)
    s.run_election_and_plan(1)
    new = KeySet.generate()
    [result] = s.h.block(s.tx(s.owner, "rotate-node-key",
                              RotateNodeKey.signed(CHAIN_ID, "org1", s.nodes[old], new).body())).tx_results
    assert result.code == 0, result.log
    due = s.schedule.start(2)
    assert events(s.h.responses[-1], "rotate_node_key") == [
        {"node": old.hex(), "new": new.public.hex(), "height": str(due)}]

    # until then the node is verified under its old key: epoch 1, and the plan of epoch 2, name it
    honest_epoch(s, 1, {old: HONEST, other: HONEST})
    assert s.h.height == due - 1 and old in s.planned_nodes(2)
    before, registered = s.state.reputation(old), s.state.node(old)
    assert before.epochs == 1 and registered is not None

    rotated = s.h.block()
    assert events(rotated, "node_key_rotated") == [{"node": old.hex(), "new": new.public.hex(), "org_id": "org1"}]
    st = s.state
    assert st.node(old) is None and st.reputation(old) is None
    assert st.node(new.public) == replace(registered, pubkey=new.public)
    assert st.reputation(new.public) == replace(before, node=new.public)
    assert set(listed(s)) == {new.public, other}
    assert s.planned_nodes(2) == sorted([new.public, other])
    assert st.plan_entry(2, new.public).node == new.public

    # the plan's challenge, answered and signed with the new key, scores the node under it
    retired = s.nodes.pop(old)
    s.nodes[new.public] = new  # the Script answers for the node with its new key
    honest_epoch(s, 2, {new.public: HONEST, other: HONEST})
    after = s.state.reputation(new.public)
    assert after.epochs == 2 and after.window == (*before.window, after.window[-1])

    # the old key is refused for everything from the rotation height on
    refused = s.block(
        s.tx(s.owner, "update-model-node", {"node_pubkey": old, "capacity": 2}),
        s.tx(s.owner, "register-model-node", node_body(retired, "org1")),
        s.tx(s.owner, "rotate-node-key", RotateNodeKey.signed(CHAIN_ID, "org1", retired, KeySet.generate()).body()),
    )
    assert refused[0][0] == Code.UNKNOWN_ENTITY and "was rotated to" in refused[0][1]
    assert refused[1][0] == Code.ALREADY_EXISTS and "retired by the rotation" in refused[1][1]
    assert refused[2][0] == Code.UNKNOWN_ENTITY and "refused from then on" in refused[2][1]

    # every validator computes the same: a replay on a fresh store gives the same app hashes
    assert all(a == b for a, b in s.h.replay(sqlite_url(tmp_path, "replay.db")))


def test_every_forged_or_conflicting_node_rotation_is_refused(s):
    node, other = list(s.nodes)
    owner, keys = s.owner, s.nodes[node]
    new = KeySet.generate()
    message = node_rotation_message(CHAIN_ID, "org1", node, new.public)
    stranger = KeySet.generate()
    assert s.block(s.tx(stranger, "register-org", {"org_id": "org2", "name": "Two"})) == [(0, "ok")]

    def body(**fields: object) -> dict:
        return {"node_pubkey": node, "new_pubkey": new.public, "old_signature": keys.sign(message),
                "new_signature": new.sign(message), **fields}

    forged = s.block(
        s.tx(stranger, "rotate-node-key", body()),  # not the organisation's owner
        s.tx(owner, "rotate-node-key", body(old_signature=stranger.sign(message))),  # the old key never agreed
        s.tx(owner, "rotate-node-key", body(new_signature=stranger.sign(message))),  # nobody holds the new key
        s.tx(owner, "rotate-node-key", body(new_pubkey=other,
                                            new_signature=s.nodes[other].sign(
                                                node_rotation_message(CHAIN_ID, "org1", node, other)),
                                            old_signature=keys.sign(
                                                node_rotation_message(CHAIN_ID, "org1", node, other)))),
        s.tx(owner, "rotate-node-key", body(new_pubkey=node)),
    )
    assert forged[0][0] == Code.UNAUTHORIZED and "does not own organisation" in forged[0][1]
    assert forged[1][0] == Code.INVALID_FIELD and "old_signature" in forged[1][1]
    assert forged[2][0] == Code.INVALID_FIELD and "new_signature" in forged[2][1]
    assert forged[3][0] == Code.ALREADY_EXISTS and "registered model node" in forged[3][1]
    assert forged[4][0] == Code.INVALID_FIELD and "must differ" in forged[4][1]

    assert s.block(s.tx(owner, "rotate-node-key", body())) == [(0, "ok")]
    other_new = KeySet.generate()
    pending = s.block(
        s.tx(owner, "rotate-node-key", RotateNodeKey.signed(CHAIN_ID, "org1", keys, other_new).body()),
        s.tx(owner, "register-model-node", node_body(new, "org1")),  # the reserved key
        s.tx(owner, "rotate-node-key", RotateNodeKey.signed(CHAIN_ID, "org1", s.nodes[other], new).body()),
    )
    assert pending[0][0] == Code.ALREADY_EXISTS and "already rotates" in pending[0][1]
    assert pending[1][0] == Code.ALREADY_EXISTS and "reserved for the rotation" in pending[1][1]
    assert pending[2][0] == Code.ALREADY_EXISTS and "reserved for the rotation" in pending[2][1]
    with pytest.raises(InvalidField, match="must differ"):
        RotateNodeKey.from_body(body(new_pubkey=node))


def test_a_rotated_member_keeps_its_votes_faults_and_plan_and_its_old_keys_are_refused(s, tmp_path):
    s.run_election_and_plan(1)
    planner = s.epoch(2 - 1).leader  # the leader of epoch 1 commits the plan of epoch 2
    old = s.members[planner]
    index = [m.public for m in s.h.members].index(planner)
    old_consensus = s.h.consensus[index]
    fresh, consensus = KeySet.generate(), KeySet.generate()

    # its validator misses epoch 1's commits: a fault that must follow it
    s.h.absent = {old_consensus.public}
    rotation = RotateMemberKey.signed(CHAIN_ID, planner, fresh, consensus.identity).body()
    assert s.block(s.tx(old, "rotate-member-key", rotation)) == [(0, "ok")]
    # a parameter change it proposed, which its vote must still carry after it rotates
    [proposed] = s.block(s.tx(old, "propose-params", {"height": 60, "changes": {"user_ttl_seconds": 4321}}))
    assert proposed == (0, "ok")
    honest_epoch(s, 1, {n: HONEST for n in s.nodes})
    s.h.absent = set()
    assert s.faults(planner) == ["missed-blocks"]
    assert s.epoch(2).plan_status == "committed"

    rotated = s.h.block()
    assert events(rotated, "member_keys_rotated") == [
        {"operator": planner.hex(), "new_operator": fresh.public.hex(), "consensus_key": "true"}]
    assert sorted((u.pub_key.ed25519, u.power) for u in rotated.validator_updates) == sorted(
        [(old_consensus.public, 0), (consensus.public, 10)])
    committee = members(s.h.store.batch())
    assert planner not in committee
    moved = committee[fresh.public]
    assert (moved.consensus_key, moved.vrf_key, moved.x25519_key) == (
        consensus.public, bytes(fresh.vrf.verify_key), bytes(fresh.x25519.public_key))
    assert s.faults(planner) == [] and s.faults(fresh.public) == ["missed-blocks"]
    assert s.epoch(2).plan_leader == fresh.public
    # its box in the plan of epoch 2 is its under the new operator key; sealed to the X25519 key it
    # had when the plan was committed, which its verifier keeps for this epoch
    entry = s.state.plan_entry(2, next(iter(s.nodes)))
    with pytest.raises(SealedPromptError, match="does not open"):
        open_plan_entry(entry, fresh.public, fresh.x25519)
    assert open_plan_entry(entry, fresh.public, fresh.x25519, old.x25519).prompt  # as its verifier opens it

    # the old operator key is no member any more; the new one is, and its earlier vote still counts
    s.members[fresh.public] = s.members.pop(planner)
    s.members[fresh.public] = fresh
    others = [m for k, m in s.members.items() if k != fresh.public]
    after = s.block(
        s.tx(old, "propose-params", {"height": 70, "changes": {"user_ttl_seconds": 99}}),
        s.tx(others[0], "vote-member", {"proposal_id": 1, "approve": True}),
        s.tx(others[1], "vote-member", {"proposal_id": 1, "approve": True}),
        s.tx(fresh, "rotate-member-key", RotateMemberKey.signed(CHAIN_ID, fresh.public, None,
                                                                 KeySet.generate().identity).body()),
    )
    assert after[0][0] == Code.UNAUTHORIZED and "not a committee member" in after[0][1]
    assert after[1:] == [(0, "ok")] * 3
    assert events(s.h.responses[-1], "params_scheduled") == [{"height": "60", "names": "user_ttl_seconds"}]
    assert all(a == b for a, b in s.h.replay(sqlite_url(tmp_path, "replay.db")))


def test_a_members_misses_count_under_its_old_consensus_key_until_cometbft_switches(s):
    """CometBFT applies the new consensus key two blocks after the rotation's block H, so the commits that
    blocks H to H + 2 report are the old key's: the member's validator, absent from them, misses under
    its old key, and from H + 3 under its new one; every one counts for the member."""
    s.run_election_and_plan(1)
    operator = sorted(s.members)[1]
    index = [m.public for m in s.h.members].index(operator)
    old_consensus, new_consensus = s.h.consensus[index], KeySet.generate()
    rotation = RotateMemberKey.signed(CHAIN_ID, operator, None, new_consensus.identity).body()
    assert s.block(s.tx(s.members[operator], "rotate-member-key", rotation)) == [(0, "ok")]
    honest_epoch(s, 1, dict.fromkeys(s.nodes, HONEST))
    due = s.schedule.start(2)
    assert s.h.height == due - 1
    s.h.absent = {old_consensus.public}
    rotated = s.h.block()
    assert sorted((u.pub_key.ed25519, u.power) for u in rotated.validator_updates) == sorted(
        [(old_consensus.public, 0), (new_consensus.public, 10)])
    s.h.block()
    s.h.block()  # H + 2: the last block whose commit information carries the old key
    assert s.state.missed(2, operator) == 3
    assert s.state.retired_consensus() == [(old_consensus.public, operator, due + 2)]
    s.h.consensus[index] = new_consensus  # the validator set CometBFT reports from H + 3
    s.h.absent = {new_consensus.public}
    s.h.block()
    assert s.state.missed(2, operator) == 4 and s.state.retired_consensus() == []
    s.h.absent = {old_consensus.public}  # a key no longer in the set counts for nobody
    s.h.consensus[index] = old_consensus
    s.h.block()
    assert s.state.missed(2, operator) == 4
    assert all(s.state.missed(2, m) == 0 for m in s.members if m != operator)


def test_every_forged_or_conflicting_member_rotation_is_refused(s):
    first, second = list(s.members.values())[:2]
    fresh = KeySet.generate()
    signed = RotateMemberKey.signed(CHAIN_ID, first.public, fresh, KeySet.generate().identity)
    taken = s.h.consensus[[m.public for m in s.h.members].index(second.public)]  # the second's validator
    stranger = KeySet.generate()
    refused = s.block(
        s.tx(stranger, "rotate-member-key", RotateMemberKey.signed(CHAIN_ID, stranger.public, fresh).body()),
        s.tx(first, "rotate-member-key", {**signed.body(), "consensus_signature": fresh.sign(b"other")}),
        s.tx(first, "rotate-member-key", {**signed.body(), "vrf_signature": fresh.sign(b"other")}),
        s.tx(second, "rotate-member-key", signed.body()),  # another member replays the first's rotation
        s.tx(first, "rotate-member-key", RotateMemberKey.signed(CHAIN_ID, first.public, None,
                                                                 taken.identity).body()),
    )
    assert refused[0][0] == Code.UNAUTHORIZED
    assert refused[1][0] == Code.INVALID_FIELD and "'consensus_key': did not sign" in refused[1][1]
    assert refused[2][0] == Code.INVALID_FIELD and "'vrf_key': did not sign" in refused[2][1]
    assert refused[3][0] == Code.INVALID_FIELD and "'new_operator': did not sign" in refused[3][1]
    assert refused[4][0] == Code.ALREADY_EXISTS and "already a member's consensus key" in refused[4][1]
    with pytest.raises(InvalidField, match="at least one new key"):
        RotateMemberKey.from_body({})
    with pytest.raises(InvalidField, match="vrf_signature"):
        RotateMemberKey.from_body({"vrf_key": fresh.public})

    assert s.block(s.tx(first, "rotate-member-key", signed.body())) == [(0, "ok")]
    again = RotateMemberKey.signed(CHAIN_ID, second.public, fresh)
    conflicting = s.block(
        s.tx(first, "rotate-member-key", RotateMemberKey.signed(CHAIN_ID, first.public, KeySet.generate()).body()),
        s.tx(second, "rotate-member-key", again.body()),  # the key the first member is about to take
    )
    assert conflicting[0][0] == Code.ALREADY_EXISTS and "already rotate" in conflicting[0][1]
    assert conflicting[1][0] == Code.ALREADY_EXISTS and "about to be" in conflicting[1][1]


def test_a_member_cannot_rotate_onto_a_former_members_key_and_take_its_fault_record(s):
    """A member removed for good leaves its faults under its operator key; another member that holds
    that key (it signs) must not rotate onto it, where its own faults would merge with the record."""
    s.run_to(s.schedule.end(0) + 1)  # nobody commits the plan of epoch 1: its planner's fault
    faulty = s.members[s.epoch(1).plan_leader]
    others = [m for k, m in s.members.items() if k != faulty.public]
    assert s.faults(faulty.public) == ["no-plan"]
    removal = s.block(s.tx(others[0], "propose-member", {"action": "remove", "operator": faulty.public}),
                      *(s.tx(m, "vote-member", {"proposal_id": 1, "approve": True}) for m in others[1:]))
    assert all(code == 0 for code, _ in removal), removal
    assert faulty.public not in members(s.h.store.batch())
    onto = RotateMemberKey.signed(CHAIN_ID, others[0].public, faulty)
    [refused] = s.block(s.tx(others[0], "rotate-member-key", onto.body()))
    assert refused[0] == Code.ALREADY_EXISTS and "former member's fault record" in refused[1]
