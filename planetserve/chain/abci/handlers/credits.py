"""Spending contribution credits: `deploy-model` (earning happens when an epoch is finalized, in
chain/abci/epochs.py; healing and expiry of deployments in chain/abci/deployments.py)."""

from __future__ import annotations

from dataclasses import replace

from planetserve.chain.abci.deployments import Pool
from planetserve.chain.abci.handlers.context import Context
from planetserve.chain.messages.credits import DeployModel
from planetserve.registry import credits, fields, reputation
from planetserve.registry.allocation import AllocationError
from planetserve.registry.credits import Credits, Deployment
from planetserve.registry.entities import Model, ModelNode
from planetserve.registry.errors import (
    InsufficientCredits,
    InvalidField,
    LowReputation,
    Unavailable,
    UnknownEntity,
)
from planetserve.registry.params import PPM


def _pipeline(ctx: Context, model: Model, available: list[ModelNode], count: int) -> tuple:
    """Stages of a sized model that no available node holds whole (Parallax phase 1)."""
    try:
        stages = credits.pipeline_stages(model, available, count, ctx.params.pipeline_compute_us,
                                         ctx.params.pipeline_hop_us)
    except AllocationError as exc:
        raise Unavailable(f"no node holds model {model.model_id!r} whole and no pipeline can be "
                          f"formed: {exc}") from exc
    if not stages:
        raise Unavailable(f"no pipeline of model {model.model_id!r} fits in {count} node(s); ask for more")
    return stages


def _afford(account: Credits, price: int) -> None:
    if account.balance < price:
        raise InsufficientCredits(f"deployment costs {credits.format_credits(price)} credits, organisation "
                                  f"{account.org_id!r} has {credits.format_credits(account.balance)}")


def deploy_model(ctx: Context, msg: DeployModel) -> None:
    """The chain picks the servers among the available nodes registered for the model: `nodes` of those
    that hold it whole or, for a model that declares its size and that none of them holds whole,
    layer pipelines (Parallax phase 1) of at most `nodes` servers. It refuses what it cannot deliver
    rather than assign nodes that serve another model."""
    org_id, model_id, hardware = msg.org_id, msg.model_id, msg.hardware
    count = fields.within("nodes", msg.nodes, 1, ctx.params.max_deployment_nodes)
    seconds = fields.within("seconds", msg.seconds, ctx.params.min_deployment_seconds,
                            ctx.params.max_deployment_seconds)
    ctx.owned_org(org_id)
    model = ctx.state.model(model_id)
    if model is None:
        raise UnknownEntity(f"model {model_id!r} is not registered")
    rate = ctx.state.price(hardware)
    if rate == 0:
        raise InvalidField("hardware", f"hardware class {hardware!r} has no price in this chain's genesis")
    rule = reputation.ReputationRule.from_params(ctx.params)
    floor = ctx.state.org_reputation(org_id)
    org_rep = reputation.organisation_reputation(() if floor is None else (floor,))
    if not reputation.is_trusted(rule, org_rep):
        raise LowReputation(f"organisation {org_id!r} has reputation {org_rep / PPM:.6f}, below the "
                            f"{rule.untrusted / PPM:.6f} needed to deploy "
                            f"(it must contribute trusted nodes)")
    account = ctx.state.credits(org_id)
    # the least any deployment of this length costs, before every node is read: CheckTx refused without
    # counting against the signer, so an organisation without credits read them all at no cost
    _afford(account, credits.cost(rate, 1, seconds))
    pool = Pool.read(ctx.state, ctx.params)
    available = pool.available(model_id, hardware)
    if not available:
        raise Unavailable(f"no listed, unassigned {hardware} node is registered for model {model_id!r}; "
                          f"only nodes that serve a model are assigned its deployments")
    whole = credits.whole_model_nodes(model, available)
    deployment_id = ctx.state.next_deployment_id()
    stages: tuple = ()
    if whole or not model.sized:
        _afford(account, credits.cost(rate, count, seconds))
        if len(whole) < count:
            raise Unavailable(f"asks for {count} {hardware} node(s) holding model {model_id!r}; "
                              f"{len(whole)} listed, unassigned ones serve it")
        chosen = credits.assign_nodes(deployment_id, [n.pubkey for n in whole], count)
    else:
        stages = _pipeline(ctx, model, available, count)
        chosen = tuple(sorted(stage[0] for stage in stages))
        _afford(account, credits.cost(rate, len(chosen), seconds))
    price = credits.cost(rate, len(chosen), seconds)
    ctx.state.put_deployment(Deployment(deployment_id, org_id, model_id, hardware, chosen, ctx.time,
                                        ctx.time + seconds, price, stages))
    ctx.state.put_credits(replace(account, balance=account.balance - price, spent=account.spent + price))
    ctx.emit("deploy_model", deployment_id=str(deployment_id), org_id=org_id, model_id=model_id,
             stages=str(len(stages)))


HANDLERS = {DeployModel: deploy_model}
