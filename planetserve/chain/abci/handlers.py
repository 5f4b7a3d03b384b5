"""Transaction handlers of the registry family. Each checks, then writes through State; a refusal
raises a RegistryError before any write becomes visible (the caller discards the TxScope)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from planetserve.chain.abci.state import State
from planetserve.chain.keys import verify_signature
from planetserve.chain.tx import node_pop_message
from planetserve.registry import fields, rules
from planetserve.registry.entities import (
    MEMBER_ACTIONS,
    NODE_STATUSES,
    Member,
    Model,
    ModelNode,
    Organisation,
    Proposal,
    User,
)
from planetserve.registry.errors import (
    AlreadyExists,
    Expired,
    InvalidField,
    Unauthorized,
    UnknownEntity,
)
from planetserve.registry.params import Params


@dataclass
class Context:
    """What a handler may see: the signer, the block's height and time, and the state."""

    state: State
    signer: bytes
    height: int
    time: int
    chain_id: str
    params: Params
    load_committee: Callable[[], dict[bytes, Member]]
    validator_updates: list[tuple[bytes, int]] = field(default_factory=list)
    events: list[tuple[str, dict[str, str]]] = field(default_factory=list)

    @cached_property
    def committee(self) -> dict[bytes, Member]:
        """Read only by the handlers that need it: loading it for every transaction would cost
        a scan per transaction."""
        return self.load_committee()

    def emit(self, kind: str, **attributes: str) -> None:
        self.events.append((kind, attributes))

    def require_member(self) -> Member:
        member = self.committee.get(self.signer)
        if member is None:
            raise Unauthorized("signer is not a committee member")
        return member


def register_org(ctx: Context, body: dict[str, Any]) -> None:
    fields.check_keys(body, {"org_id", "name"})
    org_id = fields.ident(body, "org_id")
    name = fields.text(body, "name", 128)
    if ctx.state.org(org_id) is not None:
        raise AlreadyExists(f"organisation {org_id!r} is already registered")
    ctx.state.put_org(Organisation(org_id, name, ctx.signer, ctx.time))
    ctx.emit("register_org", org_id=org_id)


def register_user(ctx: Context, body: dict[str, Any]) -> None:
    fields.check_keys(body, {"address", "region"})
    address = fields.address(body)
    region = fields.region(body)
    existing = ctx.state.user(ctx.signer)
    if existing is not None and not rules.is_expired(existing, ctx.time):
        raise AlreadyExists("user key is already registered; send a heartbeat to renew it")
    expires = rules.user_expiry(ctx.time, ctx.params.user_ttl_seconds)
    if existing is not None:
        ctx.state.delete_user(existing)
    ctx.state.put_user(User(ctx.signer, address, region, ctx.time, expires))
    ctx.emit("register_user", user=ctx.signer.hex())


def heartbeat(ctx: Context, body: dict[str, Any]) -> None:
    fields.check_keys(body, set(), frozenset({"address", "region"}))
    user = ctx.state.user(ctx.signer)
    if user is None:
        raise UnknownEntity("user is not registered (or expired and was removed); register again")
    if rules.is_expired(user, ctx.time):
        raise Expired("user registration has expired; register again")
    renewed = replace(
        user,
        address=fields.address(body) if "address" in body else user.address,
        region=fields.region(body) if "region" in body else user.region,
        expires_at=rules.user_expiry(ctx.time, ctx.params.user_ttl_seconds),
    )
    ctx.state.put_user(renewed)
    ctx.emit("heartbeat", user=ctx.signer.hex())


def register_model(ctx: Context, body: dict[str, Any]) -> None:
    fields.check_keys(body, {"model_id", "name"}, frozenset({"layers", "layer_mib"}))
    ctx.require_member()
    model_id = fields.ident(body, "model_id")
    name = fields.text(body, "name", 128)
    layers, layer_mib = fields.model_size(body)
    if ctx.state.model(model_id) is not None:
        raise AlreadyExists(f"model {model_id!r} is already registered")
    ctx.state.put_model(Model(model_id, name, ctx.time, layers, layer_mib))
    ctx.emit("register_model", model_id=model_id)


