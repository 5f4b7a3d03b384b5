"""Contribution credits (seed planetserve.md 2.2): organisations earn credits for the time their
verified, trusted model nodes serve, at their hardware class's rate, and spend them to have their own
model served. Rates are credits per server-hour, proportional to public-cloud hourly prices; amounts
are kept exactly, in credit-seconds (rate × seconds; 3,600 credit-seconds are one credit), so that
5 servers for 30 days earn precisely what 30 servers for 5 days cost.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from planetserve.registry import rules
from planetserve.registry.allocation import AllocationParams, Gpu, allocate
from planetserve.registry.entities import Model, ModelNode, Record

CREDIT_SECONDS = 3_600

# Credits per server-hour, roughly US cents of public-cloud on-demand prices per accelerator (2025).
# A genesis may set its own table; a hardware class without a price earns nothing and cannot be
# asked for in a deployment.
DEFAULT_PRICES: dict[str, int] = {
    "H200": 1_000,
    "H100": 700,
    "A100": 400,
    "L40S": 190,
    "A10G": 120,
    "L4": 80,
    "T4": 50,
    "cpu": 10,
}


@dataclass(frozen=True)
class Credits(Record):
    """An organisation's account, in credit-seconds."""

    org_id: str
    balance: int
    earned: int
    spent: int


@dataclass(frozen=True)
class Deployment(Record):
    deployment_id: int
    org_id: str
    model_id: str
    hardware: str
    nodes: tuple[bytes, ...]
    created_at: int
    expires_at: int
    cost: int
    stages: tuple = ()
    """For a model no chosen node holds whole: [node, first layer, end layer, pipeline] per stage,
    from Parallax's phase 1 (`registry.allocation`); empty when every node serves the whole model."""

    def stage_of(self, node: bytes) -> tuple[int, int, int] | None:
        """(first layer, end layer, pipeline) the node serves, None when it serves the whole model."""
        return next(((start, end, pipe) for key, start, end, pipe in self.stages if key == node), None)


def earned(rate: int, serving_seconds: int) -> int:
    """Credit-seconds for one node serving `serving_seconds` at `rate` credits per server-hour."""
    return rate * max(serving_seconds, 0)


def cost(rate: int, nodes: int, seconds: int) -> int:
    """Credit-seconds a deployment of `nodes` servers for `seconds` costs."""
    return rate * nodes * seconds


def assign_nodes(deployment_id: int, available: list[bytes], count: int) -> tuple[bytes, ...]:
    """The `count` available nodes with the lowest sha256(deployment id || key): spread over
    organisations and regions by chance, the same on every validator, and not the deployer's pick."""
    return tuple(rules.hash_sample(deployment_id.to_bytes(8, "big"), available, count))


def whole_model_nodes(model: Model, nodes: list[ModelNode]) -> list[ModelNode]:
    """The nodes that hold the model whole: all of them for a model that does not declare its size."""
    if not model.sized:
        return nodes
    return [n for n in nodes if n.memory_mib >= model.layers * model.layer_mib]


def holds_share(model: Model, deployment: Deployment, node: ModelNode) -> bool:
    """Whether the node's declared memory (and compute, for a stage) still holds what the deployment
    assigns it: the whole model, or its stage's layers."""
    stage = deployment.stage_of(node.pubkey)
    if stage is None:
        return bool(whole_model_nodes(model, [node]))
    return node.gflops > 0 and node.memory_mib // model.layer_mib >= stage[1] - stage[0]


def pipeline_stages(model: Model, nodes: list[ModelNode], count: int, t_comp_us: int, rtt_us: int
                    ) -> tuple[tuple[bytes, int, int, int], ...]:
    """Stages for a sized model over nodes that cannot hold it whole: phase 1 over every node that
    declared memory for a layer and its compute, then whole pipelines in the allocation's order while
    their stages fit in `count`. Raises AllocationError when no region can hold the model."""
    gpus = [Gpu(n.pubkey.hex(), n.region, n.memory_mib // model.layer_mib, n.gflops)
            for n in nodes if n.gflops > 0 and n.memory_mib >= model.layer_mib]
    allocation = allocate(gpus, AllocationParams(model.layers, t_comp_us, rtt_us))
    stages: list[tuple[bytes, int, int, int]] = []
    for index, pipeline in enumerate(allocation.pipelines):
        if len(stages) + len(pipeline.stages) > count:
            break
        stages.extend((bytes.fromhex(s.gpu), s.start, s.end, index) for s in pipeline.stages)
    return tuple(stages)


def pipelines(deployments: Iterable[Deployment]) -> dict[bytes, tuple[bytes, ...]]:
    """Each layer pipeline's entry node (the stage holding layer 0) → the nodes of its later stages.
    The entry answers for the pipeline: it is challenged like a single node, and its verdict is the
    whole pipeline's."""
    out: dict[bytes, tuple[bytes, ...]] = {}
    for deployment in deployments:
        by_pipe: dict[int, list[tuple[int, bytes]]] = {}
        for node, start, _end, pipe in deployment.stages:
            by_pipe.setdefault(pipe, []).append((start, node))
        for stages in by_pipe.values():
            ordered = [node for _, node in sorted(stages)]
            out[ordered[0]] = tuple(ordered[1:])
    return out


def format_credits(credit_seconds: int) -> str:
    whole, rest = divmod(credit_seconds, CREDIT_SECONDS)
    return f"{whole}.{rest * 1000 // CREDIT_SECONDS:03d}"
