"""Deployments over their life: which nodes may serve one, healing when an assigned node stops
qualifying, and expiry (`deploy-model`, in handlers/credits.py, creates them).

A node qualifies for its share of a deployment while it is active, trusted, registered for the
deployed model on the deployed hardware class, and declares the memory (and, for a stage, the
compute) its share needs. Healing happens at two deterministic points: in the transaction that
changes an assigned node's registration (`update-model-node`), and in an epoch's last block after
finalization (where trust changes), for every live deployment in id order. A whole-model deployment
replaces each node that left by an available node of the model (the lowest sha256(id ‖ key), as
deploy-model picks), or shrinks; a layer pipeline deployment re-runs Parallax phase 1 over its
remaining stage nodes and the standby ones within the servers paid for. The organisation gets back
rate × servers released × seconds left; a deployment left without servers ends.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from planetserve.chain import layout
from planetserve.chain.abci.state import State, due
from planetserve.chain.abci.store import Batch
from planetserve.registry import credits, reputation
from planetserve.registry.allocation import AllocationError
from planetserve.registry.credits import Deployment
from planetserve.registry.entities import Model, ModelNode
from planetserve.registry.epochs import Reputation, Schedule
from planetserve.registry.params import Params

Event = tuple[str, dict[str, str]]


@dataclass(frozen=True)
class Pool:
    """The nodes as deployments see them: trust verdicts read once, assignments read when asked."""

    st: State
    params: Params
    rule: reputation.ReputationRule
    reps: dict[bytes, Reputation]

    @classmethod
    def read(cls, st: State, params: Params) -> Pool:
        records = (Reputation.decode(v) for _, v in st.kv.iterate(layout.REPUTATION_PREFIX))
        return cls(st, params, reputation.ReputationRule.from_params(params), {r.node: r for r in records})

    def unfit(self, node: ModelNode | None, model_id: str, hardware: str) -> str:
        """Why the node cannot serve a deployment of the model on the class ('' when it can): it must
        be listed (active, trusted and past probation) and serve the model on the class."""
        if node is None or node.status != "active":
            return "inactive"
        rep = self.reps.get(node.pubkey)  # every registered node has one
        if rep is None or not rep.trusted:
            return "untrusted"
        if not rep.listable:
            return "on-probation"
        if node.model_id != model_id:
            return "other-model"
        return "other-hardware" if node.hardware != hardware else ""

    def available(self, model_id: str, hardware: str) -> list[ModelNode]:
        """The nodes that could serve a deployment of the model on the class and serve none, in key
        order."""
        assigned = {k for k, _ in self.st.kv.iterate(layout.ASSIGNED_PREFIX)}
        return [n for n in self.st.iterate_nodes()
                if layout.assigned_key(n.pubkey) not in assigned and not self.unfit(n, model_id, hardware)]


def _left(pool: Pool, model: Model, deployment: Deployment) -> dict[bytes, str]:
    """The deployment's nodes that no longer qualify for their share, with why."""
    out = {}
    for key in deployment.nodes:
        node = pool.st.node(key)
        why = pool.unfit(node, deployment.model_id, deployment.hardware)
        if not why and not credits.holds_share(model, deployment, node):
            why = "too-small"
        if why:
            out[key] = why
    return out


def _replace(pool: Pool, model: Model, deployment: Deployment, left: dict[bytes, str]
             ) -> tuple[tuple[bytes, ...], tuple]:
    """The nodes (and stages) that serve the deployment once `left` are gone: whole-model nodes are
    replaced one for one from the available ones; pipelines are planned again (phase 1) over the
    remaining stage nodes and the standby ones, within the servers paid for."""
    standby = pool.available(deployment.model_id, deployment.hardware)
    if not deployment.stages:
        kept = [k for k in deployment.nodes if k not in left]
        fresh = credits.assign_nodes(deployment.deployment_id,
                                     [n.pubkey for n in credits.whole_model_nodes(model, standby)], len(left))
        return tuple(sorted((*kept, *fresh))), ()
    remaining = [pool.st.node(k) for k in deployment.nodes if k not in left]
    try:
        stages = credits.pipeline_stages(model, [*remaining, *standby], len(deployment.nodes),
                                         pool.params.pipeline_compute_us, pool.params.pipeline_hop_us)
    except AllocationError:  # no region holds the model's layers any more
        stages = ()
    return tuple(sorted(stage[0] for stage in stages)), stages


def heal(pool: Pool, time: int, deployment: Deployment) -> list[Event]:
    """Re-assign the share of every node of the deployment that no longer qualifies; refund what the
    deployment no longer serves (rate × servers released × seconds left), and end it when no server
    is left."""
    model = pool.st.model(deployment.model_id)
    assert model is not None, "models are never removed"
    left = _left(pool, model, deployment)
    if not left:
        return []
    nodes, stages = _replace(pool, model, deployment, left)
    refund = credits.cost(pool.st.price(deployment.hardware), len(deployment.nodes) - len(nodes),
                          deployment.expires_at - time)
    account = pool.st.credits(deployment.org_id)
    pool.st.put_credits(replace(account, balance=account.balance + refund, spent=account.spent - refund))
    pool.st.delete_deployment(deployment)
    if nodes:
        pool.st.put_deployment(replace(deployment, nodes=nodes, stages=stages, cost=deployment.cost - refund))
    ordered = sorted(left)
    return [("deployment_healed" if nodes else "deployment_ended", {
        "deployment_id": str(deployment.deployment_id),
        "left": ",".join(k.hex() for k in ordered),
        "reasons": ",".join(left[k] for k in ordered),
        "joined": ",".join(k.hex() for k in nodes if k not in deployment.nodes),
        "nodes": str(len(nodes)),
        "stages": str(len(stages)),
        "refund": str(refund),
    })]


def heal_node(st: State, params: Params, time: int, node: bytes) -> list[Event]:
    """Heal the deployment of a node whose registration just changed, if it serves one."""
    deployment = st.deployment_of(node)
    return [] if deployment is None else heal(Pool.read(st, params), time, deployment)


def heal_at_epoch_end(batch: Batch, params: Params, height: int, time: int) -> list[Event]:
    """In an epoch's last block, after finalization (where trust changes): heal every live deployment,
    in id order, each seeing the assignments the ones before it made."""
    schedule = Schedule.from_params(params)
    if height != schedule.end(schedule.epoch_of(height)):
        return []
    st = State(batch)
    live = list(st.iterate_deployments())
    batch.prefetch([layout.node_key(node) for deployment in live for node in deployment.nodes])
    pool = Pool.read(st, params)
    return [event for deployment in live for event in heal(pool, time, deployment)]


def expire(batch: Batch, now: int) -> None:
    """Remove every deployment whose time ran out at or before this block's time."""
    st = State(batch)
    for ident in due(batch, layout.DEPLOYMENT_EXPIRY_PREFIX, now):
        deployment = st.deployment(int(ident))
        if deployment is not None:
            st.delete_deployment(deployment)