def owned_org(ctx: Context, org_id: str) -> Organisation:
    org = ctx.state.org(org_id)
    if org is None:
        raise UnknownEntity(f"organisation {org_id!r} is not registered")
    if org.owner != ctx.signer:
        raise Unauthorized(f"signer does not own organisation {org_id!r}")
    return org


def _known_model(ctx: Context, model_id: str) -> None:
    if ctx.state.model(model_id) is None:
        raise UnknownEntity(f"model {model_id!r} is not registered")


def register_model_node(ctx: Context, body: dict[str, Any]) -> None:
    fields.check_keys(
        body, {"org_id", "node_pubkey", "pop", "model_id", "address", "hardware", "capacity", "region"},
        frozenset({"memory_mib", "gflops"}),
    )
    org_id = fields.ident(body, "org_id")
    node_pubkey = fields.key32(body, "node_pubkey")
    pop = fields.sig64(body, "pop")
    node = ModelNode(
        pubkey=node_pubkey,
        org_id=org_id,
        model_id=fields.ident(body, "model_id"),
        address=fields.address(body),
        hardware=fields.hardware(body),
        capacity=fields.integer(body, "capacity", 1, 1_000_000),
        region=fields.region(body),
        status="active",
        registered_at=ctx.time,
        memory_mib=fields.integer(body, "memory_mib", 0, fields.MAX_MIB) if "memory_mib" in body else 0,
        gflops=fields.integer(body, "gflops", 0, fields.MAX_GFLOPS) if "gflops" in body else 0,
    )
    owned_org(ctx, org_id)
    _known_model(ctx, node.model_id)
    if not verify_signature(node_pubkey, node_pop_message(ctx.chain_id, org_id, node_pubkey), pop):
        raise InvalidField("pop", "is not a signature by node_pubkey over the registration")
    if ctx.state.node(node_pubkey) is not None:
        raise AlreadyExists("model node key is already registered")
    ctx.state.put_node(node)
    ctx.emit("register_model_node", node=node_pubkey.hex(), org_id=org_id, model_id=node.model_id)


def update_model_node(ctx: Context, body: dict[str, Any]) -> None:
    fields.check_keys(
        body, {"node_pubkey"},
        frozenset({"address", "capacity", "region", "status", "model_id", "memory_mib", "gflops"}),
    )
    node_pubkey = fields.key32(body, "node_pubkey")
    node = ctx.state.node(node_pubkey)
    if node is None:
        raise UnknownEntity("model node is not registered")
    owned_org(ctx, node.org_id)
    updated = replace(
        node,
        address=fields.address(body) if "address" in body else node.address,
        capacity=fields.integer(body, "capacity", 1, 1_000_000) if "capacity" in body else node.capacity,
        region=fields.region(body) if "region" in body else node.region,
        status=fields.choice(body, "status", NODE_STATUSES) if "status" in body else node.status,
        model_id=fields.ident(body, "model_id") if "model_id" in body else node.model_id,
        memory_mib=(fields.integer(body, "memory_mib", 0, fields.MAX_MIB) if "memory_mib" in body
                    else node.memory_mib),
        gflops=fields.integer(body, "gflops", 0, fields.MAX_GFLOPS) if "gflops" in body else node.gflops,
    )
    if updated.model_id != node.model_id:
        _known_model(ctx, updated.model_id)
    ctx.state.put_node(updated)
    ctx.emit("update_model_node", node=node_pubkey.hex())


