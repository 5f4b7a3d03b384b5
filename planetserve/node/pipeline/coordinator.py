"""The coordinator side of pipeline execution: one request's tokens through a chain of stage servers.

A request is fed to its chain's first stage as token ids; each stage's hidden states go to the next, and
the last stage's logits pick the next token (greedy, or sampled at a temperature as the built-in engine
samples). A prompt longer than one frame holds is prefilled in chunks. Each attempt at a request has
fresh request ids at its stages, so their caches start empty.

Local stage. The coordinator may hold a layer range itself (a model node that is also a stage): steps for
it go straight to its `StageServer`, with the same checks as over the wire and no round trip.

Live latencies. The coordinator sends each hop its step and gets the output back, so a hop from g to g'
costs the round trip to g' and a stage's time is what it computes. `measure` pings every remote stage
(feeding RTT(coordinator, g), and RTT(g, g') as the two round trips' sum: the hidden states go
g -> coordinator -> g'), and every one-token step of a hop feeds its per-layer time (the call's time
less the smoothed round trip, over its layers); then the router takes a new snapshot. A lost stage that
answers pings again is readmitted.

Failure. A stage whose connection fails, that does not answer within `step_timeout`, or whose reply is
malformed is lost: the client excludes it in the `ChainRouter`, picks a new chain for the request, and
recomputes the prompt and the tokens generated so far there; generation then carries on where it was
(greedy output is exactly what one chain would have produced). A stage that refuses a step with a
reason is not lost: the request was bad and any chain would refuse it, so that ends the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from planetserve.node.engine.base import GenerationRequest, TokenChunk, Tokenizer
from planetserve.node.engine.builtin import request_problem, token_logprob
from planetserve.node.overlay.transport import Peering, RemoteError, TransportError
from planetserve.node.pipeline.chains import Chain, ChainRouter, Hop, NoChainError
from planetserve.node.pipeline.stages import (
    STAGE_MSG,
    ModelShape,
    StageError,
    StageServer,
    decode_tensor,
    max_step_tokens,
)
from planetserve.sampling import sample

log = logging.getLogger(__name__)

STEP_TIMEOUT_S = 30.0
"""A stage that takes longer than this for one step of one request counts as lost."""
PING_TIMEOUT_S = 5.0
COORDINATOR = "coordinator"
"""The latency table's name for the coordinator when it holds no stage of its own."""


class PipelineError(Exception):
    """The request cannot complete: no chain avoids the lost stages, or a stage refused it."""


class _StageLost(Exception):
    def __init__(self, gpu: str, reason: str) -> None:
        super().__init__(f"stage {gpu} lost: {reason}")
        self.gpu = gpu


@dataclass(frozen=True)
class StageAddress:
    """How to reach a stage server: its registered key (pinned by TLS) and host:port."""

    key: bytes
    address: str


@dataclass(frozen=True)
class Completion:
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    """"stop" (a stop id was produced) or "length" (max_tokens reached)."""
    chains: tuple[Chain, ...]
    """Every chain the request ran on, in order: more than one after a stage was lost."""


@dataclass
class _Attempt:
    """The request on one chain: a fresh id at each hop, and the positions its stages hold."""

    chain: Chain
    ids: tuple[bytes, ...] = field(init=False)
    length: int = 0

    def __post_init__(self) -> None:
        # one id per hop: a chain may come back to a stage it left, with another layer range
        self.ids = tuple(secrets.token_bytes(16) for _ in self.chain.hops)


@dataclass
class _Route:
    """One request: its name at the router, its attempt on the current chain, the chains it used."""

    name: str
    chains: list[Chain] | None = None
    attempt: _Attempt | None = None


def sampler(temperature: float, seed: int | None, top_p: float = 1.0) -> Callable[[np.ndarray, int], int]:
    """The built-in engine's draw (planetserve.sampling) from one position's logits and the position:
    greedy at temperature 0, else the protocol's Gumbel-max under `seed` or a fresh one, over the
    nucleus of `top_p`."""
    key = secrets.randbits(64) if seed is None else seed
    return lambda logits, position: sample(torch.from_numpy(logits), temperature, key, position, top_p)


