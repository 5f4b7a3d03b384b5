"""Answers the OpenAI-compatible API from any Engine the way `vllm serve` does, over the API's one
surface (`surface.ApiServer`), so a RemoteEngine (or any OpenAI client) cannot tell the two apart;
optionally publishes the engine's cache events on ZMQ in vLLM's format. Tests use it to stand in for
vLLM; a model node extends it (`produce`) to route its requests and sign its answers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from planetserve.models.detokenize import TextAssembler
from planetserve.node.api.openai import (
    DEFAULT_LIMITS,
    ApiError,
    ApiLimits,
    ApiRequest,
    Endpoint,
    LogprobsWriter,
    ResponseMeta,
    Scored,
    TokenTexts,
    build_generation,
    check_model,
    check_prompt_tokens,
    chunk_body,
    max_prompt_chars,
    models_body,
    overloaded,
    parse_request,
    prompt_logprobs_body,
    render_prompt,
    response_body,
    usage_body,
    usage_chunk,
)
from planetserve.node.api.surface import EVENT_STREAM, ApiServer, Document, Reply, close_stream
from planetserve.node.engine.base import (
    Engine,
    EngineError,
    EngineFailure,
    EngineOverloaded,
    GenerationRequest,
    PromptLogprobs,
    TokenChunk,
    Tokenizer,
    TokenLogprob,
    UnsupportedParameter,
)
from planetserve.node.engine.kvevents import KVEventPublisher
from planetserve.node.engine.wire import SSE_DONE, sse


class Generation:
    """One request's stream of engine chunks turned into text and token ids (with their log-probabilities,
    when asked), cut at stop strings."""

    def __init__(self, request: ApiRequest, prompt_ids: Sequence[int], tokenizer: Tokenizer) -> None:
        self.request = request
        self.prompt_tokens = len(prompt_ids)
        self.cached_tokens = 0
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        """One per kept token id, when the request asked for log-probabilities."""
        self.finish_reason: str | None = None
        self._text = TextAssembler(tokenizer, request.stop)

    def step(self, chunk: TokenChunk, first: bool) -> tuple[str, list[int]]:
        if first:
            self.prompt_tokens = chunk.prompt_tokens or self.prompt_tokens
            self.cached_tokens = chunk.cached_tokens
        before = self._text.consumed
        text = self._text.push(chunk.token_ids)
        ids = list(chunk.token_ids[: self._text.consumed - before])
        self.token_ids += ids
        if self.request.logprobs is not None:
            self.logprobs += self._checked_logprobs(chunk)[: len(ids)]
        self.finish_reason = "stop" if self._text.stopped else chunk.finish_reason
        if self.finish_reason is not None:
            text += self._text.finish()
        return text, ids

    @staticmethod
    def _checked_logprobs(chunk: TokenChunk) -> tuple[TokenLogprob, ...]:
        if chunk.logprobs is None or len(chunk.logprobs) != len(chunk.token_ids):
            raise EngineError("the engine sent no log-probability for each generated token")
        return chunk.logprobs

    def scored(self, since: int = 0) -> Scored:
        """The kept tokens from index `since` on, with their log-probabilities."""
        return list(zip(self.token_ids[since:], self.logprobs[since:], strict=True))

    def usage(self) -> dict[str, Any]:
        return usage_body(self.prompt_tokens, len(self.token_ids), self.cached_tokens)

    @property
    def text(self) -> str:
        """The whole answer so far (complete once finish_reason is set)."""
        return self._text.text


async def _no_extension(_: Generation) -> dict[str, Any] | None:
    return None


@dataclass(frozen=True)
class Production:
    """A request's token stream, and what to attach to its answer once the text is complete (the
    `planetserve` extension of a model node's signed answers)."""

    chunks: AsyncIterator[TokenChunk]
    finish: Callable[[Generation], Awaitable[dict[str, Any] | None]] = _no_extension


