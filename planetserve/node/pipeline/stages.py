"""Pipeline stages (Parallax's execution): one model node runs a contiguous range of a model's decoder
layers, and hidden states travel between stages over the peer transport.

A `StageModel` holds the modules of its layer range (and the embedding on the first stage, the final
norm and LM head on the last) and runs any sub-range of it for the next positions of one request, with
that request's KV cache. A `StageServer` answers `stage` requests on a `Peering`: it keeps one cache per
(peer, request id), frees it when the request ends or sits idle, and checks every size and value a
request carries against the model before touching torch.

Wire format (msgpack bodies of transport requests of type `stage`; a tensor is
`{"dtype": "float32", "shape": [rows, width], "data": little-endian bytes}`):

    request  {"op": "start" | "continue", "id": bytes, "layers": [a, b], "pos": int,
              "tokens": [int, ...]}        when a == 0 (the embedding runs here)
              "hidden": tensor [n, hidden]} when a > 0
             {"op": "end", "id": bytes}
             {"op": "ping"}
    reply    {"hidden": tensor [n, hidden]}  when b < num_layers
             {"logits": tensor [1, vocab]}   when b == num_layers: the last position's logits only
             {"ended": bool}                 to "end"
             {"pong": true}                  to "ping": the coordinator's live round-trip measurement

`pos` is the number of positions the stage already holds for the request (0 on "start"): a lost or
repeated step is refused instead of silently corrupting the cache. Errors go back as the transport's
`err` frames with a readable reason; the connection and the server carry on.

Memory: `StageModel.load` reads the whole checkpoint, then keeps references to its own modules only,
so the other layers are freed once loading returns (the peak is the full model, once, at start).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask

from planetserve.chain.keys import KeySet
from planetserve.models import load
from planetserve.node.overlay.transport import MAX_FRAME, Peering

if TYPE_CHECKING:
    from transformers import PreTrainedModel

STAGE_MSG = "stage"
WIRE_DTYPE = "float32"
_WIRE_NUMPY = np.dtype("<f4")
FRAME_OVERHEAD = 4096
"""Bytes of a frame left for msgpack framing and the fields around a tensor."""
MAX_REQUEST_ID = 32
IDLE_TIMEOUT_S = 60.0
"""A request whose stage has heard nothing of it for this long is dropped with its cache: its client
died or moved it to another chain without ending it here."""
MAX_REQUESTS = 64
"""Requests a stage holds a cache for at once (each up to `max_tokens` positions of KV); one peer's at
most half of them, so that one coordinator cannot hold every other out (a pipeline's coordinator runs
as many as its node's capacity)."""


class StageError(ValueError):
    """A stage request refused: the message says which field is wrong and what was expected."""


@dataclass(frozen=True)
class ModelShape:
    """What both ends of a stage link must agree on to size and check tensors."""

    num_layers: int
    hidden_size: int
    vocab_size: int
    max_positions: int

    @classmethod
    def of(cls, config: Any) -> ModelShape:
        """From a transformers config (e.g. `model.config` or `AutoConfig.from_pretrained`)."""
        return cls(int(config.num_hidden_layers), int(config.hidden_size), int(config.vocab_size),
                   int(config.max_position_embeddings))


def max_step_tokens(hidden_size: int, frame_limit: int = MAX_FRAME) -> int:
    """Positions whose float32 hidden states fit one frame: a longer prompt is prefilled in chunks."""
    return max(1, (frame_limit - FRAME_OVERHEAD) // (4 * hidden_size))


def encode_tensor(array: torch.Tensor | np.ndarray) -> dict[str, Any]:
    """A 2-D float tensor as its wire form (float32, little-endian)."""
    if isinstance(array, torch.Tensor):
        array = array.detach().to(device="cpu", dtype=torch.float32).numpy()
    array = np.ascontiguousarray(array, dtype=_WIRE_NUMPY)
    return {"dtype": WIRE_DTYPE, "shape": list(array.shape), "data": array.tobytes()}


def decode_tensor(value: Any, name: str, width: int, max_rows: int) -> np.ndarray:
    """A wire tensor checked before use: float32, shape [rows, width] with 1 <= rows <= max_rows, the
    byte count that shape implies, finite values."""
    if not (isinstance(value, dict) and set(value) == {"dtype", "shape", "data"}):
        raise StageError(f"{name} must be a map of dtype, shape and data")
    dtype, shape, data = value["dtype"], value["shape"], value["data"]
    if dtype != WIRE_DTYPE:
        raise StageError(f"{name} must be {WIRE_DTYPE}, got {str(dtype)[:32]!r}")
    if not (isinstance(shape, list) and len(shape) == 2 and all(type(d) is int for d in shape)):
        raise StageError(f"{name} shape must be [rows, {width}]")
    rows, cols = shape
    if cols != width:
        raise StageError(f"{name} of width {cols} do not match the model's {width}")
    if not 1 <= rows <= max_rows:
        raise StageError(f"{name} of {rows} rows: expected 1 to {max_rows}")
    size = rows * cols * _WIRE_NUMPY.itemsize
    if not isinstance(data, bytes) or len(data) != size:
        got = len(data) if isinstance(data, bytes) else type(data).__name__
        raise StageError(f"{name} of shape {shape} need {size} bytes, got {got}")
    array = np.frombuffer(data, dtype=_WIRE_NUMPY).reshape(rows, cols)
    if not np.isfinite(array).all():
        raise StageError(f"{name} contain non-finite values")
    return array

_DECODER_PARTS = ("embed_tokens", "layers", "norm", "rotary_emb")


class StageModel:
    """Layers [start, end) of a Llama-style causal LM (`model.model.layers`, `embed_tokens`, `norm`,
    `rotary_emb`, `lm_head`; full attention only), run the way the installed transformers runs the
    whole model: one rotary embedding and one causal mask per step, each layer with its global index
    so that a cache holds exactly the layers this stage ran."""

    def __init__(self, model: PreTrainedModel, start: int, end: int) -> None:
        decoder = getattr(model, "model", None)
        if not (hasattr(model, "lm_head") and all(hasattr(decoder, name) for name in _DECODER_PARTS)):
            raise StageError(f"{type(model).__name__} is not a Llama-style causal LM (model.model.layers, "
                             f"embed_tokens, norm, rotary_emb and lm_head)")
        self.shape = ModelShape.of(model.config)
        if not 0 <= start < end <= self.shape.num_layers:
            raise StageError(f"layers [{start}, {end}) are not a non-empty range of "
                             f"[0, {self.shape.num_layers})")
        if any(kind != "full_attention" for kind in getattr(model.config, "layer_types", None) or ()):
            raise StageError("only full-attention models can be split into stages")
        self.config = model.config
        self.start, self.end = start, end
        self.layers = {i: decoder.layers[i] for i in range(start, end)}
        self.embed = decoder.embed_tokens if start == 0 else None
        self.norm, self.head = (decoder.norm, model.lm_head) if end == self.shape.num_layers else (None, None)
        self.rotary = decoder.rotary_emb
        self.device, self.dtype = model.device, model.dtype

    @classmethod
    def load(cls, name_or_path: str | Path, start: int, end: int, *, data_dir: str | Path | None = None,
             device: str = "cpu", dtype: str | None = None) -> StageModel:
        """A stage over a family model or checkpoint directory; the layers outside [start, end) are
        dropped with the full model when this returns."""
        return cls(load(name_or_path, data_dir=data_dir, device=device, dtype=dtype).model, start, end)

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.config)

    def length(self, cache: DynamicCache, start: int) -> int:
        """Positions the cache holds for a request that runs layers from `start` on this stage."""
        return cache.get_seq_length(start)

    @torch.inference_mode()
    def forward(self, inputs: torch.Tensor, cache: DynamicCache, start: int, end: int) -> torch.Tensor:
        """Layers [start, end) (within this stage's range) for the request's next n positions: `inputs` are
        token ids [n] when start is 0, else hidden states [n, hidden]. Returns hidden states [n, hidden],
        or the logits [1, vocab] of the last position when `end` is the model's last layer."""
        if not self.start <= start < end <= self.end:
            raise StageError(f"layers [{start}, {end}) are outside this stage's [{self.start}, {self.end})")
        inputs = inputs.to(self.device)
        hidden = (self.embed(inputs) if start == 0 else inputs.to(self.dtype)).unsqueeze(0)
        past = self.length(cache, start)
        positions = torch.arange(past, past + hidden.shape[1], device=self.device).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None,
                                  past_key_values=cache, position_ids=positions, layer_idx=start)
        rope = self.rotary(hidden, position_ids=positions)
        for i in range(start, end):
            hidden = self.layers[i](hidden, attention_mask=mask, position_ids=positions,
                                    past_key_values=cache, use_cache=True, position_embeddings=rope)
        if end < self.shape.num_layers:
            return hidden[0]
        return self.head(self.norm(hidden[0, -1:]))


