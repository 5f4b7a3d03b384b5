"""Typed access to the state through its key layout (chain/layout.py), and the per-transaction
write buffer."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Protocol

from planetserve.chain import layout
from planetserve.chain.layout import (
    APP_VERSION_KEY,
    DEPLOYMENT_PREFIX,
    MEMBER_PREFIX,
    NEXT_DEPLOYMENT_KEY,
    NEXT_PROPOSAL_KEY,
    NODE_PREFIX,
    PARAMS_KEY,
    PROPOSAL_PREFIX,
    UPGRADE_KEY,
    R,
    account_key,
    assigned_key,
    attestation_key,
    commitment_key,
    credits_key,
    delisted_key,
    deployment_expiry_key,
    deployment_key,
    epoch_key,
    expiry_key,
    fault_counter_key,
    fault_epoch_prefix,
    fault_key,
    fault_prefix,
    last_key_bytes,
    listed_key,
    member_key,
    member_rotation_key,
    member_rotation_prefix,
    missed_key,
    model_key,
    node_key,
    node_list_key,
    node_rotation_key,
    node_rotation_prefix,
    org_key,
    org_node_key,
    org_node_prefix,
    org_reputation_key,
    param_change_key,
    plan_key,
    price_key,
    proposal_key,
    rechallenge_count_key,
    rechallenge_key,
    report_key,
    reputation_key,
    required_count_key,
    required_key,
    required_prefix,
    result_key,
    retired_key,
    user_key,
    user_list_key,
    vrf_prefix,
)
from planetserve.registry import codec, finalization
from planetserve.registry.credits import Credits, Deployment
from planetserve.registry.entities import (
    Member,
    MemberRotation,
    Model,
    ModelNode,
    NodeRotation,
    Organisation,
    Proposal,
    Record,
    UpgradePlan,
    User,
)
from planetserve.registry.epochs import (
    ChallengeResult,
    Epoch,
    Fault,
    PlanEntry,
    Rechallenge,
    Reputation,
    VrfEntry,
)
from planetserve.registry.params import Params

GENESIS_APP_VERSION = 1


class KV(Protocol):
    def get(self, key: bytes) -> bytes | None: ...
    def set(self, key: bytes, value: bytes) -> None: ...
    def delete(self, key: bytes) -> None: ...


class IterableKV(KV, Protocol):
    def iterate(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]: ...


class TxScope:
    """Writes of one transaction, applied to the block's batch only if the transaction succeeds."""

    def __init__(self, base: IterableKV) -> None:
        self._base = base
        self._writes: dict[bytes, bytes | None] = {}

    def get(self, k: bytes) -> bytes | None:
        if k in self._writes:
            return self._writes[k]
        return self._base.get(k)

    def set(self, k: bytes, value: bytes) -> None:
        self._writes[k] = value

    def delete(self, k: bytes) -> None:
        self._writes[k] = None

    def iterate(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        merged = dict(self._base.iterate(prefix))
        for k, value in self._writes.items():
            if k.startswith(prefix):
                if value is None:
                    merged.pop(k, None)
                else:
                    merged[k] = value
        for k in sorted(merged):
            yield k, merged[k]

    def apply(self) -> None:
        for k in sorted(self._writes):
            value = self._writes[k]
            if value is None:
                self._base.delete(k)
            else:
                self._base.set(k, value)


class State:
    """Typed reads and writes of registry entities over any key-value view."""

    def __init__(self, kv: IterableKV) -> None:
        self.kv = kv

    def iterate_nodes(self) -> Iterator[ModelNode]:
        for _, value in self.kv.iterate(NODE_PREFIX):
            yield ModelNode.decode(value)

    def iterate_deployments(self) -> Iterator[Deployment]:
        for _, value in self.kv.iterate(DEPLOYMENT_PREFIX):
            yield Deployment.decode(value)

    def _load(self, k: bytes, cls: type[R]) -> R | None:
        raw = self.kv.get(k)
        return None if raw is None else cls.decode(raw)

    def _put(self, k: bytes, entity: Record) -> None:
        self.kv.set(k, entity.encode())

    def get_int(self, k: bytes) -> int:
        raw = self.kv.get(k)
        return 0 if raw is None else int(codec.unpack_stored(raw))

    def put_int(self, k: bytes, value: int) -> None:
        self.kv.set(k, codec.pack(value))

    def sequence(self, signer: bytes) -> int:
        return self.get_int(account_key(signer))

    def params(self) -> Params:
        loaded = self._load(PARAMS_KEY, Params)
        return loaded if loaded is not None else Params()

    def put_params(self, params: Params) -> None:
        self._put(PARAMS_KEY, params)

    def param_changes(self, height: int) -> dict[str, int]:
        """The parameter changes approved for block `height` (empty: none)."""
        raw = self.kv.get(param_change_key(height))
        return {} if raw is None else dict(codec.unpack_stored(raw))

    def put_param_changes(self, height: int, changes: dict[str, int]) -> None:
        self.kv.set(param_change_key(height), codec.pack(dict(sorted(changes.items()))))

    def delete_param_changes(self, height: int) -> None:
        self.kv.delete(param_change_key(height))

    def upgrade(self) -> UpgradePlan | None:
        return self._load(UPGRADE_KEY, UpgradePlan)

    def put_upgrade(self, plan: UpgradePlan) -> None:
        self._put(UPGRADE_KEY, plan)

    def delete_upgrade(self) -> None:
        self.kv.delete(UPGRADE_KEY)

    def app_version(self) -> int:
        """The app version the chain runs: 1 until an upgrade raises it."""
        return self.get_int(APP_VERSION_KEY) or GENESIS_APP_VERSION

    def put_app_version(self, version: int) -> None:
        self.put_int(APP_VERSION_KEY, version)

    def org(self, org_id: str) -> Organisation | None:
        return self._load(org_key(org_id), Organisation)

    def put_org(self, org: Organisation) -> None:
        self._put(org_key(org.org_id), org)

    def model(self, model_id: str) -> Model | None:
        return self._load(model_key(model_id), Model)

    def put_model(self, model: Model) -> None:
        self._put(model_key(model.model_id), model)

    def user(self, pubkey: bytes) -> User | None:
        return self._load(user_key(pubkey), User)

    def put_user(self, user: User) -> None:
        """Store a user with its list entry and expiry index, replacing the old ones."""
        old = self.user(user.pubkey)
        if old is not None:
            self.kv.delete(user_list_key(old))
            self.kv.delete(expiry_key(old.expires_at, old.pubkey))
        record = user.encode()
        self.kv.set(user_key(user.pubkey), record)
        self.kv.set(user_list_key(user), record)
        self.kv.set(expiry_key(user.expires_at, user.pubkey), b"")

    def delete_user(self, user: User) -> None:
        self.kv.delete(user_key(user.pubkey))
        self.kv.delete(user_list_key(user))
        self.kv.delete(expiry_key(user.expires_at, user.pubkey))

    def node(self, pubkey: bytes) -> ModelNode | None:
        return self._load(node_key(pubkey), ModelNode)

    def put_node(self, node: ModelNode, *, at: int, listable: bool | None = None) -> None:
        """Store a model node with its list entry: only active nodes whose reputation record lets them
        be listed (trusted and past probation) are. `listable` is that record's verdict when the caller
        already knows it. A node that comes onto the list at block time `at` keeps that time
        (`listed_since`), and one that leaves it keeps that (`delisted_at`)."""
        old = self.node(node.pubkey)
        was_listed = old is not None and self.kv.get(node_list_key(old)) is not None
        if old is not None:
            self.kv.delete(node_list_key(old))
        record = node.encode()
        self.kv.set(node_key(node.pubkey), record)
        if listable is None:
            listable = self.listable(node.pubkey)
        if node.status == "active" and listable:
            self.kv.set(node_list_key(node), record)
            if not was_listed:
                self.put_int(listed_key(node.pubkey), at)
        elif was_listed:
            self.put_int(delisted_key(node.pubkey), at)

    def delete_node(self, node: ModelNode) -> None:
        self.kv.delete(node_key(node.pubkey))
        self.kv.delete(node_list_key(node))
        self.kv.delete(delisted_key(node.pubkey))
        self.kv.delete(listed_key(node.pubkey))

    def listed_since(self, node: bytes) -> int | None:
        """The block time the node last came onto the verified list, if it ever did."""
        raw = self.kv.get(listed_key(node))
        return None if raw is None else int(codec.unpack_stored(raw))

    def delisted_at(self, node: bytes) -> int | None:
        """The block time the node last left the verified list, if it ever did."""
        raw = self.kv.get(delisted_key(node))
        return None if raw is None else int(codec.unpack_stored(raw))

    def listed(self, node: ModelNode) -> bool:
        """Whether the node is on the verified node list: active, trusted and past probation."""
        return node.status == "active" and self.listable(node.pubkey)

    def add_org_node(self, org_id: str, node: bytes) -> None:
        self.kv.set(org_node_key(org_id, node), b"")

    def org_reputations(self, org_id: str) -> list[int]:
        """The reputations of every node the organisation registered, deactivated ones included, in
        key order: its record, which a node taken out of service does not leave. Reads them all: for
        the epoch's end, which rescores them anyway (`org_reputation` reads one entry)."""
        return [rep.value for k, _ in self.kv.iterate(org_node_prefix(org_id))
                if (rep := self.reputation(last_key_bytes(k))) is not None]

    def org_reputation(self, org_id: str) -> int | None:
        """The least of `org_reputations`, None before the organisation's first node. Kept in one entry
        as reputations change (a new node's start, the epoch's scores): a registration and a deployment
        read it, where reading every node made a block of one organisation's registrations cost the
        square of its nodes."""
        raw = self.kv.get(org_reputation_key(org_id))
        return None if raw is None else int(codec.unpack_stored(raw))

    def put_org_reputation(self, org_id: str, value: int) -> None:
        self.put_int(org_reputation_key(org_id), value)

    def is_member(self, operator: bytes) -> bool:
        return self.kv.get(member_key(operator)) is not None

    def member(self, operator: bytes) -> Member | None:
        return self._load(member_key(operator), Member)

    def put_member(self, member: Member) -> None:
        self._put(member_key(member.operator), member)

    def delete_member(self, operator: bytes) -> None:
        self.kv.delete(member_key(operator))

    def proposal(self, proposal_id: int) -> Proposal | None:
        return self._load(proposal_key(proposal_id), Proposal)

    def proposals(self) -> Iterator[Proposal]:
        for _, value in self.kv.iterate(PROPOSAL_PREFIX):
            yield Proposal.decode(value)

    def put_proposal(self, proposal: Proposal) -> None:
        self._put(proposal_key(proposal.proposal_id), proposal)

    def delete_proposal(self, proposal_id: int) -> None:
        self.kv.delete(proposal_key(proposal_id))

    def epoch(self, number: int) -> Epoch | None:
        return self._load(epoch_key(number), Epoch)

    def put_epoch(self, epoch: Epoch) -> None:
        self._put(epoch_key(epoch.number), epoch)

    def vrf_entry(self, epoch: int, operator: bytes) -> VrfEntry | None:
        return self._load(vrf_prefix(epoch) + operator.hex().encode(), VrfEntry)

    def put_vrf_entry(self, epoch: int, entry: VrfEntry) -> None:
        self._put(vrf_prefix(epoch) + entry.operator.hex().encode(), entry)

    def require_planned(self, epoch: int, nodes: Iterable[bytes]) -> None:
        count = 0
        for node in nodes:
            self.kv.set(required_key(epoch, node), b"")
            count += 1
        self.put_int(required_count_key(epoch), count)

    def plan_required(self, epoch: int) -> list[bytes]:
        """The nodes the plan of `epoch` must cover, in key order: fixed at its setup block."""
        return [last_key_bytes(k) for k, _ in self.kv.iterate(required_prefix(epoch))]

    def plan_requires(self, epoch: int, node: bytes) -> bool:
        """Whether the plan of `epoch` must cover `node`: one entry read, where a plan part that read
        them all cost the square of the nodes over the whole plan."""
        return self.kv.get(required_key(epoch, node)) is not None

    def plan_required_count(self, epoch: int) -> int:
        return self.get_int(required_count_key(epoch))

    def plan_entry(self, epoch: int, node: bytes) -> PlanEntry | None:
        return self._load(plan_key(epoch, node), PlanEntry)

    def put_plan_entry(self, epoch: int, entry: PlanEntry) -> None:
        self._put(plan_key(epoch, entry.node), entry)

    def commitment_used(self, epoch: int, commitment: bytes) -> bool:
        return self.kv.get(commitment_key(epoch, commitment)) is not None

    def use_commitment(self, epoch: int, commitment: bytes, node: bytes) -> None:
        self.kv.set(commitment_key(epoch, commitment), node)

    def rechallenge(self, epoch: int, member: bytes, tag: bytes) -> Rechallenge | None:
        return self._load(rechallenge_key(epoch, member, tag), Rechallenge)

    def rechallenges_committed(self, epoch: int, member: bytes) -> int:
        return self.get_int(rechallenge_count_key(epoch, member))

    def put_rechallenge(self, epoch: int, entry: Rechallenge) -> None:
        self._put(rechallenge_key(epoch, entry.member, entry.tag), entry)
        count = rechallenge_count_key(epoch, entry.member)
        self.put_int(count, self.get_int(count) + 1)

    def result(self, epoch: int, node: bytes, submitter: bytes) -> ChallengeResult | None:
        return self._load(result_key(epoch, node, submitter), ChallengeResult)

    def put_result(self, epoch: int, result: ChallengeResult) -> None:
        self._put(result_key(epoch, result.node, result.submitter), result)

    def attestations(self, epoch: int, node: bytes, submitter: bytes) -> list[list]:
        raw = self.kv.get(attestation_key(epoch, node, submitter))
        return [] if raw is None else codec.unpack_stored(raw)

    def put_attestations(self, epoch: int, node: bytes, submitter: bytes, scores: list[list]) -> None:
        self.kv.set(attestation_key(epoch, node, submitter), codec.pack(sorted(scores)))

    def reports(self, epoch: int, node: bytes) -> list[bytes]:
        raw = self.kv.get(report_key(epoch, node))
        return [] if raw is None else codec.unpack_stored(raw)

    def put_reports(self, epoch: int, node: bytes, members: list[bytes]) -> None:
        self.kv.set(report_key(epoch, node), codec.pack(sorted(members)))

    def add_fault(self, fault: Fault) -> None:
        """Faults of one operator are numbered in the order the chain recorded them; the epoch's record
        counts those that count toward a member's removal (not `finalization.UNCOUNTED`)."""
        counter = fault_counter_key(fault.operator)
        n = self.get_int(counter)
        self.put_int(counter, n + 1)
        self._put(fault_key(fault.operator, fault.epoch, n), fault)
        record = self.epoch(fault.epoch) if fault.kind not in finalization.UNCOUNTED else None
        if record is not None:
            self.put_epoch(replace(record, faults=record.faults + 1))

    def move_faults(self, old: bytes, new: bytes) -> None:
        """A member's faults, numbered as they were, under its new operator key."""
        for k, value in list(self.kv.iterate(fault_prefix(old))):
            self.kv.delete(k)
            moved = replace(Fault.decode(value), operator=new)
            self._put(fault_prefix(new) + k[len(fault_prefix(old)):], moved)
        counter = self.get_int(fault_counter_key(old))
        if counter:
            self.kv.delete(fault_counter_key(old))
            self.put_int(fault_counter_key(new), counter)

    def faults_in(self, operator: bytes, epochs: range) -> int:
        """How many faults of the operator that count toward its removal (not `finalization.UNCOUNTED`)
        the chain recorded in these epochs: one prefix read per epoch, so the cost stays with the window,
        not with the operator's whole history."""
        return sum(1 for epoch in epochs for _, raw in self.kv.iterate(fault_epoch_prefix(operator, epoch))
                   if Fault.decode(raw).kind not in finalization.UNCOUNTED)

    def missed(self, epoch: int, operator: bytes) -> int:
        return self.get_int(missed_key(epoch, operator))

    def add_missed(self, epoch: int, operator: bytes) -> None:
        self.put_int(missed_key(epoch, operator), self.missed(epoch, operator) + 1)

    def reputation(self, node: bytes) -> Reputation | None:
        return self._load(reputation_key(node), Reputation)

    def listable(self, node: bytes) -> bool:
        """Whether the node's reputation record lets it be listed (every registered node has one)."""
        rep = self.reputation(node)
        return rep is not None and rep.listable

    def put_reputation(self, rep: Reputation) -> None:
        self._put(reputation_key(rep.node), rep)

    def price(self, hardware: str) -> int:
        """Credits per server-hour of a hardware class; 0 when the class has no price."""
        return self.get_int(price_key(hardware))

    def credits(self, org_id: str) -> Credits:
        loaded = self._load(credits_key(org_id), Credits)
        return loaded if loaded is not None else Credits(org_id, 0, 0, 0)

    def put_credits(self, account: Credits) -> None:
        self._put(credits_key(account.org_id), account)

    def deployment(self, deployment_id: int) -> Deployment | None:
        return self._load(deployment_key(deployment_id), Deployment)

    def deployment_of(self, node: bytes) -> Deployment | None:
        """The deployment the node is assigned to, if any."""
        raw = self.kv.get(assigned_key(node))
        return None if raw is None else self.deployment(int(codec.unpack_stored(raw)))

    def put_deployment(self, deployment: Deployment) -> None:
        self._put(deployment_key(deployment.deployment_id), deployment)
        for node in deployment.nodes:
            self.put_int(assigned_key(node), deployment.deployment_id)
        self.kv.set(deployment_expiry_key(deployment.expires_at, deployment.deployment_id), b"")

    def delete_deployment(self, deployment: Deployment) -> None:
        self.kv.delete(deployment_key(deployment.deployment_id))
        for node in deployment.nodes:
            self.kv.delete(assigned_key(node))
        self.kv.delete(deployment_expiry_key(deployment.expires_at, deployment.deployment_id))

    def retired(self, pubkey: bytes) -> NodeRotation | None:
        """The rotation that reserves or retired `pubkey`, if any."""
        return self._load(retired_key(pubkey), NodeRotation)

    def put_node_rotation(self, rotation: NodeRotation) -> None:
        self._put(node_rotation_key(rotation.height, rotation.old), rotation)
        self._put(retired_key(rotation.old), rotation)
        self._put(retired_key(rotation.new), rotation)

    def node_rotations_due(self, height: int) -> list[NodeRotation]:
        return layout.decode_records(list(self.kv.iterate(node_rotation_prefix(height))), NodeRotation)

    def finish_node_rotation(self, rotation: NodeRotation) -> None:
        """The new key is registered now (its node record guards it); the old one stays retired."""
        self.kv.delete(node_rotation_key(rotation.height, rotation.old))
        self.kv.delete(retired_key(rotation.new))

    def member_rotations(self) -> list[MemberRotation]:
        """Every pending member rotation (at most one per member), in key order."""
        return layout.decode_records(list(self.kv.iterate(layout.MEMBER_ROTATION_PREFIX)), MemberRotation)

    def member_rotations_due(self, height: int) -> list[MemberRotation]:
        return layout.decode_records(list(self.kv.iterate(member_rotation_prefix(height))), MemberRotation)

    def put_member_rotation(self, rotation: MemberRotation) -> None:
        self._put(member_rotation_key(rotation.height, rotation.operator), rotation)

    def delete_member_rotation(self, rotation: MemberRotation) -> None:
        self.kv.delete(member_rotation_key(rotation.height, rotation.operator))

    def put_retired_consensus(self, consensus_key: bytes, operator: bytes, until: int) -> None:
        """A member's consensus key rotated away, which the commits CometBFT reports name up to height
        `until`: the member's misses under it still count."""
        self.kv.set(layout.retired_consensus_key(consensus_key), codec.pack([operator, until]))

    def retired_consensus(self) -> list[tuple[bytes, bytes, int]]:
        """(consensus key, operator, last height) of each retired consensus key still kept, in key order."""
        prefix = layout.RETIRED_CONSENSUS_PREFIX
        return [(bytes.fromhex(k[len(prefix):].decode()), *codec.unpack_stored(v))
                for k, v in self.kv.iterate(prefix)]

    def delete_retired_consensus(self, consensus_key: bytes) -> None:
        self.kv.delete(layout.retired_consensus_key(consensus_key))

    def next_deployment_id(self) -> int:
        value = self.get_int(NEXT_DEPLOYMENT_KEY) + 1
        self.put_int(NEXT_DEPLOYMENT_KEY, value)
        return value

    def next_proposal_id(self) -> int:
        value = self.get_int(NEXT_PROPOSAL_KEY) + 1
        self.put_int(NEXT_PROPOSAL_KEY, value)
        return value


def members(kv: IterableKV) -> dict[bytes, Member]:
    """The committee, keyed by operator key, in key order."""
    return {
        m.operator: m
        for m in (Member.decode(v) for _, v in kv.iterate(MEMBER_PREFIX))
    }


def due(kv: IterableKV, prefix: bytes, now: int) -> list[bytes]:
    """The identifiers in an expiry index (keys prefix + <time:012d>/<id>) whose time is at or
    before `now`, in index order: the index is sorted by time, so the scan stops at the first later one."""
    out = []
    for k, _ in kv.iterate(prefix):
        expires_at, _, ident = k[len(prefix):].partition(b"/")
        if int(expires_at) > now:
            break
        out.append(ident)
    return out

