"""The interface every serving engine offers a model node: streamed generation over token ids, its
load, and its prefix-cache state as a stream of block events (vLLM's KV-event vocabulary); and the
part of a tokenizer that serving uses beside an engine."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


class EngineError(Exception):
    """A request the engine cannot serve (too long, bad parameters, engine stopped)."""


class EngineFailure(EngineError):
    """The engine's own work for a request failed (a device error, say): the request is not at fault,
    so an API answers 500."""


class EngineOverloaded(EngineError):
    """Too many requests are waiting for memory or a batch slot; an API answers 503 and the client
    retries later."""


class UnsupportedParameter(EngineError):
    """A request parameter this engine does not implement (an API answers 400 naming `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


MAX_LOGPROBS = 20
"""The most alternatives per generated token an engine reports (OpenAI's `top_logprobs` bound)."""


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    """0 is greedy decoding; above 0, sampling seeded by `seed` (or fresh randomness)."""
    seed: int | None = None
    stop_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    """None: no log-probabilities (and no cost for them); k: each generated token's log-probability and
    the k likeliest tokens at its position (0 to MAX_LOGPROBS)."""
    top_p: float = 1.0
    """Nucleus truncation before the seeded argmax (planetserve.sampling.nucleus); 1 is none."""


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model, the log-softmax of its raw logits (before
    temperature, as vLLM reports by default), and the `top` likeliest (token id, log-probability) there,
    likeliest first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class TokenChunk:
    """Newly generated token ids; the last chunk of a generation has `finish_reason` set."""

    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    """None while generating, then "stop" (a stop id was produced) or "length" (max_tokens reached)."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache (reported on the first chunk)."""
    logprobs: tuple[TokenLogprob, ...] | None = None
    """One per token id, when the request asked for them (`GenerationRequest.logprobs`)."""


@dataclass(frozen=True)
class EngineLoad:
    running: int
    queued: int
    capacity: int
    """How many sequences the engine decodes concurrently."""


@dataclass(frozen=True)
class BlockStored:
    """Full KV blocks entered the prefix cache: a chain of block hashes, the parent of the first
    (None at the root), and the token ids they hold (block_size per hash)."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


CacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class CacheListeners:
    """Callbacks for cache events; engines call `emit` from whatever thread mutates the cache."""

    callbacks: list[Callable[[list[CacheEvent]], None]] = field(default_factory=list)

    def add(self, callback: Callable[[list[CacheEvent]], None]) -> None:
        self.callbacks.append(callback)

    def emit(self, events: list[CacheEvent]) -> None:
        if events:
            for callback in self.callbacks:
                callback(events)


class Tokenizer(Protocol):
    """The part of a transformers tokenizer that serving uses: text to token ids and back, and the
    model's chat template."""

    chat_template: str | None

    def __len__(self) -> int: ...

    def __call__(self, text: str, add_special_tokens: bool = ...) -> Any: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


PromptLogprobs = list[dict[int, tuple[float, int]] | None]
"""Per prompt position: None for the first token (nothing predicts it), else token id -> (log-probability,
rank in the vocabulary, 1 = likeliest) for the prompt's own token and the `top` likeliest tokens there."""


class Engine(Protocol):
    model_id: str
    block_size: int
    max_model_len: int

    def generate(self, request: GenerationRequest) -> AsyncIterator[TokenChunk]:
        """Stream the generation; raises EngineError before the first chunk for a bad request."""
        ...

    def load(self) -> EngineLoad: ...

    def on_cache_events(self, callback: Callable[[list[CacheEvent]], None]) -> None:
        """Register for cache events; a new listener first receives the current cache as BlockStored."""
        ...

    async def close(self) -> None: ...