class EngineServer:
    """The answers of one engine, served: /v1/models, /v1/completions, /v1/chat/completions (streamed or
    not), /health, /load (the engine's load, and vLLM's `server_load`) and the owner's `documents`.
    Without `prompt_tokens_details`, usage leaves out the cached prompt tokens, as `vllm serve` does
    unless started with --enable-prompt-tokens-details. `hosts`: names the API answers to besides
    loopback ones and the host it listens on (the surface's browser guard)."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        *,
        model_name: str | None = None,
        limits: ApiLimits = DEFAULT_LIMITS,
        kv_publisher: KVEventPublisher | None = None,
        max_queued: int | None = None,
        vocab_size: int | None = None,
        eos_token_ids: Sequence[int] | None = None,
        documents: Mapping[str, Document] | None = None,
        prompt_tokens_details: bool = True,
        hosts: Iterable[str] = (),
        max_prompt_tokens: int | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        self.max_prompt_chars = max_prompt_chars(tokenizer, max_prompt_tokens or engine.max_model_len)
        self.model_name = model_name or engine.model_id
        self.limits = limits
        self.max_queued = max_queued
        self.prompt_tokens_details = prompt_tokens_details
        self.vocab_size = vocab_size if vocab_size is not None else len(tokenizer)
        self.texts = TokenTexts(tokenizer)
        eos = getattr(tokenizer, "eos_token_id", None)
        default_eos = () if eos is None else (eos,)
        self.eos_token_ids = tuple(eos_token_ids) if eos_token_ids is not None else default_eos
        if kv_publisher is not None:
            engine.on_cache_events(kv_publisher.publish)
        self.surface = ApiServer(self, max_body_bytes=limits.max_body_bytes,
                                 documents={"/load": self.load_body, **(documents or {})}, hosts=hosts)

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen; returns the base URL (with the port chosen when `port` is 0)."""
        return await self.surface.start(host, port)

    async def close(self) -> None:
        await self.surface.close()

    def health(self) -> tuple[int, dict[str, Any] | None]:
        return 200, None

    def load_body(self) -> dict[str, Any]:
        load = self.engine.load()
        return {"server_load": load.running + load.queued, "running": load.running,
                "queued": load.queued, "capacity": load.capacity}

    def models(self) -> dict[str, Any]:
        return models_body([self.model_name], max_model_len=self.engine.max_model_len)

    async def respond(self, endpoint: Endpoint, raw: bytes) -> Reply:
        """The answer to one API request body, whatever carries it: HTTP here, the anonymous overlay at
        a model node."""
        try:
            request = parse_request(endpoint, raw, self.limits)
            model = check_model(request, [self.model_name])
            if self.max_queued is not None and self.engine.load().queued >= self.max_queued:
                raise overloaded()
            prompt_ids = render_prompt(request, self.tokenizer, self.max_prompt_chars)
            if self.max_prompt_tokens is not None:
                check_prompt_tokens(prompt_ids, self.max_prompt_tokens)
            generation = build_generation(
                request, prompt_ids, max_model_len=self.engine.max_model_len, vocab_size=self.vocab_size,
                eos_token_ids=self.eos_token_ids,
            )
            scored = await self._prompt_logprobs(request, prompt_ids)
            production = await self.produce(request, prompt_ids, generation)
            try:
                first = await anext(production.chunks)
            except StopAsyncIteration:
                raise ApiError(500, "The engine produced no output.", type="server_error") from None
        except ApiError as exc:
            return Reply.json(exc.body(), exc.status)
        except UnsupportedParameter as exc:
            refused = ApiError(400, str(exc), param=exc.param, code="unsupported_parameter")
            return Reply.json(refused.body(), 400)
        except EngineOverloaded as exc:
            return Reply.json(overloaded(f"The server is overloaded: {exc}.").body(), 503)
        except EngineFailure as exc:
            return Reply.json(ApiError(500, f"Generation failed: {exc}", type="server_error").body(), 500)
        except EngineError as exc:
            return Reply.json(ApiError(400, f"The engine rejected the request: {exc}").body(), 400)
        meta = ResponseMeta.new(endpoint, model)
        state = Generation(request, prompt_ids, self.tokenizer)
        if request.stream:
            return Reply(200, EVENT_STREAM, self._stream(meta, state, first, production, prompt_ids))
        try:
            body, status = await self._whole(meta, state, first, production, prompt_ids)
        finally:
            await close_stream(production.chunks)
        if scored is not None and status == 200:
            body["choices"][0]["prompt_logprobs"] = prompt_logprobs_body(
                scored, lambda t: self.tokenizer.decode([t]))
        return Reply.json(body, status)

    def _logprobs_writer(self, meta: ResponseMeta, request: ApiRequest) -> LogprobsWriter | None:
        if request.logprobs is None:
            return None
        return LogprobsWriter(meta.endpoint, self.texts, request.return_tokens_as_token_ids)

    async def _prompt_logprobs(self, request: ApiRequest, prompt_ids: Sequence[int]) -> PromptLogprobs | None:
        if request.prompt_logprobs is None:
            return None
        score = getattr(self.engine, "prompt_logprobs", None)
        if score is None:
            raise ApiError(400, "This server's engine does not score prompts (`prompt_logprobs`).",
                           param="prompt_logprobs", code="unsupported_parameter")
        return await score(prompt_ids, request.prompt_logprobs)

    def _usage(self, state: Generation) -> dict[str, Any]:
        usage = state.usage()
        if not self.prompt_tokens_details:
            del usage["prompt_tokens_details"]
        return usage

    async def produce(self, request: ApiRequest, prompt_ids: Sequence[int],
                      generation: GenerationRequest) -> Production:
        """Where a request's tokens come from: here, the engine. A model node overrides this to route
        the request and to sign the answer."""
        return Production(self.engine.generate(generation))

    async def _whole(self, meta: ResponseMeta, state: Generation, first: TokenChunk,
                     production: Production, prompt_ids: Sequence[int]) -> tuple[dict[str, Any], int]:
        chunks = production.chunks
        try:
            parts = [state.step(first, True)[0]]
            while state.finish_reason is None:
                parts.append(state.step(await anext(chunks), False)[0])
            extension = await production.finish(state)
        except StopAsyncIteration:
            return ApiError(500, "The engine stream ended early.", type="server_error").body(), 500
        except EngineError as exc:
            return ApiError(500, f"Generation failed: {exc}", type="server_error").body(), 500
        want = state.request.return_token_ids
        writer = self._logprobs_writer(meta, state.request)
        body = response_body(
            meta, text="".join(parts), finish_reason=state.finish_reason, usage=self._usage(state),
            prompt_token_ids=prompt_ids if want else None, token_ids=state.token_ids if want else None,
            logprobs=writer.body(state.scored()) if writer is not None else None,
        )
        if extension is not None:
            body["planetserve"] = extension
        return body, 200

    async def _stream(self, meta: ResponseMeta, state: Generation, first: TokenChunk,
                      production: Production, prompt_ids: Sequence[int]) -> AsyncIterator[bytes]:
        """Server-sent events; closing the iterator early (the client went away) stops generation."""
        chunks = production.chunks
        request = state.request
        writer = self._logprobs_writer(meta, request)
        chunk: TokenChunk | None = first
        is_first = True
        try:
            while chunk is not None:
                kept = len(state.token_ids)
                text, ids = state.step(chunk, is_first)
                if text or ids or state.finish_reason is not None or is_first:
                    body = chunk_body(
                        meta, text=text, finish_reason=state.finish_reason, first=is_first,
                        token_ids=ids if request.return_token_ids else None,
                        prompt_token_ids=prompt_ids if request.return_token_ids and is_first else None,
                        usage=self._usage(state) if request.continuous_usage else None,
                        logprobs=writer.body(state.scored(kept)) if writer is not None else None,
                    )
                    if state.finish_reason is not None and (extension := await production.finish(state)):
                        body["planetserve"] = extension
                    yield sse(body)
                is_first = False
                chunk = None if state.finish_reason is not None else await anext(chunks, None)
            if state.finish_reason is None:
                raise EngineError("the engine stream ended early")
            if request.include_usage:
                yield sse(usage_chunk(meta, self._usage(state)))
        except EngineError as exc:
            yield sse(ApiError(500, f"Generation failed: {exc}", type="server_error").body())
        finally:
            await close_stream(chunks)
        yield SSE_DONE