class PipelineClient:
    """Runs requests through chains of stage servers that `router` picks over its placement; `stages`
    names every GPU of the placement's server but the one in `local` (this process's own stage, named by
    its GPU). `peering` must accept the stages' keys."""

    def __init__(self, peering: Peering, router: ChainRouter, stages: Mapping[str, StageAddress],
                 shape: ModelShape, tokenizer: Tokenizer, *, local: tuple[str, StageServer] | None = None,
                 chunk_tokens: int | None = None, step_timeout: float = STEP_TIMEOUT_S) -> None:
        self.here, self.local = local if local is not None else (COORDINATOR, None)
        missing = sorted(set(router.dag.gpus) - stages.keys() - {self.here})
        if missing:
            raise ValueError(f"no address for the placement's stages {missing}")
        if router.dag.num_layers != shape.num_layers:
            raise ValueError(f"the placement has {router.dag.num_layers} layers, "
                             f"the model {shape.num_layers}")
        self.peering, self.router, self.stages = peering, router, dict(stages)
        self.shape, self.tokenizer = shape, tokenizer
        most = max_step_tokens(shape.hidden_size, peering.limit)
        self.chunk = min(chunk_tokens, most) if chunk_tokens else most
        self.step_timeout = step_timeout

    async def complete(self, prompt: str | Sequence[int], max_tokens: int, *, temperature: float = 0.0,
                       seed: int | None = None, stop_ids: Sequence[int] = (), top_p: float = 1.0
                       ) -> Completion:
        """Generate up to `max_tokens` after a prompt (text, tokenised with special tokens as a completion
        prompt is, or token ids), stopping early at any of `stop_ids`."""
        ids = self.tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else list(prompt)
        request = GenerationRequest(tuple(ids), max_tokens, temperature, seed, tuple(stop_ids), top_p=top_p)
        chains: list[Chain] = []
        tokens, finish = [], ""
        async for chunk in self.generate(request, chains):
            tokens.extend(chunk.token_ids)
            finish = chunk.finish_reason or finish
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return Completion(tuple(tokens), text, finish, tuple(chains))

    async def generate(self, request: GenerationRequest,
                       chains: list[Chain] | None = None) -> AsyncIterator[TokenChunk]:
        """Stream a generation as the engines do, one token a chunk (with its log-probability under the
        raw logits, as the built-in engine's, when the request asks); `chains` collects the chains used."""
        self._check(request)
        route, pick = _Route(secrets.token_hex(8), chains), sampler(request.temperature, request.seed,
                                                                            request.top_p)
        tokens, stop = list(request.prompt_ids), frozenset(request.stop_ids)
        try:
            for produced in range(1, request.max_tokens + 1):
                logits = await self._logits_after(route, tokens)
                token = pick(logits, produced - 1)
                tokens.append(token)
                finish = "stop" if token in stop else "length" if produced == request.max_tokens else None
                scored = None if request.logprobs is None else (
                    token_logprob(torch.from_numpy(logits).float().log_softmax(-1), token, request.logprobs),)
                yield TokenChunk((token,), finish, len(request.prompt_ids) if produced == 1 else 0,
                                 logprobs=scored)
                if finish is not None:
                    return
        finally:
            await self._finish(route)

    async def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """The next-token logits after `token_ids` (one prefill on a chain of its own)."""
        self._check(GenerationRequest(tuple(token_ids), 1))
        route = _Route(secrets.token_hex(8))
        try:
            return await self._logits_after(route, list(token_ids))
        finally:
            await self._finish(route)

    def _check(self, request: GenerationRequest) -> None:
        if (problem := request_problem(request, self.shape.vocab_size, self.shape.max_positions)) is not None:
            raise PipelineError(problem)

    async def _logits_after(self, route: _Route, tokens: list[int]) -> np.ndarray:
        """The logits after `tokens`, feeding the chain only what it has not seen; a lost stage is
        excluded and the request moves to a new chain, which starts from the first token."""
        while True:
            if route.attempt is None:
                try:
                    route.attempt = _Attempt(self.router.reroute(route.name))
                except NoChainError as exc:
                    raise PipelineError(f"no chain left for the request: {exc}") from exc
                if route.chains is not None:
                    route.chains.append(route.attempt.chain)
            attempt = route.attempt
            try:
                while attempt.length < len(tokens):
                    logits = await self._step(attempt, tokens[attempt.length:attempt.length + self.chunk])
                return logits
            except _StageLost as lost:
                log.warning("request %s: %s; moving it to another chain", route.name, lost)
                self.router.exclude(lost.gpu)
                await self._end(attempt)
                route.attempt = None

    async def measure(self) -> None:
        """One round of live measurements (see the module docstring), then a new router snapshot."""
        remote = sorted(g for g in self.router.dag.gpus if g != self.here)
        rtts = await asyncio.gather(*(self._ping(g) for g in remote))
        now, table = time.monotonic(), self.router.table
        for gpu, rtt in zip(remote, rtts, strict=True):
            if rtt is not None:
                table.observe_rtt(self.here, gpu, rtt, now)
                self.router.readmit(gpu)
        for a, b in itertools.combinations(remote, 2):
            if table.fresh_rtt(self.here, a, now) and table.fresh_rtt(self.here, b, now):
                via_here = table.rtt_ms(self.here, a, now) + table.rtt_ms(self.here, b, now)
                table.observe_rtt(a, b, via_here, now)
        self.router.refresh(now)

    async def _ping(self, gpu: str) -> float | None:
        """The round trip to a remote stage in ms, None when it does not answer."""
        stage = self.stages[gpu]
        try:
            start = time.perf_counter()
            conn = await asyncio.wait_for(self.peering.connect(stage.key, stage.address), PING_TIMEOUT_S)
            reply = await asyncio.wait_for(conn.call(STAGE_MSG, {"op": "ping"}), PING_TIMEOUT_S)
        except (TransportError, RemoteError, TimeoutError, ConnectionError, OSError):
            return None
        return (time.perf_counter() - start) * 1000 if reply == {"pong": True} else None

    async def _step(self, attempt: _Attempt, tokens: list[int]) -> np.ndarray:
        """The next positions through every hop; the last hop's logits. A one-token step times each
        hop for the latency table."""
        value: Any = tokens
        for hop, request_id in zip(attempt.chain.hops, attempt.ids, strict=True):
            body = {"op": "start" if attempt.length == 0 else "continue", "id": request_id,
                    "layers": [hop.start, hop.end], "pos": attempt.length,
                    "tokens" if hop.start == 0 else "hidden": value}
            start = time.perf_counter()
            reply = await self._call(hop, body)
            if len(tokens) == 1:
                self._observe(hop, (time.perf_counter() - start) * 1000)
            value, output = self._output(hop, reply, len(tokens))
        attempt.length += len(tokens)
        return output[0]

    def _observe(self, hop: Hop, ms: float) -> None:
        now, table = time.monotonic(), self.router.table
        link = 0.0 if hop.gpu == self.here else table.rtt_ms(self.here, hop.gpu, now)
        table.observe_layer(hop.gpu, max(ms - link, 0.0) / (hop.end - hop.start), now)

    def _output(self, hop: Hop, reply: Any, rows: int) -> tuple[Any, np.ndarray]:
        """The hop's output as it came (passed on to the next hop) and decoded, once checked."""
        if hop.end == self.shape.num_layers:
            name, width, rows = "logits", self.shape.vocab_size, 1
        else:
            name, width = "hidden", self.shape.hidden_size
        try:
            if not (isinstance(reply, dict) and set(reply) == {name}):
                raise StageError(f"expected a reply with {name} only")
            output = decode_tensor(reply[name], name, width, rows)
            if len(output) != rows:
                raise StageError(f"expected {rows} rows of {name}, got {len(output)}")
        except StageError as exc:
            raise _StageLost(hop.gpu, f"malformed reply: {exc}") from exc
        return reply[name], output

    async def _call(self, hop: Hop, body: dict[str, Any]) -> Any:
        if hop.gpu == self.here and self.local is not None:
            try:
                return await self.local.handle(self.peering.keys.public, STAGE_MSG, body)
            except StageError as exc:
                raise PipelineError(f"this node's stage refused layers [{hop.start}, {hop.end}): "
                                    f"{exc}") from exc
        stage = self.stages[hop.gpu]
        conn = None
        try:
            conn = await self.peering.connect(stage.key, stage.address)
            return await asyncio.wait_for(conn.call(STAGE_MSG, body), self.step_timeout)
        except RemoteError as exc:
            if conn is not None and conn.closed.is_set():  # the transport fails a closed connection's
                raise _StageLost(hop.gpu, str(exc)) from exc  # open streams with a RemoteError
            raise PipelineError(f"stage {hop.gpu} refused layers [{hop.start}, {hop.end}): {exc}") from exc
        except (TransportError, TimeoutError) as exc:
            raise _StageLost(hop.gpu, str(exc) or f"no answer within {self.step_timeout:g} s") from exc

    async def _finish(self, route: _Route) -> None:
        if route.attempt is not None:
            await self._end(route.attempt)
        self.router.release(route.name)

    async def _end(self, attempt: _Attempt) -> None:
        """Free the attempt's caches at the stages still connected, one-way (the others expire them)."""
        for hop, request_id in zip(attempt.chain.hops, attempt.ids, strict=True):
            if hop.gpu == self.here and self.local is not None:
                await self.local.handle(self.peering.keys.public, STAGE_MSG, {"op": "end", "id": request_id})
                continue
            conn = self.peering.connections.get(self.stages[hop.gpu].key)
            if conn is not None and not conn.closed.is_set():
                with contextlib.suppress(TransportError, ConnectionError):
                    await conn.notify(STAGE_MSG, {"op": "end", "id": request_id})
