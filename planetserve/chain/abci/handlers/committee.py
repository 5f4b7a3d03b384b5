"""Handlers of the committee family: a proposal (to admit or remove a member, register a model, change
parameters at a height, or require a newer app from a height on) is applied once more than 2/3 of the
voting power approves it, and dropped once more than 1/3 rejects it. A proposal for a height expires the block
before it: what is approved always lies in the future (chain/abci/governance.py applies it)."""

from __future__ import annotations

from dataclasses import replace

from planetserve.chain.abci.handlers.context import Context
from planetserve.chain.abci.rotations import next_epoch_start
from planetserve.chain.keys import verify_signature
from planetserve.chain.layout import fault_counter_key
from planetserve.chain.messages.committee import (
    ProposeMember,
    ProposeParams,
    ProposeUpgrade,
    RotateMemberKey,
    VoteMember,
)
from planetserve.chain.messages.registry import RegisterModel
from planetserve.registry import rules
from planetserve.registry.entities import Member, MemberRotation, Model, Proposal, UpgradePlan
from planetserve.registry.epochs import Schedule
from planetserve.registry.errors import AlreadyExists, Expired, InvalidField, RateLimited, UnknownEntity
from planetserve.registry.params import EPOCH_WINDOWS


def _admitted(ctx: Context, msg: ProposeMember) -> Member:
    member = msg.member()
    if member.operator in ctx.committee:
        raise AlreadyExists("operator key is already a committee member")
    if rules.consensus_key_used(ctx.committee.values(), member.consensus_key):
        raise AlreadyExists("consensus key is already used by a committee member")
    return member


def _existing(ctx: Context, operator: bytes) -> Member:
    existing = ctx.committee.get(operator)
    if existing is None:
        raise UnknownEntity("operator is not a committee member")
    return existing


def _removed(ctx: Context, msg: ProposeMember) -> Member:
    existing = _existing(ctx, msg.operator)
    if len(ctx.committee) == 1:
        raise InvalidField("operator", "cannot remove the last committee member")
    return existing


def propose_member(ctx: Context, msg: ProposeMember) -> None:
    ctx.require_member()
    if msg.action == "add":
        member = _admitted(ctx, msg)
    elif msg.action == "remove":
        member = _removed(ctx, msg)
    else:
        member = replace(_existing(ctx, msg.operator), credential=msg.credential)
    _propose(ctx, msg.action, member.to_record(), "propose_member")


def register_model(ctx: Context, msg: RegisterModel) -> None:
    """A model is registered by vote: every node of a registered model is planned each epoch, and each
    member must hold its reference model to lead and attest, so one member registering a model only it
    held had every other leader faulted for the nodes it could not verify, until it was left alone."""
    ctx.require_member()
    if ctx.state.model(msg.model_id) is not None:
        raise AlreadyExists(f"model {msg.model_id!r} is already registered")
    model = Model(msg.model_id, msg.name, 0, msg.layers or 0, msg.layer_mib or 0)
    _propose(ctx, "model", model.to_record(), "propose_model")


def propose_params(ctx: Context, msg: ProposeParams) -> None:
    ctx.require_member()
    _future(ctx, msg.height)
    ctx.params.changed(msg.changes)  # would hold today; checked again at its height
    windows = sorted(EPOCH_WINDOWS & msg.changes.keys())
    schedule = Schedule.from_params(ctx.params)  # epoch_blocks, which no vote changes
    if windows and schedule.offset(msg.height) != 0:
        following = schedule.start(schedule.epoch_of(msg.height) + 1)
        raise InvalidField("height", f"must be an epoch's first block to change {', '.join(windows)} "
                                     f"(inside an epoch the block that sets up the next could be skipped); "
                                     f"the next epoch after it starts at {following}")
    _propose(ctx, "params", {"height": msg.height, "changes": msg.changes}, "propose_params",
             until=msg.height - 1)