def _proposed_member(ctx: Context, body: dict[str, Any]) -> Member:
    fields.check_keys(
        body, {"action", "operator", "consensus_key", "vrf_key", "x25519_key", "credential", "power"}
    )
    member = Member(
        operator=fields.key32(body, "operator"),
        consensus_key=fields.key32(body, "consensus_key"),
        vrf_key=fields.key32(body, "vrf_key"),
        x25519_key=fields.key32(body, "x25519_key"),
        credential=fields.text(body, "credential", 1024),
        power=fields.integer(body, "power", 1, 1_000_000),
    )
    if member.operator in ctx.committee:
        raise AlreadyExists("operator key is already a committee member")
    if any(m.consensus_key == member.consensus_key for m in ctx.committee.values()):
        raise AlreadyExists("consensus key is already used by a committee member")
    return member


def propose_member(ctx: Context, body: dict[str, Any]) -> None:
    ctx.require_member()
    action = fields.choice(body, "action", MEMBER_ACTIONS)
    if action == "add":
        member = _proposed_member(ctx, body)
    else:
        fields.check_keys(body, {"action", "operator"})
        operator = fields.key32(body, "operator")
        existing = ctx.committee.get(operator)
        if existing is None:
            raise UnknownEntity("operator is not a committee member")
        if len(ctx.committee) == 1:
            raise InvalidField("operator", "cannot remove the last committee member")
        member = existing
    proposal = Proposal(
        proposal_id=ctx.state.next_proposal_id(),
        action=action,
        member=member.to_record(),
        proposer=ctx.signer,
        votes=(ctx.signer,),
        rejections=(),
        created_height=ctx.height,
        expires_height=ctx.height + ctx.params.proposal_ttl_blocks,
    )
    ctx.emit("propose_member", proposal_id=str(proposal.proposal_id), action=action)
    _settle(ctx, proposal)


def vote_member(ctx: Context, body: dict[str, Any]) -> None:
    fields.check_keys(body, {"proposal_id", "approve"})
    ctx.require_member()
    proposal_id = fields.integer(body, "proposal_id", 1, 2**62)
    approve = fields.flag(body, "approve")
    proposal = ctx.state.proposal(proposal_id)
    if proposal is None:
        raise UnknownEntity(f"proposal {proposal_id} does not exist (or was settled)")
    if proposal.expires_height < ctx.height:
        raise Expired(f"proposal {proposal_id} expired at height {proposal.expires_height}")
    if ctx.signer in proposal.votes or ctx.signer in proposal.rejections:
        raise AlreadyExists(f"signer already voted on proposal {proposal_id}")
    if approve:
        proposal = replace(proposal, votes=tuple(sorted((*proposal.votes, ctx.signer))))
    else:
        proposal = replace(proposal, rejections=tuple(sorted((*proposal.rejections, ctx.signer))))
    ctx.emit("vote_member", proposal_id=str(proposal_id), approve=str(approve).lower())
    _settle(ctx, proposal)


def _settle(ctx: Context, proposal: Proposal) -> None:
    """Apply an approved proposal, drop a rejected one, or keep it pending."""
    total = sum(m.power for m in ctx.committee.values())
    if rules.supermajority(rules.voting_power(proposal.votes, ctx.committee), total):
        member = Member.from_record(proposal.member)
        if proposal.action == "add":
            ctx.state.put_member(member)
            ctx.validator_updates.append((member.consensus_key, member.power))
        else:
            ctx.state.delete_member(member.operator)
            ctx.validator_updates.append((member.consensus_key, 0))
        ctx.state.delete_proposal(proposal.proposal_id)
        ctx.emit("member_" + ("admitted" if proposal.action == "add" else "removed"),
                 operator=member.operator.hex())
    elif rules.blocking_minority(rules.voting_power(proposal.rejections, ctx.committee), total):
        ctx.state.delete_proposal(proposal.proposal_id)
        ctx.emit("proposal_rejected", proposal_id=str(proposal.proposal_id))
    else:
        ctx.state.put_proposal(proposal)


REGISTRY_HANDLERS: dict[str, Callable[[Context, dict[str, Any]], None]] = {
    "register-org": register_org,
    "register-user": register_user,
    "heartbeat": heartbeat,
    "register-model": register_model,
    "register-model-node": register_model_node,
    "update-model-node": update_model_node,
    "propose-member": propose_member,
    "vote-member": vote_member,
}
