"""Pipeline stage servers on loopback TLS over one loaded model, and a client of them: the cluster the
pipeline tests run requests through."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from modelfix import DEEP_LAYERS

from planetserve.chain.keys import KeySet
from planetserve.models import LoadedModel
from planetserve.node.overlay.transport import Peering
from planetserve.node.pipeline.chains import ChainRouter, LatencyTable, LayerDag
from planetserve.node.pipeline.coordinator import PipelineClient, StageAddress
from planetserve.node.pipeline.stages import ModelShape, RunningStage, StageModel, serve_stage

LAYERS = DEEP_LAYERS


async def refuse(peer: bytes, msg_type: str, body) -> None:
    raise ValueError("a pipeline client serves no requests")


@dataclass
class Cluster:
    stages: dict[str, RunningStage]
    keys: dict[str, KeySet]
    peering: Peering
    router: ChainRouter
    client: PipelineClient

    def address(self, gpu: str) -> StageAddress:
        return StageAddress(self.keys[gpu].public, f"127.0.0.1:{self.stages[gpu].port}")

    def held(self) -> int:
        return sum(len(s.server.sessions) for s in self.stages.values())

    async def close(self) -> None:
        await self.peering.close()
        for stage in self.stages.values():
            await stage.close()


def chain_router(placement: Mapping[str, tuple[int, int]], layer_ms: Mapping[str, float] | None = None,
                 layers: int = LAYERS) -> ChainRouter:
    table = LatencyTable(default_layer_ms=1.0, default_rtt_ms=1.0, profiled_layer_ms=layer_ms)
    router = ChainRouter(LayerDag(placement, layers), table)
    router.refresh(time.monotonic())
    return router


async def cluster(loaded: LoadedModel, placement: Mapping[str, tuple[int, int]], *,
                  step_timeout: float = 30.0, chunk_tokens: int | None = None,
                  kinds: Mapping[str, type[StageModel]] | None = None, **limits) -> Cluster:
    """Stage servers over one loaded model (each keeps only its layers' modules; a GPU named in `kinds`
    serves its layers through that StageModel subclass) and a client."""
    client_keys = KeySet.generate()
    keys = {gpu: KeySet.generate() for gpu in placement}
    stages = {gpu: await serve_stage(keys[gpu], (kinds or {}).get(gpu, StageModel)(loaded.model, *layers),
                                     lambda key: key == client_keys.public, **limits)
              for gpu, layers in placement.items()}
    allowed = {k.public for k in keys.values()}
    peering = Peering(client_keys, refuse, allowed.__contains__)
    shape = ModelShape.of(loaded.model.config)
    router = chain_router(placement, layers=shape.num_layers)
    addresses = {gpu: StageAddress(keys[gpu].public, f"127.0.0.1:{stages[gpu].port}") for gpu in placement}
    client = PipelineClient(peering, router, addresses, shape, loaded.tokenizer,
                            step_timeout=step_timeout, chunk_tokens=chunk_tokens)
    return Cluster(stages, keys, peering, router, client)
