"""A model served by a layer pipeline as a model node's engine: the node coordinates each request through
a chain of its deployment's stages (its own included) with a `PipelineClient`, so everything above the
engine (API, overlay, group, signing) is the same as for a node that holds the model whole.

A pipeline keeps no prefix cache that outlives a request (each request's KV caches live on its chain
and end with it), so it emits no cache events and the group routes to it by load alone. Latencies are
measured live every `REFRESH_S` and the router re-snapshots them (Parallax refreshes every 1-2 s).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from planetserve.node.engine.base import (
    CacheEvent,
    EngineError,
    EngineLoad,
    GenerationRequest,
    TokenChunk,
)
from planetserve.node.overlay.transport import Peering
from planetserve.node.pipeline.coordinator import PipelineClient, PipelineError
from planetserve.node.tasks import stop_tasks

log = logging.getLogger(__name__)

REFRESH_S = 1.5


class PipelineEngine:
    """The Engine protocol over a PipelineClient; `capacity` requests run at once, the rest queue.

    The client is made by `start` over the model node's own `Peering`: stages are group members, and
    one connection per pair of keys carries both the group's messages and the pipeline's steps (a
    second peering would have each side replace the other's connection)."""

    def __init__(self, connect: Callable[[Peering], PipelineClient], model_id: str, *, max_model_len: int,
                 capacity: int, block_size: int = 16, refresh_s: float = REFRESH_S) -> None:
        self._connect = connect
        self.client: PipelineClient | None = None
        self.model_id = model_id
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.capacity = capacity
        self.refresh_s = refresh_s
        self._slots = asyncio.Semaphore(capacity)
        self._running = 0
        self._queued = 0
        self._measuring: asyncio.Task | None = None

    async def start(self, peering: Peering) -> None:
        """Make the client over `peering`; one measurement round before serving (so the first chains use
        what was measured), then the loop."""
        client = self.client = self._connect(peering)
        await client.measure()
        self._measuring = asyncio.create_task(self._measure_loop(client))

    async def _measure_loop(self, client: PipelineClient) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await client.measure()
            except Exception:  # a measurement round must never end serving
                log.exception("pipeline latency measurement failed")

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenChunk]:
        client = self.client
        if client is None:
            raise EngineError("the pipeline is still starting")
        self._queued += 1
        try:
            await self._slots.acquire()
        finally:
            self._queued -= 1
        self._running += 1
        try:
            async for chunk in client.generate(request):
                yield chunk
        except PipelineError as exc:
            raise EngineError(str(exc)) from exc
        finally:
            self._running -= 1
            self._slots.release()

    def load(self) -> EngineLoad:
        return EngineLoad(self._running, self._queued, self.capacity)

    def on_cache_events(self, callback: Callable[[list[CacheEvent]], None]) -> None:
        """Nothing to report: no prefix cache outlives a request."""

    async def close(self) -> None:
        if self._measuring is not None:
            await stop_tasks([self._measuring])
        if self.client is not None and self.client.local is not None:
            self.client.local.close()
