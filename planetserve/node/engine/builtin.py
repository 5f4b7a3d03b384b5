"""The built-in engine: a transformers causal LM served with a block prefix cache and continuous
batching (iteration-level scheduling) on one worker thread.

Each iteration admits queued requests while capacity and KV memory allow, runs one decode step over
every running sequence, then spends at most `prefill_chunk` prompt tokens on prefilling admitted
sequences (only the part of each prompt the prefix cache does not hold), so a long prompt costs the
running decodes one chunk per step rather than a stall. The running sequences share one left-padded
KV batch: a sequence's KV is always the rightmost `kv_len` columns of its row, the padding is masked
out and each row gets its own position ids, so a batched greedy decode gives the same tokens as
decoding that sequence alone.

A failure in one sequence's prefill fails that request alone; a failed decode step fails the
sequences in that batch; either way the engine goes on serving. Admission reserves each sequence's
KV (prompt + max_tokens, at the padded batch's width) against `kv_budget_tokens`, so memory is
refused up front (EngineOverloaded once the queue is full) instead of running out mid-batch.

Only full-attention decoder models fit: the cache keeps every position's KV.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import secrets
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache

from planetserve.node.engine.base import (
    MAX_LOGPROBS,
    CacheEvent,
    EngineError,
    EngineFailure,
    EngineLoad,
    EngineOverloaded,
    GenerationRequest,
    PromptLogprobs,
    TokenChunk,
    TokenLogprob,
)
from planetserve.node.engine.kvcache import PrefixCache
from planetserve.sampling import check_top_p, sample

log = logging.getLogger(__name__)

SERVING_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""Every SDPA backend but cuDNN's, which plans each new shape afresh: a decode step's KV is one column
wider than the last, and on an H100 that made a 1B model decode 4.9x slower at batch 1 and 3.4x at
batch 8 (bench/engine_scale.py, docs/benchmarks.md)."""


def cached_past(cached: torch.Tensor | None) -> DynamicCache:
    """A one-row KV cache holding `cached` ([layers, 2, kv_heads, n, head_dim]), or an empty one."""
    if cached is None:
        return DynamicCache()
    return DynamicCache(ddp_cache_data=[(layer[0].unsqueeze(0), layer[1].unsqueeze(0)) for layer in cached])


def prefill_chunk(
    model: PreTrainedModel, past: DynamicCache, token_ids: Sequence[int], end: int
) -> torch.Tensor:
    """Extend a one-row `past` (holding the KV of the first n tokens) with tokens n..end; returns the
    logits after token end - 1."""
    device = model.device
    n = past.get_seq_length()
    out = model(
        input_ids=torch.tensor([token_ids[n:end]], device=device),
        position_ids=torch.arange(n, end, device=device).unsqueeze(0),
        past_key_values=past,
        use_cache=True,
        logits_to_keep=1,
    )
    return out.logits[0, -1]


def prefill(
    model: PreTrainedModel, token_ids: Sequence[int], cached: torch.Tensor | None
) -> tuple[torch.Tensor, DynamicCache]:
    """Logits after the last token and the KV of all tokens, computing only the positions `cached`
    (the KV of the first n tokens) does not cover, in one forward."""
    past = cached_past(cached)
    return prefill_chunk(model, past, token_ids, len(token_ids)), past


