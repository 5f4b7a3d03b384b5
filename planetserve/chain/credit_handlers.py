"""Spending contribution credits: `deploy-model` and the expiry of deployments (earning happens when
an epoch is finalized, in chain/epochs.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from planetserve.chain import state as layout
from planetserve.chain.handlers import Context, owned_org
from planetserve.chain.state import State
from planetserve.chain.store import Batch
from planetserve.registry import credits, fields, reputation
from planetserve.registry.credits import Deployment
from planetserve.registry.epochs import Reputation
from planetserve.registry.errors import (
    InsufficientCredits,
    InvalidField,
    LowReputation,
    Unavailable,
    UnknownEntity,
)
from planetserve.registry.params import PPM


def _reputations(ctx: Context) -> dict[bytes, Reputation]:
    records = (Reputation.decode(v) for _, v in ctx.state.kv.iterate(layout.REPUTATION_PREFIX))
    return {r.node: r for r in records}


def _organisation_reputation(ctx: Context, org_id: str, rule: reputation.ReputationRule,
                             reps: dict[bytes, Reputation]) -> int:
    return reputation.organisation_reputation(
        reps[n.pubkey].value if n.pubkey in reps else rule.initial
        for n in ctx.state.iterate_nodes() if n.org_id == org_id)


def _available(ctx: Context, hardware: str, rule: reputation.ReputationRule,
               reps: dict[bytes, Reputation]) -> list[bytes]:
    """Active, trusted nodes of the class that serve no other deployment."""
    assigned = {k for k, _ in ctx.state.kv.iterate(layout.ASSIGNED_PREFIX)}
    fresh = reputation.never_scored_trusted(rule)
    return [n.pubkey for n in ctx.state.iterate_nodes()
            if n.hardware == hardware and n.status == "active"
            and layout.assigned_key(n.pubkey) not in assigned
            and (reps[n.pubkey].trusted if n.pubkey in reps else fresh)]


def deploy_model(ctx: Context, body: dict[str, Any]) -> None:
    """An organisation spends credits to have its model served by `nodes` servers of a hardware
    class for `seconds`; the chain picks the servers."""
    fields.check_keys(body, {"org_id", "model_id", "hardware", "nodes", "seconds"})
    org_id = fields.ident(body, "org_id")
    model_id = fields.ident(body, "model_id")
    hardware = fields.hardware(body)
    count = fields.integer(body, "nodes", 1, ctx.params.max_deployment_nodes)
    seconds = fields.integer(body, "seconds", 60, ctx.params.max_deployment_seconds)
    owned_org(ctx, org_id)
    if ctx.state.model(model_id) is None:
        raise UnknownEntity(f"model {model_id!r} is not registered")
    rate = ctx.state.price(hardware)
    if rate == 0:
        raise InvalidField("hardware", f"hardware class {hardware!r} has no price in this chain's genesis")
    rule = reputation.ReputationRule.from_params(ctx.params)
    reps = _reputations(ctx)
    org_rep = _organisation_reputation(ctx, org_id, rule, reps)
    if not reputation.is_trusted(rule, org_rep):
        raise LowReputation(f"organisation {org_id!r} has reputation {org_rep / PPM:.6f}, below the "
                            f"{rule.untrusted / PPM:.6f} needed to deploy (it must contribute trusted nodes)")
    price = credits.cost(rate, count, seconds)
    account = ctx.state.credits(org_id)
    if account.balance < price:
        raise InsufficientCredits(f"deployment costs {credits.format_credits(price)} credits, organisation "
                                  f"{org_id!r} has {credits.format_credits(account.balance)}")
    available = _available(ctx, hardware, rule, reps)
    if len(available) < count:
        raise Unavailable(f"asks for {count} {hardware} node(s); {len(available)} trusted, unassigned "
                          f"ones exist")
    deployment_id = ctx.state.next_deployment_id()
    chosen = credits.assign_nodes(deployment_id, available, count)
    ctx.state.put_deployment(
        Deployment(deployment_id, org_id, model_id, hardware, chosen, ctx.time, ctx.time + seconds, price))
    ctx.state.put_credits(replace(account, balance=account.balance - price, spent=account.spent + price))
    ctx.emit("deploy_model", deployment_id=str(deployment_id), org_id=org_id, model_id=model_id)


def expire_deployments(batch: Batch, now: int) -> None:
    """Remove every deployment whose time ran out at or before this block's time."""
    st = State(batch)
    for ident in layout.due(batch, layout.DEPLOYMENT_EXPIRY_PREFIX, now):
        deployment = st.deployment(int(ident))
        if deployment is not None:
            st.delete_deployment(deployment)


CREDIT_HANDLERS = {"deploy-model": deploy_model}
