"""Deployments over their life: which nodes may serve one, and expiry (`deploy-model`, in
handlers/credits.py, creates them). A node may serve a deployment while it is active, trusted,
registered for the deployed model on the deployed hardware class, and serves no other one.
"""

from __future__ import annotations

from dataclasses import dataclass

from planetserve.chain import layout
from planetserve.chain.abci.state import State, due
from planetserve.chain.abci.store import Batch
from planetserve.registry import reputation
from planetserve.registry.entities import ModelNode
from planetserve.registry.epochs import Reputation
from planetserve.registry.params import Params


@dataclass(frozen=True)
class Pool:
    """The nodes as deployments see them: trust verdicts read once, assignments read when asked."""

    st: State
    rule: reputation.ReputationRule
    reps: dict[bytes, Reputation]

    @classmethod
    def read(cls, st: State, params: Params) -> Pool:
        records = (Reputation.decode(v) for _, v in st.kv.iterate(layout.REPUTATION_PREFIX))
        return cls(st, reputation.ReputationRule.from_params(params), {r.node: r for r in records})

    def reputation(self, node: bytes) -> int:
        return self.reps[node].value if node in self.reps else self.rule.initial

    def trusted(self, node: bytes) -> bool:
        return self.reps[node].trusted if node in self.reps else reputation.never_scored_trusted(self.rule)

    def unfit(self, node: ModelNode | None, model_id: str, hardware: str) -> str:
        """Why the node cannot serve a deployment of the model on the class ('' when it can)."""
        if node is None or node.status != "active":
            return "inactive"
        if not self.trusted(node.pubkey):
            return "untrusted"
        if node.model_id != model_id:
            return "other-model"
        return "other-hardware" if node.hardware != hardware else ""

    def available(self, model_id: str, hardware: str) -> list[ModelNode]:
        """The nodes that could serve a deployment of the model on the class and serve none, in key
        order."""
        assigned = {k for k, _ in self.st.kv.iterate(layout.ASSIGNED_PREFIX)}
        return [n for n in self.st.iterate_nodes()
                if layout.assigned_key(n.pubkey) not in assigned and not self.unfit(n, model_id, hardware)]


def expire(batch: Batch, now: int) -> None:
    """Remove every deployment whose time ran out at or before this block's time."""
    st = State(batch)
    for ident in due(batch, layout.DEPLOYMENT_EXPIRY_PREFIX, now):
        deployment = st.deployment(int(ident))
        if deployment is not None:
            st.delete_deployment(deployment)
