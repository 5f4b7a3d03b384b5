"""The state layout: which key holds what, and typed access to it.

Every key is ASCII. Identifier components are percent-escaped so that a prefix query for one model
or region can never match another (model ids may contain '/').

    acct/<signer hex>                       account sequence (int)
    params                                  Params
    org/<org>                               Organisation
    user/<pubkey hex>                       User
    ulist/<region>/<pubkey hex>             User            (the signed user list, per region)
    uexp/<expires_at:012d>/<pubkey hex>     b""             (expiry index, swept every block)
    model/<model>                           Model
    node/<pubkey hex>                       ModelNode
    nlist/<model>/<region>/<pubkey hex>     ModelNode       (the signed node list, per model/region)
    member/<operator hex>                   Member
    proposal/<id:012d>                      Proposal
    next/proposal                           int

Verification epochs (<e> is the epoch number as %010d):
    epoch/<e>                               Epoch
    vrf/<e>/<operator hex>                  VrfEntry        (proofs electing the leader of e)
    plan/<e>/<node hex>                     PlanEntry
    pcom/<e>/<commitment hex>               node pubkey     (no commitment twice in an epoch)
    rch/<e>/<node hex>/<member hex>         Rechallenge
    res/<e>/<node hex>/<submitter hex>      ChallengeResult
    att/<e>/<node hex>/<submitter hex>      [[member, credibility ppm], ...] sorted by member
    inv/<e>/<node hex>                      [member, ...]   (reports of no valid response)
    fault/<operator hex>/<e>/<n:04d>        Fault
    rep/<node hex>                          Reputation

Contribution credits and deployments:
    price/<hardware>                        credits per server-hour (int)
    credit/<org>                            Credits         (credit-seconds)
    deploy/<id:012d>                        Deployment
    dnode/<node hex>                        deployment id   (nodes serving a deployment)
    dexp/<expires_at:012d>/<id:012d>        b""             (expiry index, swept every block)
    next/deployment                         int
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, TypeVar
from urllib.parse import quote

from planetserve.registry import codec, reputation
from planetserve.registry.credits import Credits, Deployment
from planetserve.registry.entities import (
    Member,
    Model,
    ModelNode,
    Organisation,
    Proposal,
    Record,
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

R = TypeVar("R", bound=Record)


class KV(Protocol):
    def get(self, key: bytes) -> bytes | None: ...
    def set(self, key: bytes, value: bytes) -> None: ...
    def delete(self, key: bytes) -> None: ...


class IterableKV(KV, Protocol):
    def iterate(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]: ...


def _c(component: str) -> str:
    return quote(component, safe="")


def key(*parts: str) -> bytes:
    return "/".join(parts).encode("ascii")


def account_key(signer: bytes) -> bytes:
    return key("acct", signer.hex())


ORG_PREFIX = key("org", "")


def org_key(org_id: str) -> bytes:
    return key("org", _c(org_id))


def user_key(pubkey: bytes) -> bytes:
    return key("user", pubkey.hex())


def user_list_prefix(region: str | None = None) -> bytes:
    return key("ulist", _c(region), "") if region else key("ulist", "")


def user_list_key(user: User) -> bytes:
    return user_list_prefix(user.region) + user.pubkey.hex().encode()


EXPIRY_PREFIX = key("uexp", "")


def expiry_key(expires_at: int, pubkey: bytes) -> bytes:
    return EXPIRY_PREFIX + f"{expires_at:012d}/{pubkey.hex()}".encode()


def model_key(model_id: str) -> bytes:
    return key("model", _c(model_id))


def node_key(pubkey: bytes) -> bytes:
    return key("node", pubkey.hex())


def node_list_prefix(model_id: str | None = None, region: str | None = None) -> bytes:
    if model_id is None:
        return key("nlist", "")
    if region is None:
        return key("nlist", _c(model_id), "")
    return key("nlist", _c(model_id), _c(region), "")


def node_list_key(node: ModelNode) -> bytes:
    return node_list_prefix(node.model_id, node.region) + node.pubkey.hex().encode()


def member_key(operator: bytes) -> bytes:
    return key("member", operator.hex())


MEMBER_PREFIX = key("member", "")


PROPOSAL_PREFIX = key("proposal", "")


def proposal_key(proposal_id: int) -> bytes:
    return PROPOSAL_PREFIX + f"{proposal_id:012d}".encode()


def _e(epoch: int) -> str:
    return f"{epoch:010d}"


def epoch_key(epoch: int) -> bytes:
    return key("epoch", _e(epoch))


def vrf_prefix(epoch: int) -> bytes:
    return key("vrf", _e(epoch), "")


def plan_prefix(epoch: int) -> bytes:
    return key("plan", _e(epoch), "")


def plan_key(epoch: int, node: bytes) -> bytes:
    return plan_prefix(epoch) + node.hex().encode()


def commitment_key(epoch: int, commitment: bytes) -> bytes:
    return key("pcom", _e(epoch), commitment.hex())


def rechallenge_key(epoch: int, node: bytes, member: bytes) -> bytes:
    return key("rch", _e(epoch), node.hex(), member.hex())


def result_prefix(epoch: int, node: bytes | None = None) -> bytes:
    return key("res", _e(epoch), node.hex(), "") if node else key("res", _e(epoch), "")


def result_key(epoch: int, node: bytes, submitter: bytes) -> bytes:
    return result_prefix(epoch, node) + submitter.hex().encode()


def attestation_prefix(epoch: int) -> bytes:
    return key("att", _e(epoch), "")


def attestation_key(epoch: int, node: bytes, submitter: bytes) -> bytes:
    return attestation_prefix(epoch) + f"{node.hex()}/{submitter.hex()}".encode()


def report_prefix(epoch: int) -> bytes:
    return key("inv", _e(epoch), "")


def report_key(epoch: int, node: bytes) -> bytes:
    return report_prefix(epoch) + node.hex().encode()


def fault_prefix(operator: bytes | None = None) -> bytes:
    return key("fault", operator.hex(), "") if operator else key("fault", "")


REPUTATION_PREFIX = key("rep", "")


def reputation_key(node: bytes) -> bytes:
    return REPUTATION_PREFIX + node.hex().encode()


def price_key(hardware: str) -> bytes:
    return key("price", _c(hardware))


CREDITS_PREFIX = key("credit", "")


def credits_key(org_id: str) -> bytes:
    return key("credit", _c(org_id))


DEPLOYMENT_PREFIX = key("deploy", "")
ASSIGNED_PREFIX = key("dnode", "")
DEPLOYMENT_EXPIRY_PREFIX = key("dexp", "")
NEXT_DEPLOYMENT_KEY = key("next", "deployment")


def deployment_key(deployment_id: int) -> bytes:
    return DEPLOYMENT_PREFIX + f"{deployment_id:012d}".encode()


def assigned_key(node: bytes) -> bytes:
    return ASSIGNED_PREFIX + node.hex().encode()


def deployment_expiry_key(expires_at: int, deployment_id: int) -> bytes:
    return DEPLOYMENT_EXPIRY_PREFIX + f"{expires_at:012d}/{deployment_id:012d}".encode()


NODE_PREFIX = key("node", "")
PARAMS_KEY = key("params")
NEXT_PROPOSAL_KEY = key("next", "proposal")


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

    def put_node(self, node: ModelNode, trusted: bool | None = None) -> None:
        """Store a model node with its list entry: only active, trusted nodes are listed.
        `trusted` is the node's reputation verdict when the caller already knows it."""
        old = self.node(node.pubkey)
        if old is not None:
            self.kv.delete(node_list_key(old))
        record = node.encode()
        self.kv.set(node_key(node.pubkey), record)
        if trusted is None:
            trusted = self.trusted(node.pubkey)
        if node.status == "active" and trusted:
            self.kv.set(node_list_key(node), record)

    def member(self, operator: bytes) -> Member | None:
        return self._load(member_key(operator), Member)

    def put_member(self, member: Member) -> None:
        self._put(member_key(member.operator), member)

    def delete_member(self, operator: bytes) -> None:
        self.kv.delete(member_key(operator))

    def proposal(self, proposal_id: int) -> Proposal | None:
        return self._load(proposal_key(proposal_id), Proposal)

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

    def plan_entry(self, epoch: int, node: bytes) -> PlanEntry | None:
        return self._load(plan_key(epoch, node), PlanEntry)

    def put_plan_entry(self, epoch: int, entry: PlanEntry) -> None:
        self._put(plan_key(epoch, entry.node), entry)

    def commitment_used(self, epoch: int, commitment: bytes) -> bool:
        return self.kv.get(commitment_key(epoch, commitment)) is not None

    def use_commitment(self, epoch: int, commitment: bytes, node: bytes) -> None:
        self.kv.set(commitment_key(epoch, commitment), node)

    def rechallenge(self, epoch: int, node: bytes, member: bytes) -> Rechallenge | None:
        return self._load(rechallenge_key(epoch, node, member), Rechallenge)

    def put_rechallenge(self, epoch: int, entry: Rechallenge) -> None:
        self._put(rechallenge_key(epoch, entry.node, entry.member), entry)

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
        """Faults of one operator are numbered in the order the chain recorded them."""
        counter = key("next", "fault", fault.operator.hex())
        n = self.get_int(counter)
        self.put_int(counter, n + 1)
        self._put(fault_prefix(fault.operator) + f"{_e(fault.epoch)}/{n:04d}".encode(), fault)

    def reputation(self, node: bytes) -> Reputation | None:
        return self._load(reputation_key(node), Reputation)

    def trusted(self, node: bytes) -> bool:
        """Whether a node may be listed: its recorded verdict, or the initial reputation's."""
        rep = self.reputation(node)
        if rep is not None:
            return rep.trusted
        return reputation.never_scored_trusted(reputation.ReputationRule.from_params(self.params()))

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


def decode_records(entries: list[tuple[bytes, bytes]], cls: type[R]) -> list[R]:
    return [cls.decode(v) for _, v in entries]
