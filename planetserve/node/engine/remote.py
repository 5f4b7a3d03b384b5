"""An Engine backed by an OpenAI-compatible server such as `vllm serve`.

Generation goes through /v1/completions with the prompt as token ids and vLLM's `return_token_ids`, so
token ids pass through untouched (and log-probabilities, when asked, come back keyed by token id with
vLLM's `return_tokens_as_token_ids`); the prefix-cache state comes from the server's KV-event stream
(`--kv-events-config`). The server is trusted to compute, not to be well-formed: every answer is
size-bounded and checked, and anything off becomes a RemoteEngineError.

Cached prompt tokens (`TokenChunk.cached_tokens`, against which peers check this node's cache-hit
claims) are the server's own count, `usage.prompt_tokens_details.cached_tokens`, when the answer has
one (`vllm serve --enable-prompt-tokens-details`, which leaves it out when the count is 0). Otherwise
they are counted on the mirror of the server's prefix cache at submission, the way vLLM's scheduler
counts a hit: the longest run of cached full blocks that leaves the prompt's last token out (vLLM
computes that token again for its logits, so a fully cached prompt hits one block less). That count is
off when the cache changes between submission and scheduling (a block evicted meanwhile is counted, one
stored by a concurrent request is not), while events are in flight (a block cached a moment ago is
missed), after a gap the replay could not fill (blocks cached before it are missed until stored again),
and behind planetserve's own engine server, whose built-in engine counts all but the last token of a
fully cached prompt (up to a block more than vLLM).

Sampling (temperature above 0) comes in two ways:
- `vllm_processor=True`: the server is `vllm serve` with planetserve's logits processor
  (`vllm_processor.py`, docs/operators.md "Serving with vLLM"). A sampled request goes to it at
  temperature 0 with the protocol's temperature and seed in `vllm_xargs`; the processor adds the
  protocol's noise and vLLM's greedy argmax picks the protocol's token, so a verifier holding the model
  checks the answer token by token. `connect` first makes sure the processor is there: it must refuse
  a malformed seed.
- otherwise (any OpenAI-compatible server): `temperature` and `seed` go as they are and the server
  samples its own way. Its sampled answers verify only if it samples by the protocol, as planetserve's
  own engine server does; plain `vllm serve` does not (its seeded sampling is its own), so a committee
  member finds those answers deviating and the node's reputation falls. Greedy answers verify either way.
"""

from __future__ import annotations

import json
import math
import secrets
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import httpx

from planetserve.node.engine.base import (
    AllBlocksCleared,
    CacheEvent,
    EngineError,
    EngineLoad,
    GenerationRequest,
    TokenChunk,
    TokenLogprob,
)
from planetserve.node.engine.kvevents import KVEventBatch, KVEventSubscriber, PrefixMirror
from planetserve.node.engine.vllm_sampling import XARG_SEED, XARG_TEMPERATURE, XARG_TOP_P
from planetserve.node.engine.wire import MAX_TOKEN_ID, SSEDecoder, SSEError, error_message
from planetserve.registry.epochs import SEED_LIMIT

FINISH_REASONS = (None, "stop", "length")
ID_PREFIX = "token_id:"


