"""Handlers of the committee family: a proposal to admit or remove a member is applied once more than
2/3 of the voting power approves it, and dropped once more than 1/3 rejects it."""

from __future__ import annotations

from dataclasses import replace

from planetserve.chain.abci.handlers.context import Context
from planetserve.chain.messages.committee import ProposeMember, VoteMember
from planetserve.registry import rules
from planetserve.registry.entities import Member, Proposal
from planetserve.registry.errors import AlreadyExists, Expired, InvalidField, UnknownEntity


def _admitted(ctx: Context, msg: ProposeMember) -> Member:
    member = msg.member()
    if member.operator in ctx.committee:
        raise AlreadyExists("operator key is already a committee member")
    if any(m.consensus_key == member.consensus_key for m in ctx.committee.values()):
        raise AlreadyExists("consensus key is already used by a committee member")
    return member


def _removed(ctx: Context, msg: ProposeMember) -> Member:
    existing = ctx.committee.get(msg.operator)
    if existing is None:
        raise UnknownEntity("operator is not a committee member")
    if len(ctx.committee) == 1:
        raise InvalidField("operator", "cannot remove the last committee member")
    return existing


def propose_member(ctx: Context, msg: ProposeMember) -> None:
    ctx.require_member()
    member = _admitted(ctx, msg) if msg.action == "add" else _removed(ctx, msg)
    proposal = Proposal(
        proposal_id=ctx.state.next_proposal_id(),
        action=msg.action,
        member=member.to_record(),
        proposer=ctx.signer,
        votes=(ctx.signer,),
        rejections=(),
        created_height=ctx.height,
        expires_height=ctx.height + ctx.params.proposal_ttl_blocks,
    )
    ctx.emit("propose_member", proposal_id=str(proposal.proposal_id), action=msg.action)
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


HANDLERS = {ProposeMember: propose_member, VoteMember: vote_member}