@dataclass
class _Session:
    cache: DynamicCache
    layers: tuple[int, int]
    used: float


@dataclass(frozen=True)
class _Step:
    op: str
    request: bytes
    layers: tuple[int, int]
    position: int
    inputs: torch.Tensor | None


class StageServer:
    """Serves `stage` requests for one `StageModel` (pass `handle` to a `Peering`). Steps run on one
    worker thread, in arrival order; each request's cache is private to the peer that started it."""

    def __init__(self, stage: StageModel, *, max_tokens: int | None = None, max_requests: int = MAX_REQUESTS,
                 idle_timeout: float = IDLE_TIMEOUT_S, frame_limit: int = MAX_FRAME) -> None:
        self.stage = stage
        self.max_tokens = min(max_tokens or stage.shape.max_positions, stage.shape.max_positions)
        self.max_step = min(self.max_tokens, max_step_tokens(stage.shape.hidden_size, frame_limit))
        self.max_requests = max_requests
        self.idle_timeout = idle_timeout
        self.sessions: dict[tuple[bytes, bytes], _Session] = {}
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="stage")

    async def handle(self, peer: bytes, msg_type: str, body: Any) -> dict[str, Any]:
        """The Peering handler: one step of one request, or its end."""
        if msg_type != STAGE_MSG:
            raise StageError(f"unknown message type {msg_type[:32]!r}: this peer serves {STAGE_MSG!r}")
        if isinstance(body, dict) and body.get("op") == "ping":
            return {"pong": True}
        self._expire(time.monotonic())
        step = self._parse(body)
        key = (peer, step.request)
        if step.op == "end":
            return {"ended": self.sessions.pop(key, None) is not None}
        session = self._session(key, step)
        try:
            out = await asyncio.get_running_loop().run_in_executor(self.executor, self._run, session, step)
        except BaseException:
            if step.op == "start":  # nothing of it is worth keeping; the id may be started again
                self.sessions.pop(key, None)
            raise
        session.used = time.monotonic()
        name = "hidden" if step.layers[1] < self.stage.shape.num_layers else "logits"
        return {name: encode_tensor(out)}

    def close(self) -> None:
        self.sessions.clear()
        self.executor.shutdown(wait=False, cancel_futures=True)

    def _expire(self, now: float) -> None:
        """Idle requests are dropped when the next message arrives: only new work needs their memory."""
        for key in [k for k, s in self.sessions.items() if now - s.used > self.idle_timeout]:
            del self.sessions[key]

    def _parse(self, body: Any) -> _Step:
        if not isinstance(body, dict):
            raise StageError("a stage request must be a map")
        op, request = body.get("op"), body.get("id")
        if op not in ("start", "continue", "end"):
            raise StageError(f"op must be start, continue, end or ping, got {str(op)[:32]!r}")
        if not (isinstance(request, bytes) and 1 <= len(request) <= MAX_REQUEST_ID):
            raise StageError(f"id must be 1 to {MAX_REQUEST_ID} bytes")
        if op == "end":
            return _Step(op, request, (0, 0), 0, None)
        layers, position = body.get("layers"), body.get("pos")
        if not (isinstance(layers, list) and len(layers) == 2 and all(type(x) is int for x in layers)
                and self.stage.start <= layers[0] < layers[1] <= self.stage.end):
            raise StageError(f"layers must be [a, b) within this stage's "
                             f"[{self.stage.start}, {self.stage.end})")
        if type(position) is not int or not 0 <= position <= self.max_tokens:
            raise StageError(f"pos must be an integer in [0, {self.max_tokens}]")
        inputs = self._inputs(body, layers[0] == 0)
        if position + len(inputs) > self.max_tokens:
            raise StageError(f"request would reach {position + len(inputs)} positions, over the limit of "
                             f"{self.max_tokens}")
        return _Step(op, request, (layers[0], layers[1]), position, inputs)

    def _inputs(self, body: dict, first: bool) -> torch.Tensor:
        """Token ids for a step that starts at layer 0, hidden states otherwise."""
        wanted, other = ("tokens", "hidden") if first else ("hidden", "tokens")
        if other in body:
            raise StageError(f"a step {'at' if first else 'after'} layer 0 carries {wanted}, not {other}")
        if not first:
            return torch.from_numpy(decode_tensor(body.get("hidden"), "hidden states",
                                                  self.stage.shape.hidden_size, self.max_step).copy())
        tokens, vocab = body.get("tokens"), self.stage.shape.vocab_size
        if not isinstance(tokens, list) or not 1 <= len(tokens) <= self.max_step:
            raise StageError(f"tokens must be a list of 1 to {self.max_step} token ids")
        if not all(type(t) is int and 0 <= t < vocab for t in tokens):
            raise StageError(f"token ids must be integers in [0, {vocab})")
        return torch.tensor(tokens, dtype=torch.long)

    def _session(self, key: tuple[bytes, bytes], step: _Step) -> _Session:
        session = self.sessions.get(key)
        if step.op == "continue":
            if session is None:
                raise StageError(f"unknown request {step.request.hex()[:32]} (never started, ended or "
                                 f"idle for over {self.idle_timeout:g} s)")
            if session.layers != step.layers:
                (a, b), (c, d) = session.layers, step.layers
                raise StageError(f"request {step.request.hex()[:32]} runs layers [{a}, {b}) here, "
                                 f"not [{c}, {d})")
            return session
        if session is not None:
            raise StageError(f"request {step.request.hex()[:32]} was already started")
        if len(self.sessions) >= self.max_requests:
            raise StageError(f"this stage already holds {self.max_requests} requests")
        if sum(peer == key[0] for peer, _ in self.sessions) >= self.max_requests // 2:
            raise StageError(f"this stage already holds {self.max_requests // 2} of this peer's requests")
        session = _Session(self.stage.new_cache(), step.layers, time.monotonic())
        self.sessions[key] = session
        return session

    def _run(self, session: _Session, step: _Step) -> torch.Tensor:
        """On the worker thread, so the position check and the step are one atomic unit per request."""
        held = self.stage.length(session.cache, step.layers[0])
        if step.position != held:
            raise StageError(f"pos {step.position} does not follow the {held} positions this stage holds "
                             f"for the request")
        return self.stage.forward(step.inputs, session.cache, *step.layers)


@dataclass
class RunningStage:
    """A stage server listening on the peer transport."""

    peering: Peering
    server: StageServer
    port: int

    async def close(self) -> None:
        await self.peering.close()
        self.server.close()


async def serve_stage(keys: KeySet, stage: StageModel, authorize: Callable[[bytes], bool],
                      host: str = "127.0.0.1", port: int = 0, **limits: Any) -> RunningStage:
    """Listen for `stage` requests from the peers `authorize` accepts; `limits` go to StageServer."""
    server = StageServer(stage, **limits)
    peering = Peering(keys, server.handle, authorize)
    return RunningStage(peering, server, await peering.listen(host, port))


async def run_stage(keys: KeySet, stage: StageModel, allowed: set[bytes], host: str, port: int,
                    on_ready: Callable[[RunningStage], None], **limits: Any) -> None:
    """Serve until cancelled (SIGINT; SIGTERM's default action ends the process)."""
    running = await serve_stage(keys, stage, allowed.__contains__, host, port, **limits)
    on_ready(running)
    try:
        await asyncio.Event().wait()
    finally:
        await running.close()
