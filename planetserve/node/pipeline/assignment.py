"""A model node that cannot hold its model whole serves it as a stage of a layer pipeline (Parallax):
the ledger's deployment assigns it a contiguous layer range (phase 1, computed by every validator);
the node loads only those layers, serves steps of them to the deployment's other stages, and
coordinates its own requests through chains of the deployment's stages (phase 2) as its engine.

Every stage is a coordinator, not only the one holding layer 0: any of them may be in a user's signed
node list, and each answers requests the way a node holding the whole model does. The verifier
challenges the pipeline through its entry (the stage holding layer 0), and the ledger extends that
verdict to the later stages.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from planetserve.chain.client import TRANSIENT, LedgerClient
from planetserve.chain.keys import KeySet
from planetserve.node.engine.base import Tokenizer
from planetserve.node.home import ModelNodeConfig
from planetserve.node.overlay.transport import Handler, Peering
from planetserve.registry.credits import Deployment
from planetserve.registry.entities import Model

log = logging.getLogger(__name__)

DEFAULT_LAYER_MS = 1.0
DEFAULT_RTT_MS = 1.0
"""What the chain router assumes of a stage before its first measurement (a loopback-scale guess; the
first measurement round runs before the node serves)."""


class AssignmentError(RuntimeError):
    """The ledger's assignment cannot be served by this node (another model, missing stages)."""


def needs_pipeline(model: Model | None, config: ModelNodeConfig) -> bool:
    """Whether the node declares less memory than its sized model needs, so it serves as a stage."""
    return (model is not None and model.sized and config.memory_mib > 0 and not config.engine_url
            and config.memory_mib < model.layers * model.layer_mib)


async def wait_for_assignment(ledger: LedgerClient, keys: KeySet, config: ModelNodeConfig) -> Deployment:
    """The deployment that assigns this node layers, once the ledger has one (polled every
    `list_interval`)."""
    said = False
    while True:
        try:
            deployment = await asyncio.to_thread(ledger.deployment_of, keys.public)
        except TRANSIENT as exc:
            log.warning("could not read this node's assignment, retrying: %s", exc)
            deployment = None
        if deployment is not None and deployment.stage_of(keys.public) is not None:
            if deployment.model_id != config.model_id:
                raise AssignmentError(f"deployment {deployment.deployment_id} assigns this node layers of "
                                      f"model {deployment.model_id!r}; it serves {config.model_id!r}")
            return deployment
        if not said:
            log.info("waiting for a deployment of %s to assign this node layers (%d MiB declared)",
                     config.model_id, config.memory_mib)
            said = True
        await asyncio.sleep(config.list_interval)


async def assignment_ended(ledger: LedgerClient, keys: KeySet, deployment: Deployment,
                           interval: float) -> None:
    """Returns once the ledger no longer assigns this node the same layers of `deployment` (it expired,
    or the node serves another one); a failed read counts as no change."""
    while True:
        await asyncio.sleep(interval)
        try:
            current = await asyncio.to_thread(ledger.deployment_of, keys.public)
        except TRANSIENT as exc:  # keep serving what was assigned
            log.debug("assignment check failed: %s", exc)
            continue
        if current is None or current.deployment_id != deployment.deployment_id \
                or current.stages != deployment.stages:
            return


@dataclass(frozen=True)
class StageRole:
    """A node that is also a stage of its deployment's layer pipeline: the other stages (each a
    coordinator of its own requests) may run steps of `msg_type` on it through `handler`."""

    layers: tuple[int, int, int]
    """(first layer, end layer, pipeline) as the ledger assigned them."""
    msg_type: str
    peers: frozenset[bytes]
    handler: Handler


@dataclass
class PipelineStage:
    """What `pipeline_engine` built: the engine, the node's stage role, and what the API needs."""

    engine: Any
    role: StageRole
    tokenizer: Tokenizer
    vocab_size: int
    stop_ids: tuple[int, ...]


def pipeline_engine(config: ModelNodeConfig, keys: KeySet, deployment: Deployment, model: Model,
                    addresses: dict[bytes, str]) -> PipelineStage:
    """Load this node's layers and build its coordinator over the deployment's stages (blocking: it
    loads weights). `addresses` holds every other stage's registered peer address."""
    from planetserve.models import load
    from planetserve.node.pipeline.chains import ChainRouter, LatencyTable, LayerDag
    from planetserve.node.pipeline.coordinator import PipelineClient, StageAddress
    from planetserve.node.pipeline.engine import PipelineEngine
    from planetserve.node.pipeline.stages import STAGE_MSG, StageModel, StageServer

    own = keys.public
    layers = deployment.stage_of(own)
    if layers is None:
        raise AssignmentError(f"deployment {deployment.deployment_id} assigns this node no layers")
    others = {key for key, *_ in deployment.stages if key != own}
    missing = sorted(key.hex()[:16] for key in others if key not in addresses)
    if missing:
        raise AssignmentError(f"stages {missing} of deployment {deployment.deployment_id} are not registered")
    loaded = load(config.model, data_dir=config.data_dir or None)
    found = loaded.model.config.num_hidden_layers
    if found != model.layers:
        raise AssignmentError(f"{config.model} has {found} layers; the ledger registers "
                              f"{model.model_id!r} with {model.layers}")
    stage = StageModel(loaded.model, layers[0], layers[1])
    server = StageServer(stage)
    placement = {key.hex(): (start, end) for key, start, end, _ in deployment.stages}
    router = ChainRouter(LayerDag(placement, model.layers),
                         LatencyTable(default_layer_ms=DEFAULT_LAYER_MS, default_rtt_ms=DEFAULT_RTT_MS))
    stages = {key.hex(): StageAddress(key, addresses[key]) for key in others}
    tokenizer = loaded.tokenizer

    def connect(peering: Peering) -> PipelineClient:
        return PipelineClient(peering, router, stages, stage.shape, tokenizer, local=(own.hex(), server))

    engine = PipelineEngine(connect, config.model_id, max_model_len=stage.shape.max_positions,
                            capacity=config.capacity, block_size=config.block_size)
    role = StageRole(layers, STAGE_MSG, frozenset(others), server.handle)
    return PipelineStage(engine, role, tokenizer, stage.shape.vocab_size, loaded.stop_token_ids)