def propose_upgrade(ctx: Context, msg: ProposeUpgrade) -> None:
    ctx.require_member()
    _future(ctx, msg.height)
    current = ctx.state.app_version()
    if msg.app_version <= current:
        raise InvalidField("app_version", f"must be above the chain's app version {current}")
    plan = UpgradePlan(msg.name, msg.app_version, msg.height)
    _propose(ctx, "upgrade", plan.to_record(), "propose_upgrade", until=msg.height - 1)


def _future(ctx: Context, height: int) -> None:
    if height <= ctx.height + 1:
        raise InvalidField("height", f"must be after the next block ({ctx.height + 1}): a vote needs time")


MAX_OPEN_PROPOSALS = 8
"""Proposals one member may have pending at once: every block reads each pending proposal to expire it,
and a member sending proposals without end (5,000 a block) slowed every block of the chain."""


def _propose(ctx: Context, action: str, subject: dict, event: str, until: int | None = None) -> None:
    pending = sum(p.proposer == ctx.signer for p in ctx.state.proposals())
    if pending >= MAX_OPEN_PROPOSALS:
        raise RateLimited(f"signer has {pending} proposals pending, the most a member may; propose again "
                          "once one is settled or expires")
    expires = ctx.height + ctx.params.proposal_ttl_blocks
    proposal = Proposal(
        proposal_id=ctx.state.next_proposal_id(),
        action=action,
        subject=subject,
        proposer=ctx.signer,
        votes=(ctx.signer,),
        rejections=(),
        created_height=ctx.height,
        expires_height=expires if until is None else min(expires, until),
    )
    ctx.emit(event, proposal_id=str(proposal.proposal_id), action=action)
    _settle(ctx, proposal)


def vote_member(ctx: Context, msg: VoteMember) -> None:
    ctx.require_member()
    proposal = ctx.state.proposal(msg.proposal_id)
    if proposal is None:
        raise UnknownEntity(f"proposal {msg.proposal_id} does not exist (or was settled)")
    if proposal.expires_height < ctx.height:
        raise Expired(f"proposal {msg.proposal_id} expired at height {proposal.expires_height}")
    if ctx.signer in proposal.votes or ctx.signer in proposal.rejections:
        raise AlreadyExists(f"signer already voted on proposal {msg.proposal_id}")
    if msg.approve:
        proposal = replace(proposal, votes=tuple(sorted((*proposal.votes, ctx.signer))))
    else:
        proposal = replace(proposal, rejections=tuple(sorted((*proposal.rejections, ctx.signer))))
    ctx.emit("vote_member", proposal_id=str(msg.proposal_id), approve=str(msg.approve).lower())
    _settle(ctx, proposal)


