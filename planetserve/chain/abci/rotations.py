"""Key rotations reaching their height, applied at the start of the block before anything else reads a
key: the first block of an epoch, so that the epoch that ends before it is finalized under the old keys
and the one that starts with it runs under the new.

A model node's record, list entry, reputation, place in its organisation's record, deployment and the
challenge planned for it this epoch (committed under the old key at the end of the last) move to the new
key; the old key stays retired, except that the plan entry remembers it (`PlanEntry.moved_from`):
members' re-challenges of this epoch, tagged and partly sent in the last one, name it. A member's record
moves to its new keys, its validator's power to the new consensus key (CometBFT applies that two blocks
on, and until then the member's misses are counted under the old one), and its faults, votes, leadership
and boxes in this epoch's plan to its new operator key. A rotation whose subject is gone, or whose new
key another took meanwhile, is void."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from planetserve.chain import layout
from planetserve.chain.abci.state import IterableKV, State, members
from planetserve.registry import rules
from planetserve.registry.entities import Member, MemberRotation, NodeRotation, Proposal
from planetserve.registry.epochs import PlanEntry, Schedule
from planetserve.registry.params import Params

UPDATE_DELAY_BLOCKS = 2
"""CometBFT applies a validator update returned at height H from height H + 2, so the commits reported in
blocks H to H + 2 are still signed under the consensus key a member rotated away at H."""


@dataclass
class Rotated:
    """What the start of a block rotated."""

    validator_updates: dict[bytes, int] = field(default_factory=dict)
    events: list[tuple[str, dict[str, str]]] = field(default_factory=list)


def next_epoch_start(params: Params, height: int) -> int:
    """The height at which a rotation submitted at `height` takes effect."""
    schedule = Schedule.from_params(params)
    return schedule.start(schedule.epoch_of(height) + 1)


def begin_block(batch: IterableKV, params: Params, height: int, time: int) -> Rotated:
    st = State(batch)
    epoch = Schedule.from_params(params).epoch_of(height)
    out = Rotated()
    for rotation in st.node_rotations_due(height):
        out.events.append(_move_node(st, epoch, rotation, time))
    for member_rotation in st.member_rotations_due(height):
        out.events.append(_move_member(st, batch, epoch, member_rotation, out.validator_updates))
    return out


def _move_node(st: State, epoch: int, rotation: NodeRotation, time: int) -> tuple[str, dict[str, str]]:
    old, new = rotation.old, rotation.new
    st.finish_node_rotation(rotation)
    node = st.node(old)
    if node is None:
        return "rotation_void", {"node": old.hex(), "reason": "the node is no longer registered"}
    reputation = st.reputation(old)
    if reputation is not None:
        st.kv.delete(layout.reputation_key(old))
        st.put_reputation(replace(reputation, node=new))
    st.delete_node(node)
    st.put_node(replace(node, pubkey=new), at=time, listable=reputation is not None and reputation.listable)
    st.kv.delete(layout.org_node_key(node.org_id, old))
    st.add_org_node(node.org_id, new)
    deployment = st.deployment_of(old)
    if deployment is not None:
        st.delete_deployment(deployment)
        st.put_deployment(replace(
            deployment, nodes=tuple(sorted(new if k == old else k for k in deployment.nodes)),
            stages=tuple([new if stage[0] == old else stage[0], *stage[1:]] for stage in deployment.stages)))
    planned = st.plan_entry(epoch, old)
    if planned is not None:
        st.kv.delete(layout.plan_key(epoch, old))
        # members' re-challenge tags of this epoch name the old key (committed in the epoch before):
        # the entry keeps it, so they still open under the new one
        st.put_plan_entry(epoch, replace(planned, node=new, moved_from=old))
        st.use_commitment(epoch, planned.commitment, new)
    return "node_key_rotated", {"node": old.hex(), "new": new.hex(), "org_id": node.org_id}


def _move_member(st: State, batch: IterableKV, epoch: int, rotation: MemberRotation,
                 updates: dict[bytes, int]) -> tuple[str, dict[str, str]]:
    st.delete_member_rotation(rotation)
    committee = members(batch)
    member = committee.get(rotation.operator)
    void = {"operator": rotation.operator.hex()}
    if member is None:
        return "rotation_void", {**void, "reason": "no longer a committee member"}
    moved = rotation.applied(member)
    others = [m for k, m in committee.items() if k != member.operator]
    if moved.operator != member.operator and moved.operator in committee:
        return "rotation_void", {**void, "reason": "the new operator key became another member's"}
    if rules.consensus_key_used(others, moved.consensus_key):
        return "rotation_void", {**void, "reason": "the new consensus key became another member's"}
    if moved.consensus_key != member.consensus_key:
        updates[member.consensus_key] = 0
        updates[moved.consensus_key] = member.power
        st.put_retired_consensus(member.consensus_key, moved.operator, rotation.height + UPDATE_DELAY_BLOCKS)
    if moved.operator != member.operator:
        st.delete_member(member.operator)
        _follow_operator(st, batch, epoch, member.operator, moved.operator)
    for k, value in list(batch.iterate(layout.PROPOSAL_PREFIX)):
        batch.set(k, _followed(Proposal.decode(value), member.operator, moved).encode())
    st.put_member(moved)
    return "member_keys_rotated", {"operator": member.operator.hex(), "new_operator": moved.operator.hex(),
                                   "consensus_key": str(moved.consensus_key != member.consensus_key).lower()}


def _follow_operator(st: State, batch: IterableKV, epoch: int, old: bytes, new: bytes) -> None:
    """What the chain holds under the member's old operator key that still counts: its faults (the
    fault window removes members), its leadership of this epoch and the next, and its boxes in this
    epoch's plan."""
    st.move_faults(old, new)
    for number in (epoch, epoch + 1):
        record = st.epoch(number)
        if record is not None and old in (record.leader, record.plan_leader):
            st.put_epoch(replace(record, leader=new if record.leader == old else record.leader,
                                 plan_leader=new if record.plan_leader == old else record.plan_leader))
    for k, value in list(batch.iterate(layout.plan_prefix(epoch))):
        entry = PlanEntry.decode(value)
        sealed = tuple(sorted([new if m == old else m, box] for m, box in entry.sealed))
        batch.set(k, replace(entry, sealed=sealed).encode())


def _followed(proposal: Proposal, old: bytes, moved: Member) -> Proposal:
    """A pending proposal with the member's votes under its new operator key, and, where it is the
    member's removal or renewal, its new keys."""
    def swap(keys: tuple[bytes, ...]) -> tuple[bytes, ...]:
        return tuple(sorted(moved.operator if k == old else k for k in keys))

    subject = proposal.subject
    if proposal.action in ("remove", "renew") and subject.get("operator") == old:
        subject = {**moved.to_record(), "credential": subject["credential"]}
    proposer = moved.operator if proposal.proposer == old else proposal.proposer
    return replace(proposal, votes=swap(proposal.votes), rejections=swap(proposal.rejections),
                   proposer=proposer, subject=subject)