def decode_step(
    model: PreTrainedModel, past: DynamicCache, last: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """Feed each row's last token ([B]) to a left-padded batch whose rows hold `lengths` real positions;
    the batch grows by one column. Returns the next-token logits [B, vocab]."""
    width = past.get_seq_length()
    columns = torch.arange(width + 1, device=last.device)
    mask = (columns.unsqueeze(0) >= (width - lengths).unsqueeze(1)).long()
    out = model(
        input_ids=last.unsqueeze(1),
        attention_mask=mask,
        position_ids=lengths.unsqueeze(1),
        past_key_values=past,
        use_cache=True,
    )
    return out.logits[:, -1]


def merge_batches(parts: Sequence[DynamicCache]) -> DynamicCache:
    """Stack KV batches row-wise, left-padding each to the widest."""
    width = max(p.get_seq_length() for p in parts)
    data = []
    for layers in zip(*(p.layers for p in parts), strict=True):
        keys = [F.pad(layer.keys, (0, 0, width - layer.keys.shape[2], 0)) for layer in layers]
        values = [F.pad(layer.values, (0, 0, width - layer.values.shape[2], 0)) for layer in layers]
        data.append((torch.cat(keys), torch.cat(values)))
    return DynamicCache(ddp_cache_data=data)


def select_rows(past: DynamicCache, rows: Sequence[int], width: int) -> DynamicCache:
    """Keep `rows`, dropping the leading columns beyond `width` that are padding in all of them."""
    index = torch.tensor(rows, device=past.layers[0].keys.device)
    return DynamicCache(ddp_cache_data=[
        (layer.keys[index, :, -width:], layer.values[index, :, -width:]) for layer in past.layers
    ])


def truncated(past: DynamicCache, width: int) -> DynamicCache:
    """The batch as it was at `width` columns: a step that failed part-way through the model had
    appended its column to the layers before the failure, not to those after."""
    return DynamicCache(ddp_cache_data=[
        (layer.keys[:, :, :width], layer.values[:, :, :width]) for layer in past.layers
    ])


def block_reader(past: DynamicCache, row: int, kv_len: int, block_size: int) -> Callable[[int], torch.Tensor]:
    """Block i of the sequence in `row` (its KV being the rightmost `kv_len` columns) in the prefix
    cache's layout [layers, 2, kv_heads, block_size, head_dim]."""
    start = past.get_seq_length() - kv_len

    def read(i: int) -> torch.Tensor:
        a = start + i * block_size
        return torch.stack([
            torch.stack([layer.keys[row, :, a : a + block_size], layer.values[row, :, a : a + block_size]])
            for layer in past.layers
        ])

    return read


def request_problem(request: GenerationRequest, vocab_size: int, max_len: int) -> str | None:
    """Why an engine that samples by the protocol over `vocab_size` tokens and `max_len` positions cannot
    serve `request` (the first reason), or None. The built-in engine and a pipeline's coordinator both
    check this before any work."""
    prompt = request.prompt_ids
    if not prompt:
        return "empty prompt"
    if request.max_tokens < 1:
        return "max_tokens must be >= 1"
    if not math.isfinite(request.temperature) or request.temperature < 0:
        return "temperature must be a finite number >= 0"
    try:
        check_top_p(request.top_p)
    except ValueError as exc:
        return str(exc)
    if request.seed is not None and not 0 <= request.seed < 1 << 64:
        return "seed must lie in [0, 2**64)"
    if request.logprobs is not None and not 0 <= request.logprobs <= min(MAX_LOGPROBS, vocab_size):
        return f"logprobs must lie in [0, {MAX_LOGPROBS}]"
    if any(not 0 <= t < vocab_size for t in prompt):
        return f"prompt token ids must lie in [0, {vocab_size})"
    if len(prompt) + request.max_tokens > max_len:
        return f"prompt ({len(prompt)}) + max_tokens ({request.max_tokens}) exceeds {max_len}"
    return None


def token_logprob(logprobs: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """A token's entry from its position's log-softmax row ([vocab]), with the `top` likeliest."""
    values, ids = logprobs.topk(top)
    return TokenLogprob(logprobs[token].item(), tuple(zip(ids.tolist(), values.tolist(), strict=True)))


def _failure(exc: Exception) -> str:
    """What the failed request's client is told: out of memory is the operator's to size, not a bug."""
    if isinstance(exc, torch.OutOfMemoryError):
        return "the device ran out of memory for this request; retry with a shorter prompt or fewer tokens"
    return f"generation failed: {exc!r}"


@dataclass(frozen=True)
class EngineStats:
    prefill_tokens: int
    """Prompt tokens computed (cache misses)."""
    decode_tokens: int
    cached_tokens: int
    """Prompt tokens whose KV came from the prefix cache."""
    cache_hits: int
    cache_misses: int
    evictions: int
    cached_blocks: int
    steps: int
    prompts_scored: int
    """Teacher-forced passes for `prompt_logprobs`."""


@dataclass(eq=False)
class _Sequence:
    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    inbox: asyncio.Queue[TokenChunk | EngineError]
    stop_ids: frozenset[int]
    seed: int
    """The request's seed, or a fresh one: sampling is reproducible either way (planetserve.sampling)."""
    tokens: list[int] = field(default_factory=list)
    past: DynamicCache | None = None
    """Its own KV while it is being prefilled; None once it joins the running batch."""
    kv_len: int = 0
    cached_tokens: int = 0
    pinned: list[int] = field(default_factory=list)
    finished: bool = False
    cancelled: bool = False
    """The consumer went away; written by its thread, read by the worker."""

    @property
    def reserve(self) -> int:
        """The KV positions it may come to hold."""
        return len(self.request.prompt_ids) + self.request.max_tokens

    def deliver(self, item: TokenChunk | EngineError) -> None:
        try:
            self.loop.call_soon_threadsafe(self.inbox.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening
            self.cancelled = True


class BuiltinEngine:
    """Serves one model, on `device` or where the model already is. Cache-event callbacks run on the
    worker thread (the initial snapshot on the registering one), so they must be quick and thread-safe.

    Stop ids (the request's and `eos_ids`) end a generation and are included in its output."""

    def __init__(
        self,
        model: PreTrainedModel,
        model_id: str,
        eos_ids: Iterable[int] = (),
        *,
        block_size: int = 16,
        max_batch: int = 8,
        cache_capacity_tokens: int = 16384,
        max_model_len: int | None = None,
        device: str | torch.device | None = None,
        prefill_chunk: int = 512,
        kv_budget_tokens: int | None = None,
        max_queue: int = 1024,
    ) -> None:
        config = model.config.get_text_config()
        if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
            raise ValueError("the built-in engine needs a model whose layers all use full attention")
        if max_batch < 1 or prefill_chunk < 1 or max_queue < 1:
            raise ValueError("max_batch, prefill_chunk and max_queue must be >= 1")
        self.device = model.device if device is None else torch.device(device)
        self.model = model.to(self.device)
        if self.device.type == "cpu":
            self.model = self.model.float()
        self.model.eval()
        self.model_id = model_id
        self.block_size = block_size
        self.max_batch = max_batch
        self.max_model_len = max_model_len or config.max_position_embeddings
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.eos_ids = frozenset(eos_ids)
        self.prefill_chunk = prefill_chunk
        self.max_queue = max_queue
        self.kv_budget_tokens = kv_budget_tokens or self._default_kv_budget(cache_capacity_tokens)
        if self.kv_budget_tokens < 1:
            raise ValueError("kv_budget_tokens must be >= 1")
        self.cache = PrefixCache(block_size, cache_capacity_tokens)
        self._cond = threading.Condition()
        self._queue: collections.deque[_Sequence] = collections.deque()
        self._prefilling: list[_Sequence] = []
        self._running: list[_Sequence] = []
        self._batch: DynamicCache | None = None
        self._outbox: list[tuple[_Sequence, TokenChunk | EngineError]] = []
        self._closed = False
        self._prefill_tokens = self._cached_tokens = self._decode_tokens = self._steps = 0
        self._scoring = asyncio.Semaphore(1)
        self._scoring_waits = 0
        self._scored = 0
        self._thread = threading.Thread(target=self._run, name=f"engine-{model_id}", daemon=True)
        self._thread.start()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenChunk]:
        seq = self._submit(request)
        try:
            while True:
                item = await seq.inbox.get()
                if isinstance(item, EngineError):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            self._cancel(seq)

    def load(self) -> EngineLoad:
        return EngineLoad(running=len(self._running) + len(self._prefilling), queued=len(self._queue),
                          capacity=self.max_batch)

    def kv_bytes_per_token(self) -> int:
        """What one position's KV occupies across all layers, in the model's dtype."""
        config = self.model.config.get_text_config()
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        itemsize = next(self.model.parameters()).element_size()
        return config.num_hidden_layers * 2 * kv_heads * head_dim * itemsize

    def _default_kv_budget(self, cache_capacity_tokens: int) -> int:
        """On a GPU, what 85% of its free memory holds beside the prefix cache; elsewhere a full batch of
        the longest sequences (host memory is the operator's to size)."""
        if self.device.type != "cuda":
            return self.max_batch * self.max_model_len
        free, _ = torch.cuda.mem_get_info(self.device)
        return max(1, int(free * 0.85) // self.kv_bytes_per_token() - cache_capacity_tokens)

    async def prompt_logprobs(self, ids: Sequence[int], top: int) -> PromptLogprobs:
        """One teacher-forced pass over the prompt, beside the generation thread (inference reads the
        weights only). One pass runs at a time, and at most `max_queue` wait for it (then EngineOverloaded):
        each holds the prompt's logits for the whole vocabulary, outside the batch's KV budget, and
        requests scored as they came ran one forward each in the thread pool at once."""
        if not ids or len(ids) > self.max_model_len:
            raise EngineError(f"a scored prompt needs 1 to {self.max_model_len} tokens, got {len(ids)}")
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise EngineError(f"token ids must lie in [0, {self.vocab_size})")
        if self._scoring_waits >= self.max_queue:
            raise EngineOverloaded(f"{self._scoring_waits} prompts already wait to be scored; retry later")
        self._scoring_waits += 1
        try:
            await self._scoring.acquire()
        finally:
            self._scoring_waits -= 1
        self._scored += 1
        work = asyncio.ensure_future(asyncio.to_thread(self._prompt_logprobs, list(ids), top))
        work.add_done_callback(self._scored_one)
        try:
            return await asyncio.shield(work)  # a caller that leaves does not free the pass's place
        except Exception as exc:  # the device failed this pass (out of memory, say): it fails alone
            raise EngineFailure(_failure(exc)) from exc

    def _scored_one(self, work: asyncio.Future[PromptLogprobs]) -> None:
        self._scoring.release()
        if not work.cancelled():
            work.exception()  # retrieved here when its caller left

    @torch.inference_mode()
    def _prompt_logprobs(self, ids: list[int], top: int) -> PromptLogprobs:
        logits = self.model(input_ids=torch.tensor([ids], device=self.device), use_cache=False).logits[0, :-1]
        logprobs = logits.float().log_softmax(-1)
        result: PromptLogprobs = [None]
        for row, token in zip(logprobs, ids[1:], strict=True):
            value = row[token]
            entry = {token: (value.item(), int((row > value).sum().item()) + 1)}
            if top:
                values, indices = row.topk(top)
                for rank, (v, i) in enumerate(zip(values.tolist(), indices.tolist(), strict=True), 1):
                    entry.setdefault(i, (v, rank))
            result.append(entry)
        return result

    def on_cache_events(self, callback: Callable[[list[CacheEvent]], None]) -> None:
        self.cache.subscribe(callback)

    def stats(self) -> EngineStats:
        s = self.cache.stats
        return EngineStats(
            prefill_tokens=self._prefill_tokens, decode_tokens=self._decode_tokens,
            cached_tokens=self._cached_tokens, cache_hits=s.hits, cache_misses=s.misses,
            evictions=s.evictions, cached_blocks=len(self.cache), steps=self._steps,
            prompts_scored=self._scored,
        )

    async def close(self) -> None:
        """Stop the worker; requests still queued or running fail with EngineError."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        await asyncio.to_thread(self._thread.join)

    def _submit(self, request: GenerationRequest) -> _Sequence:
        prompt = request.prompt_ids
        if self._closed:
            raise EngineError("engine is closed")
        if (problem := request_problem(request, self.vocab_size, self.max_model_len)) is not None:
            raise EngineError(problem)
        if len(prompt) + request.max_tokens > self.kv_budget_tokens:
            raise EngineError(
                f"prompt ({len(prompt)}) + max_tokens ({request.max_tokens}) needs more KV memory than this "
                f"engine has ({self.kv_budget_tokens} positions)"
            )
        seed = secrets.randbits(64) if request.seed is None else request.seed
        seq = _Sequence(
            request, asyncio.get_running_loop(), asyncio.Queue(),
            frozenset(request.stop_ids) | self.eos_ids, seed, list(prompt),
        )
        with self._cond:
            if self._closed:
                raise EngineError("engine is closed")
            if len(self._queue) >= self.max_queue:
                raise EngineOverloaded(f"{len(self._queue)} requests are already waiting; retry later")
            self._queue.append(seq)
            self._cond.notify()
        return seq

    def _cancel(self, seq: _Sequence) -> None:
        with self._cond:
            seq.cancelled = True
            if seq in self._queue:
                self._queue.remove(seq)

    def _run(self) -> None:
        failure = "engine closed"
        try:
            with torch.inference_mode(), sdpa_kernel(SERVING_ATTENTION):
                while True:
                    with self._cond:
                        while not (self._closed or self._queue or self._running or self._prefilling):
                            self._cond.wait()
                        if self._closed:
                            break
                        self._admit()
                    self._step()
                    self._publish()
        except Exception as exc:
            log.exception("engine %s failed", self.model_id)
            failure = f"engine failed: {exc!r}"
        with self._cond:
            self._closed = True
            pending = [s for s in [*self._prefilling, *self._running, *self._queue] if not s.finished]
            self._queue.clear()
        self._publish()
        for seq in pending:
            seq.deliver(EngineError(failure))
            self.cache.unpin(seq.pinned)
        self._running, self._prefilling, self._batch = [], [], None
        self.cache.clear()
        self.cache.flush()

    def _admit(self) -> None:
        """Move queued sequences to prefilling, in order, while the batch has room and their KV fits
        the budget at the padded batch's width; the caller holds the lock."""
        while self._queue and len(self._running) + len(self._prefilling) < self.max_batch:
            live = [*self._running, *self._prefilling, self._queue[0]]
            if len(live) * max(seq.reserve for seq in live) > self.kv_budget_tokens:
                return
            self._prefilling.append(self._queue.popleft())

    def _publish(self) -> None:
        """Cache events first, then tokens: a consumer that sees a token can rely on the cache events
        of the step that made it having been emitted."""
        self.cache.flush()
        for seq, chunk in self._outbox:
            seq.deliver(chunk)
        self._outbox = []

    def _step(self) -> None:
        self._retire_ended()  # consumers that went away since the last step
        if self._batch is not None:
            width = self._batch.get_seq_length()
            try:
                self._decode(self._batch, self._running)
            except Exception as exc:  # noqa: BLE001 - retried one request at a time, the engine goes on
                self._decode_apart(truncated(self._batch, width), exc)
            self._retire_ended()
        self._prefill_some()

    def _prefill_some(self) -> None:
        """Spend at most `prefill_chunk` prompt tokens, oldest sequence first; each sequence whose prompt
        is complete emits its first token and joins the running batch."""
        budget = self.prefill_chunk
        for seq in list(self._prefilling):
            if budget <= 0:
                break
            if seq.cancelled:
                self._prefilling.remove(seq)
                continue
            try:
                budget -= self._prefill(seq, budget)
            except Exception as exc:  # noqa: BLE001 - this request fails, the others go on
                self._prefilling.remove(seq)
                self._fail([seq], exc)

    def _prefill(self, seq: _Sequence, budget: int) -> int:
        """Compute up to `budget` more of the prompt's positions; returns how many it computed."""
        prompt = seq.request.prompt_ids
        if seq.past is None:
            hit = self.cache.lookup(prompt)
            # a fully cached prompt still needs its last token run, for the logits
            seq.cached_tokens = min(len(hit) * self.block_size, len(prompt) - 1)
            cached = torch.cat([b.kv for b in hit], dim=3)[:, :, :, : seq.cached_tokens] if hit else None
            seq.past = cached_past(cached)
            seq.kv_len = seq.cached_tokens
        end = min(len(prompt), seq.kv_len + budget)
        logits = prefill_chunk(self.model, seq.past, prompt, end)
        computed, seq.kv_len = end - seq.kv_len, end
        self._prefill_tokens += computed
        if end == len(prompt):
            self._start(seq, logits)
        return computed

    def _start(self, seq: _Sequence, logits: torch.Tensor) -> None:
        """A fully prefilled sequence: cache its prompt, emit its first token, join the batch."""
        past, seq.past = seq.past, None
        assert past is not None
        self._prefilling.remove(seq)
        prompt = seq.request.prompt_ids
        seq.pinned = self.cache.insert(prompt, block_reader(past, 0, seq.kv_len, self.block_size), pin=True)
        self._cached_tokens += seq.cached_tokens
        rows = logits.unsqueeze(0)
        token = self._pick(rows, [seq])[0]
        self._emit(seq, token, self._score(rows, [seq], [token])[0], first=True)
        if seq.finished:
            self._retire(seq, past, 0)
            return
        self._running.append(seq)
        self._batch = past if self._batch is None else merge_batches([self._batch, past])

    def _fail(self, seqs: list[_Sequence], exc: Exception) -> None:
        """Fail `seqs`, already out of the running and prefilling lists, then give the device back
        what their KV held."""
        log.warning("engine %s: %d request(s) failed: %r", self.model_id, len(seqs), exc)
        for seq in seqs:
            seq.past, seq.finished = None, True
            self.cache.unpin(seq.pinned)
            seq.pinned = []
            self._outbox.append((seq, EngineFailure(_failure(exc))))
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _decode_apart(self, batch: DynamicCache, exc: Exception) -> None:
        """After a failed step, the same step for each request on its own, from its KV as it was: a
        fault that follows one request (its inputs, its length) fails it alone, and one the whole batch
        caused (out of memory at its width, say) fails none."""
        log.warning("engine %s: a decode step of %d request(s) failed (%r): retrying each on its own",
                    self.model_id, len(self._running), exc)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        kept, parts = [], []
        for row, seq in enumerate(self._running):
            part = select_rows(batch, [row], seq.kv_len)
            try:
                self._decode(part, [seq])
            except Exception as failure:  # noqa: BLE001 - this request fails, the others go on
                self._fail([seq], failure)
                continue
            kept.append(seq)
            parts.append(part)
        self._running = kept
        self._batch = merge_batches(parts) if parts else None

    def _decode(self, batch: DynamicCache, seqs: list[_Sequence]) -> None:
        """One step of `seqs`, the rows of `batch`: it grows by a column and each emits a token."""
        last = torch.tensor([seq.tokens[-1] for seq in seqs], device=self.device)
        lengths = torch.tensor([seq.kv_len for seq in seqs], device=self.device)
        logits = decode_step(self.model, batch, last, lengths)
        self._steps += 1
        self._decode_tokens += len(seqs)
        tokens = self._pick(logits, seqs)
        scored = self._score(logits, seqs, tokens)
        for seq, token, entry in zip(seqs, tokens, scored, strict=True):
            seq.kv_len += 1
            self._emit(seq, token, entry, first=False)

    @staticmethod
    def _pick(logits: torch.Tensor, seqs: list[_Sequence]) -> list[int]:
        """Each row's token from its own logits, seed and position only, so a request's answer does not
        depend on what else is in the batch."""
        return [sample(row, seq.request.temperature, seq.seed, len(seq.tokens) - len(seq.request.prompt_ids),
                       seq.request.top_p)
                for row, seq in zip(logits, seqs, strict=True)]

    @staticmethod
    def _score(logits: torch.Tensor, seqs: list[_Sequence], tokens: list[int]) -> list[TokenLogprob | None]:
        """The picked tokens' log-probabilities under the model (the raw logits' log-softmax, whatever the
        temperature), computed only for the rows whose request asked: the others pay nothing."""
        asking = [i for i, seq in enumerate(seqs) if seq.request.logprobs is not None]
        scored: list[TokenLogprob | None] = [None] * len(seqs)
        if asking:
            rows = logits[asking].float().log_softmax(-1)
            for row, i in zip(rows, asking, strict=True):
                scored[i] = token_logprob(row, tokens[i], seqs[i].request.logprobs or 0)
        return scored

    def _emit(self, seq: _Sequence, token: int, scored: TokenLogprob | None, first: bool) -> None:
        seq.tokens.append(token)
        produced = len(seq.tokens) - len(seq.request.prompt_ids)
        finish = "stop" if token in seq.stop_ids else "length" if produced >= seq.request.max_tokens else None
        seq.finished = finish is not None
        usage = (len(seq.request.prompt_ids), seq.cached_tokens) if first else (0, 0)
        logprobs = None if scored is None else (scored,)
        self._outbox.append((seq, TokenChunk((token,), finish, *usage, logprobs=logprobs)))

    def _retire_ended(self) -> None:
        """Drop finished and abandoned sequences from the batch."""
        rows = [i for i, seq in enumerate(self._running) if seq.finished or seq.cancelled]
        if not rows or self._batch is None:
            return
        for row in rows:
            self._retire(self._running[row], self._batch, row)
        gone = set(rows)
        keep = [i for i in range(len(self._running)) if i not in gone]
        self._running = [self._running[i] for i in keep]
        width = max((seq.kv_len for seq in self._running), default=0)
        self._batch = select_rows(self._batch, keep, width) if keep else None

    def _retire(self, seq: _Sequence, past: DynamicCache, row: int) -> None:
        """Cache what the sequence computed (its generated blocks too) and release its pins."""
        self.cache.insert(seq.tokens[: seq.kv_len], block_reader(past, row, seq.kv_len, self.block_size))
        self.cache.unpin(seq.pinned)
        seq.pinned = []