def _settle(ctx: Context, proposal: Proposal) -> None:
    """Apply an approved proposal, drop a rejected one, or keep it pending."""
    total = sum(m.power for m in ctx.committee.values())
    if rules.supermajority(rules.voting_power(proposal.votes, ctx.committee), total):
        ctx.state.delete_proposal(proposal.proposal_id)
        if proposal.action == "params":
            _schedule_params(ctx, proposal.subject["height"], proposal.subject["changes"])
            return
        if proposal.action == "model":
            _register(ctx, proposal)
            return
        if proposal.action == "upgrade":
            plan = UpgradePlan.from_record(proposal.subject)
            ctx.state.put_upgrade(plan)
            ctx.emit("upgrade_scheduled", name=plan.name, app_version=str(plan.app_version),
                     height=str(plan.height))
            return
        member = Member.from_record(proposal.subject)
        if proposal.action == "renew":
            current = ctx.committee.get(member.operator)
            if current is None:  # removed since: nothing to renew
                ctx.emit("proposal_void", proposal_id=str(proposal.proposal_id))
                return
            renewed = replace(current, credential=member.credential,
                              expires_at=ctx.time + ctx.params.credential_ttl_seconds)
            ctx.state.put_member(renewed)
            ctx.emit("member_renewed", operator=member.operator.hex(), expires_at=str(renewed.expires_at))
            return
        if proposal.action == "add":
            if rules.consensus_key_used(ctx.committee.values(), member.consensus_key):
                ctx.emit("proposal_void", proposal_id=str(proposal.proposal_id))
                return
            member = replace(member, expires_at=ctx.time + ctx.params.credential_ttl_seconds)
            ctx.state.put_member(member)
            ctx.validator_updates.append((member.consensus_key, member.power))
        else:
            current = ctx.committee.get(member.operator)
            if current is None:
                ctx.emit("proposal_void", proposal_id=str(proposal.proposal_id))
                return
            member = current
            ctx.state.delete_member(member.operator)
            ctx.validator_updates.append((member.consensus_key, 0))
        ctx.emit("member_" + ("admitted" if proposal.action == "add" else "removed"),
                 operator=member.operator.hex())
    elif rules.blocking_minority(rules.voting_power(proposal.rejections, ctx.committee), total):
        ctx.state.delete_proposal(proposal.proposal_id)
        ctx.emit("proposal_rejected", proposal_id=str(proposal.proposal_id))
    else:
        ctx.state.put_proposal(proposal)


def _register(ctx: Context, proposal: Proposal) -> None:
    model = replace(Model.from_record(proposal.subject), registered_at=ctx.time)
    if ctx.state.model(model.model_id) is not None:  # registered by an earlier proposal since
        ctx.emit("proposal_void", proposal_id=str(proposal.proposal_id))
        return
    ctx.state.put_model(model)
    ctx.emit("register_model", model_id=model.model_id)


def rotate_member_key(ctx: Context, msg: RotateMemberKey) -> None:
    ctx.require_member()
    message = msg.message(ctx.chain_id, ctx.signer)
    for name, key, signature in msg.signatures():
        if not verify_signature(key, message, signature):
            raise InvalidField(name, "did not sign the rotation (its signature does not verify)")
    pending = ctx.state.member_rotations()
    mine = next((r for r in pending if r.operator == ctx.signer), None)
    if mine is not None:
        raise AlreadyExists(f"signer's keys already rotate at height {mine.height}")
    if msg.new_operator is not None and (
            msg.new_operator in ctx.committee or any(r.new_operator == msg.new_operator for r in pending)):
        raise AlreadyExists("new_operator is already a member's operator key, or about to be")
    if msg.new_operator is not None and ctx.state.get_int(fault_counter_key(msg.new_operator)):
        raise AlreadyExists("new_operator carries a former member's fault record; rotate to a fresh key")
    if msg.consensus_key is not None and (
            rules.consensus_key_used(ctx.committee.values(), msg.consensus_key)
            or any(r.consensus_key == msg.consensus_key for r in pending)):
        raise AlreadyExists("consensus_key is already a member's consensus key, or about to be")
    rotation = MemberRotation(ctx.signer, next_epoch_start(ctx.params, ctx.height), msg.new_operator or b"",
                              msg.consensus_key or b"", msg.vrf_key or b"", msg.x25519_key or b"")
    ctx.state.put_member_rotation(rotation)
    ctx.emit("rotate_member_key", operator=ctx.signer.hex(), height=str(rotation.height))


def _schedule_params(ctx: Context, height: int, changes: dict[str, int]) -> None:
    """Add approved changes to those of their block (a later approval of the same parameter wins)."""
    ctx.state.put_param_changes(height, {**ctx.state.param_changes(height), **changes})
    ctx.emit("params_scheduled", height=str(height), names=",".join(sorted(changes)))


HANDLERS = {ProposeMember: propose_member, ProposeParams: propose_params, ProposeUpgrade: propose_upgrade,
            VoteMember: vote_member, RotateMemberKey: rotate_member_key, RegisterModel: register_model}