class RemoteEngineError(EngineError):
    """`status` is the server's HTTP status when it answered with one (503: overloaded)."""

    def __init__(self, message: str, status: int | None = None, code: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RemoteEngineError(f"remote engine sent a malformed {what}")
    return value


def _ids(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise RemoteEngineError(f"remote engine sent no {what} (does it support return_token_ids?)")
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_TOKEN_ID:
            raise RemoteEngineError(f"remote engine sent malformed {what}")
    return tuple(value)


def _token_id(value: Any) -> int:
    """A token of vLLM's `return_tokens_as_token_ids`: "token_id:N"."""
    if not isinstance(value, str) or not value.startswith(ID_PREFIX) or not value[len(ID_PREFIX):].isdigit():
        raise RemoteEngineError("remote engine sent a logprobs token that is not a token id")
    token = int(value[len(ID_PREFIX):])
    if token > MAX_TOKEN_ID:
        raise RemoteEngineError("remote engine sent a logprobs token that is not a token id")
    return token


def _logprob(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not -math.inf < value <= 0:
        raise RemoteEngineError("remote engine sent a malformed log-probability")
    return float(value)


def _logprobs(value: Any, ids: tuple[int, ...], top: int) -> tuple[TokenLogprob, ...]:
    """A completion chunk's `logprobs` for its tokens `ids`: each token's log-probability and the `top`
    likeliest of the alternatives sent (vLLM adds the sampled token to them when it is not among them)."""
    if not ids:
        return ()
    if not isinstance(value, dict):
        raise RemoteEngineError("remote engine sent no logprobs (were they asked for?)")
    tokens, values, alternatives = value.get("tokens"), value.get("token_logprobs"), value.get("top_logprobs")
    if not all(isinstance(x, list) and len(x) == len(ids) for x in (tokens, values, alternatives)):
        raise RemoteEngineError("remote engine sent logprobs that do not match its tokens")
    scored = []
    for token, wanted, logprob, alts in zip(tokens, ids, values, alternatives, strict=True):
        if _token_id(token) != wanted or not isinstance(alts, dict) or len(alts) > top + 1:
            raise RemoteEngineError("remote engine sent logprobs that do not match its tokens")
        ranked = sorted(((_token_id(t), _logprob(v)) for t, v in alts.items()), key=lambda e: -e[1])
        scored.append(TokenLogprob(_logprob(logprob), tuple(ranked[:top])))
    return tuple(scored)


class RemoteEngine:
    """Engine Protocol over HTTP. `capacity` is how many requests the server decodes at once; load() is
    this client's own count of requests in flight, split into running (up to capacity) and queued.
    With `max_queued`, requests beyond capacity + max_queued are refused here, before any HTTP.
    With `vllm_processor`, sampled requests go as planetserve's vLLM logits processor needs them (the
    module's docstring). Cache-event callbacks run on the event loop that runs the KV-event subscriber."""

    def __init__(
        self,
        base_url: str,
        model_id: str,
        *,
        max_model_len: int,
        block_size: int = 16,
        capacity: int = 8,
        max_queued: int | None = None,
        kv_events_endpoint: str | None = None,
        kv_events_replay_endpoint: str | None = None,
        kv_events_topic: str = "kv-events",
        api_key: str | None = None,
        connect_timeout: float = 5.0,
        read_timeout: float = 120.0,
        max_event_bytes: int = 8 << 20,
        vllm_processor: bool = False,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model_id = model_id
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.capacity = capacity
        self.max_queued = max_queued
        self.max_event_bytes = max_event_bytes
        self.vllm_processor = vllm_processor
        self.mirror = PrefixMirror()
        headers = {"Accept-Encoding": "identity", **_auth(api_key)}
        self._own_client = client is None
        self._client = client or httpx.AsyncClient(
            timeout=httpx.Timeout(read_timeout, connect=connect_timeout), headers=headers
        )
        self._inflight = 0
        self._lock = threading.RLock()
        self._listeners: list[Callable[[list[CacheEvent]], None]] = []
        self._subscriber = None if kv_events_endpoint is None else KVEventSubscriber(
            kv_events_endpoint, replay_endpoint=kv_events_replay_endpoint, topic=kv_events_topic,
            on_batch=self._on_batch, on_resync=self._on_resync,
        )

    @classmethod
    async def connect(cls, base_url: str, model_id: str | None = None, **options: Any) -> RemoteEngine:
        """Ask /v1/models for the model (the first one unless named) and its context length, check the
        logits processor when `vllm_processor` is set, then start."""
        headers = {"Accept-Encoding": "identity", **_auth(options.get("api_key"))}
        async with httpx.AsyncClient(timeout=options.get("connect_timeout", 5.0), headers=headers) as probe:
            try:
                async with probe.stream("GET", base_url.rstrip("/") + "/v1/models") as response:
                    raw = await _read_limited(response, 1 << 20)
            except httpx.HTTPError as exc:
                raise RemoteEngineError(f"remote engine unreachable: {type(exc).__name__}") from None
        if response.status_code != 200:
            raise RemoteEngineError(f"/v1/models answered HTTP {response.status_code}", response.status_code)
        try:
            cards = json.loads(raw)["data"]
            card = next(c for c in cards if model_id is None or c["id"] == model_id)
            name = card["id"]
        except (ValueError, KeyError, TypeError, StopIteration):
            raise RemoteEngineError(f"remote engine does not serve model {model_id!r}") from None
        if "max_model_len" not in options:
            options["max_model_len"] = _count(card.get("max_model_len"), "max_model_len")
        engine = cls(base_url, name, **options)
        if engine.vllm_processor:
            try:
                await engine.check_processor()
            except BaseException:
                await engine.close()
                raise
        engine.start()
        return engine

    async def check_processor(self) -> None:
        """RemoteEngineError unless the server runs planetserve's logits processor, which refuses (HTTP
        400) a request whose planetserve_seed is out of range; a server without it would answer and its
        sampled answers would not verify."""
        body = {"model": self.model_id, "prompt": [0], "max_tokens": 1, "temperature": 0.0,
                "vllm_xargs": {XARG_TEMPERATURE: 1.0, XARG_SEED: -1}}
        url = self.base_url + "/v1/completions"
        try:
            async with self._client.stream("POST", url, json=body) as response:
                if response.status_code == 400:
                    error = await _http_error(response)
                    if XARG_SEED in str(error):
                        return
                    raise RemoteEngineError(f"the engine server refused the check of planetserve's logits "
                                            f"processor for another reason: {error}", 400)
                await _read_limited(response, 1 << 20)
        except httpx.HTTPError as exc:
            raise RemoteEngineError(f"remote engine connection failed: {type(exc).__name__}: {exc}") from None
        raise RemoteEngineError(
            f"the engine server at {self.base_url} accepted a request that planetserve's logits processor "
            f"refuses (HTTP {response.status_code}): start it with VLLM_USE_V2_MODEL_RUNNER=0 and "
            "--logits-processors planetserve.node.engine.vllm_processor:PlanetServeSampling "
            "(docs/operators.md, \"Serving with vLLM\"), or set engine_sampling to \"server\"")

    def start(self) -> None:
        """Start following the KV-event stream (needs a running event loop)."""
        if self._subscriber is not None:
            self._subscriber.start()

    async def close(self) -> None:
        if self._subscriber is not None:
            await self._subscriber.close()
        if self._own_client:
            await self._client.aclose()

    def load(self) -> EngineLoad:
        inflight = self._inflight
        return EngineLoad(min(inflight, self.capacity), max(0, inflight - self.capacity), self.capacity)

    def on_cache_events(self, callback: Callable[[list[CacheEvent]], None]) -> None:
        with self._lock:
            snapshot = self.mirror.snapshot_events()
            if snapshot:
                callback(list(snapshot))
            self._listeners.append(callback)

    def _on_batch(self, _seq: int, batch: KVEventBatch) -> None:
        if batch.events:
            self._dispatch(list(batch.events))

    def _on_resync(self, _reason: str) -> None:
        """State was lost: forget it all rather than advertise prefixes that may be gone."""
        self._dispatch([AllBlocksCleared()])

    def _dispatch(self, events: list[CacheEvent]) -> None:
        with self._lock:
            self.mirror.apply(events)
            for callback in self._listeners:
                callback(events)

    def _check(self, request: GenerationRequest) -> None:
        if not request.prompt_ids:
            raise RemoteEngineError("empty prompt")
        if request.max_tokens < 1:
            raise RemoteEngineError("max_tokens must be at least 1")
        if len(request.prompt_ids) + request.max_tokens > self.max_model_len:
            raise RemoteEngineError(
                f"prompt ({len(request.prompt_ids)}) plus max_tokens ({request.max_tokens}) exceeds the "
                f"context length {self.max_model_len}")
        if request.seed is not None and not 0 <= request.seed < SEED_LIMIT:
            raise RemoteEngineError("seed must lie in [0, 2**64)")
        if self.max_queued is not None and self._inflight >= self.capacity + self.max_queued:
            raise RemoteEngineError("remote engine queue is full", status=503, code="overloaded")

    def _body(self, request: GenerationRequest) -> dict[str, Any]:
        """Plain sampling exactly as the Engine Protocol means it: only `stop_ids` end a generation
        (ignore_eos), and neutral values override any sampling defaults from the model's config. For
        the logits processor, the server's own sampling is greedy and the protocol's goes in
        `vllm_xargs` (a request without a seed gets a fresh one, as on the built-in engine)."""
        sampled_here = self.vllm_processor and request.temperature > 0
        body: dict[str, Any] = {
            "model": self.model_id,
            "prompt": list(request.prompt_ids),
            "max_tokens": request.max_tokens,
            "temperature": 0.0 if self.vllm_processor else request.temperature,
            "top_p": 1.0,
            "top_k": -1,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "stop_token_ids": list(request.stop_ids),
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "return_token_ids": True,
        }
        if sampled_here:
            seed = secrets.randbits(64) if request.seed is None else request.seed
            body["vllm_xargs"] = {XARG_TEMPERATURE: request.temperature, XARG_SEED: seed}
            if request.top_p < 1:
                body["vllm_xargs"][XARG_TOP_P] = request.top_p
        elif not self.vllm_processor:
            body["top_p"] = request.top_p
            if request.seed is not None:
                body["seed"] = request.seed
        if request.logprobs is not None:
            body.update(logprobs=request.logprobs, return_tokens_as_token_ids=True)
        return body

    def cached_prefix(self, prompt_ids: Sequence[int]) -> int:
        """The prompt tokens vLLM's prefix cache would supply now, by the mirror (the module docstring)."""
        with self._lock:
            return self.mirror.match_length(prompt_ids[:-1])

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenChunk]:
        """Yields chunks as they stream. The last chunk (finish_reason set) is held until the trailing
        usage arrives, so it carries prompt_tokens as the server counted them and cached_tokens as the
        server counted them or, when it sends no count, as the mirror did at submission (the module
        docstring); the first chunk carries them too, with cached_tokens only if the server reports it
        per chunk."""
        self._check(request)
        mirrored = self.cached_prefix(request.prompt_ids)
        self._inflight += 1
        try:
            async for chunk in self._stream(request, mirrored):
                yield chunk
        finally:
            self._inflight -= 1

    async def _stream(self, request: GenerationRequest, mirrored: int) -> AsyncIterator[TokenChunk]:
        url = self.base_url + "/v1/completions"
        try:
            async with self._client.stream("POST", url, json=self._body(request)) as response:
                if response.status_code != 200:
                    raise await _http_error(response)
                if response.headers.get("content-encoding", "identity") != "identity":
                    raise RemoteEngineError("remote engine compressed its stream (only identity is accepted)")
                content_type = response.headers.get("content-type", "")
                if not content_type.startswith("text/event-stream"):
                    raise RemoteEngineError(f"remote engine answered {content_type or 'no content type'}, "
                                            "not an event stream")
                async for chunk in self._chunks(request, response, mirrored):
                    yield chunk
        except httpx.TimeoutException as exc:
            raise RemoteEngineError(f"remote engine timed out ({type(exc).__name__})") from None
        except httpx.HTTPError as exc:
            raise RemoteEngineError(f"remote engine connection failed: {type(exc).__name__}: {exc}") from None

    async def _chunks(
        self, request: GenerationRequest, response: httpx.Response, mirrored: int
    ) -> AsyncIterator[TokenChunk]:
        decoder = SSEDecoder(self.max_event_bytes)
        prompt_tokens = len(request.prompt_ids)
        cached: int | None = None
        """The server's count, once it sent one."""
        generated = 0
        events = 0
        first = True
        final: tuple[tuple[int, ...], str, tuple[TokenLogprob, ...] | None] | None = None
        async for data in response.aiter_raw():
            try:
                batch = decoder.feed(data)
            except SSEError as exc:
                raise RemoteEngineError(f"remote engine sent a malformed stream: {exc}") from None
            for event in batch:
                if event == "[DONE]":
                    if final is None:
                        raise RemoteEngineError("remote engine stream ended without a finish reason")
                    counted = mirrored if cached is None else cached
                    yield TokenChunk(final[0], final[1], prompt_tokens, counted, final[2])
                    return
                events += 1
                if events > request.max_tokens + 8:
                    raise RemoteEngineError("remote engine sent more stream events than tokens requested")
                obj = _parse_event(event)
                usage = obj.get("usage")
                if isinstance(usage, dict):
                    prompt_tokens = _count(usage.get("prompt_tokens", prompt_tokens), "usage")
                    details = usage.get("prompt_tokens_details")
                    if isinstance(details, dict) and details.get("cached_tokens") is not None:
                        cached = _count(details["cached_tokens"], "usage")
                for choice in _choices(obj):
                    if final is not None:
                        raise RemoteEngineError("remote engine sent tokens after the finish reason")
                    if "prompt_token_ids" in choice and choice["prompt_token_ids"] is not None and \
                            _ids(choice["prompt_token_ids"], "prompt token ids") != request.prompt_ids:
                        raise RemoteEngineError("remote engine reports a different prompt than was sent")
                    ids = _ids(choice.get("token_ids"), "token ids")
                    generated += len(ids)
                    if generated > request.max_tokens:
                        raise RemoteEngineError("remote engine generated more tokens than max_tokens")
                    reason = choice.get("finish_reason")
                    if reason not in FINISH_REASONS:
                        raise RemoteEngineError(f"remote engine finished with {str(reason)[:40]!r}")
                    scored = None if request.logprobs is None else \
                        _logprobs(choice.get("logprobs"), ids, request.logprobs)
                    if reason is not None:
                        final = (ids, reason, scored)
                    elif ids:
                        yield TokenChunk(ids, None, prompt_tokens if first else 0,
                                         (cached or 0) if first else 0, scored)
                        first = False
        raise RemoteEngineError("remote engine stream ended before [DONE]")


def _auth(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _parse_event(event: str) -> dict[str, Any]:
    try:
        obj = json.loads(event)
    except (ValueError, RecursionError):
        raise RemoteEngineError("remote engine sent an event that is not JSON") from None
    if not isinstance(obj, dict):
        raise RemoteEngineError("remote engine sent an event that is not a JSON object")
    if "error" in obj:
        message, _, code = error_message(obj)
        raise RemoteEngineError(f"remote engine failed mid-stream: {message}", code=code)
    return obj


def _choices(obj: dict[str, Any]) -> list[dict[str, Any]]:
    choices = obj.get("choices")
    if not isinstance(choices, list):
        raise RemoteEngineError("remote engine sent a chunk without choices")
    for choice in choices:
        if not isinstance(choice, dict) or choice.get("index", 0) != 0:
            raise RemoteEngineError("remote engine sent a choice other than index 0")
    return choices


async def _read_limited(response: httpx.Response, limit: int) -> bytes:
    body = bytearray()
    async for data in response.aiter_raw():
        body += data
        if len(body) > limit:
            raise RemoteEngineError(f"remote engine answer exceeds {limit} bytes", response.status_code)
    return bytes(body)


async def _http_error(response: httpx.Response) -> RemoteEngineError:
    raw = await _read_limited(response, 64 << 10)
    try:
        message, _, code = error_message(json.loads(raw))
    except (ValueError, RecursionError):
        message, code = raw[:200].decode(errors="replace"), None
    return RemoteEngineError(f"remote engine answered HTTP {response.status_code}: {message}",
                             response.status_code, code)
