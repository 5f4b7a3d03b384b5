"""The built-in engine on a real (small, randomly initialised) Llama: prefix cache, continuous batching,
streaming, sampling, validation and shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import threading
from collections.abc import Awaitable, Callable

import pytest
import torch
from enginefaults import fault
from transformers import LlamaForCausalLM

from planetserve.node.engine.base import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheEvent,
    EngineError,
    EngineFailure,
    EngineLoad,
    EngineOverloaded,
    GenerationRequest,
    TokenChunk,
)
from planetserve.node.engine.builtin import BuiltinEngine, prefill
from planetserve.node.engine.kvcache import PrefixCache, block_hash, block_hashes
from planetserve.node.engine.profile import random_llama, random_prompts
from planetserve.node.home import HomeError, ModelNodeConfig

VOCAB = 512


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return random_llama(vocab_size=VOCAB, hidden_size=64, layers=2, max_len=512, seed=1234)


def serve(model: LlamaForCausalLM, body: Callable[[BuiltinEngine], Awaitable[None]], **options: int) -> None:
    async def main() -> None:
        engine = BuiltinEngine(model, "tiny-llama", **options)
        try:
            await body(engine)
        finally:
            await engine.close()

    asyncio.run(main())


async def chunks(engine: BuiltinEngine, request: GenerationRequest) -> list[TokenChunk]:
    return [chunk async for chunk in engine.generate(request)]


async def tokens(engine: BuiltinEngine, request: GenerationRequest) -> list[int]:
    return [t for chunk in await chunks(engine, request) for t in chunk.token_ids]


def prompts(count: int, length: int, seed: int) -> list[tuple[int, ...]]:
    return random_prompts(count, length, VOCAB, seed=seed)


class Recorder:
    def __init__(self) -> None:
        self.events: list[CacheEvent] = []
        self.lock = threading.Lock()

    def __call__(self, events: list[CacheEvent]) -> None:
        with self.lock:
            self.events.extend(events)

    def stored(self) -> list[int]:
        return [h for e in self.events if isinstance(e, BlockStored) for h in e.block_hashes]

    def removed(self) -> list[int]:
        return [h for e in self.events if isinstance(e, BlockRemoved) for h in e.block_hashes]


def kv(value: float) -> torch.Tensor:
    return torch.full((1, 2, 1, 4, 2), float(value))


# -- block hashes and the cache on its own ----------------------------------------------------------


def test_block_hash_is_stable_and_chained() -> None:
    assert block_hash(None, range(16)) == 245854168195378067  # fixed across processes and platforms
    ids = list(range(40))
    chain = block_hashes(ids, 16)
    assert len(chain) == 2  # the trailing 8 tokens make no block
    assert chain == [block_hash(None, ids[:16]), block_hash(chain[0], ids[16:32])]
    assert block_hashes([99, *ids[1:]], 16)[1] != chain[1]  # a block's hash covers its whole prefix


def test_lru_eviction_is_leaf_first_emits_events_and_spares_pinned_blocks() -> None:
    cache = PrefixCache(block_size=4, capacity_tokens=16)  # four blocks
    rec = Recorder()
    cache.subscribe(rec)
    a, b, c, d = [100 + j for j in range(8)], [200 + j for j in range(8)], [300, 1, 2, 3], [400, 1, 2, 3]
    assert cache.insert(a, kv) == block_hashes(a, 4)
    cache.insert(b, kv)
    cache.flush()
    assert [type(e) for e in rec.events] == [BlockStored, BlockStored]  # one event per chain
    assert rec.events[0] == BlockStored(tuple(block_hashes(a, 4)), None, tuple(a), 4)
    assert len(cache.lookup(a)) == 2  # a is now more recent than b
    rec.events.clear()
    cache.insert(c, kv)
    cache.flush()
    b1, b2 = block_hashes(b, 4)
    assert rec.events == [BlockRemoved((b2,)), BlockStored((block_hash(None, c),), None, tuple(c), 4)]
    assert torch.equal(cache.block(block_hashes(a, 4)[1]).kv, kv(1))
    cache.pin(block_hashes(a, 4))
    cache.insert(d, kv)  # b1 is now the oldest free leaf
    cache.insert([500, 1, 2, 3, 6, 6, 6, 6], kv)  # then c and d; the new chain never loses its own parent
    cache.flush()
    assert rec.removed() == [b2, b1, block_hash(None, c), block_hash(None, d)]
    assert all(h in cache for h in block_hashes(a, 4))
    assert cache.stats.evictions == 4
    assert len(cache) == 4 and cache.nbytes == 4 * kv(0).numel() * 4
    assert cache.insert([600, 1, 2, 3], kv) == [block_hash(None, [600, 1, 2, 3])]
    cache.pin(list(cache))  # everything pinned: nothing can be cached any more
    assert cache.insert([700, 1, 2, 3], kv) == []
    assert not cache.clear()


# -- the engine ------------------------------------------------------------------------------------


def test_prefix_hit_computes_only_the_suffix_and_matches_a_cold_run(model: LlamaForCausalLM) -> None:
    shared, tail_a, tail_b = prompts(3, 48, seed=1)
    first, second = shared + tail_a[:20], shared + tail_b[:15]
    cold: list[int] = []

    async def cold_run(engine: BuiltinEngine) -> None:
        cold.extend(await tokens(engine, GenerationRequest(second, 12)))
        assert engine.stats().prefill_tokens == len(second)

    async def warm_run(engine: BuiltinEngine) -> None:
        await tokens(engine, GenerationRequest(first, 12))
        before = engine.stats()
        out = await chunks(engine, GenerationRequest(second, 12))
        after = engine.stats()
        assert after.prefill_tokens - before.prefill_tokens == len(second) - 48
        assert after.cached_tokens - before.cached_tokens == 48
        assert (out[0].prompt_tokens, out[0].cached_tokens) == (len(second), 48)
        assert after.cache_hits == 1 and after.cache_misses == 1
        assert [t for c in out for t in c.token_ids] == cold

        hit = engine.cache.lookup(second)
        assert len(hit) == 3
        cached = torch.cat([b.kv for b in hit], dim=3)
        with torch.inference_mode():
            cold_logits, cold_kv = prefill(model, second, None)
            warm_logits, _ = prefill(model, second, cached)
        assert torch.allclose(warm_logits, cold_logits, atol=1e-5)
        assert torch.equal(warm_logits.argmax(), cold_logits.argmax())
        for layer, (k, v) in zip(cached, ((lay.keys, lay.values) for lay in cold_kv.layers), strict=True):
            assert torch.allclose(layer[0], k[0, :, :48], atol=1e-5)
            assert torch.allclose(layer[1], v[0, :, :48], atol=1e-5)

        # the generated tokens were cached too: the next turn of the conversation hits past the prompt
        follow_up = (*second, *cold[:-1], 7)
        reply = await chunks(engine, GenerationRequest(follow_up, 1))
        assert reply[0].cached_tokens == len(follow_up) // 16 * 16 > len(second)

    serve(model, cold_run)
    serve(model, warm_run)


def test_a_fully_cached_prompt_still_computes_its_last_token(model: LlamaForCausalLM) -> None:
    prompt = prompts(1, 48, seed=2)[0]

    async def body(engine: BuiltinEngine) -> None:
        first = await tokens(engine, GenerationRequest(prompt, 4))
        before = engine.stats().prefill_tokens
        out = await chunks(engine, GenerationRequest(prompt, 4))
        assert out[0].cached_tokens == 47
        assert engine.stats().prefill_tokens - before == 1
        assert [t for c in out for t in c.token_ids] == first

    serve(model, body)


def test_eviction_under_memory_pressure_spares_running_sequences(model: LlamaForCausalLM) -> None:
    long_prompt, *others = prompts(5, 40, seed=3)
    rec = Recorder()

    async def body(engine: BuiltinEngine) -> None:
        engine.on_cache_events(rec)
        stream = engine.generate(GenerationRequest(long_prompt, 400))
        await anext(stream)
        pinned = block_hashes(long_prompt, 16)
        for prompt in others:
            await tokens(engine, GenerationRequest(prompt, 3))
            assert all(h in engine.cache for h in pinned)
        assert len(engine.cache) <= 4
        stats = engine.stats()
        assert stats.evictions > 0
        evicted = set(rec.removed())
        assert len(evicted) == stats.evictions
        assert evicted.isdisjoint(pinned)
        assert evicted <= set(rec.stored())
        assert {h for p in others[:-1] for h in block_hashes(p, 16)} <= evicted  # oldest went first
        await stream.aclose()

    serve(model, body, cache_capacity_tokens=64)


def test_streaming_yields_one_token_per_chunk_as_it_is_produced(model: LlamaForCausalLM) -> None:
    prompt = prompts(1, 20, seed=4)[0]

    async def body(engine: BuiltinEngine) -> None:
        stream = engine.generate(GenerationRequest(prompt, 400))
        first = await anext(stream)
        assert engine.stats().decode_tokens < 399  # the rest is still being generated
        rest = [c async for c in stream]
        assert (first.prompt_tokens, first.cached_tokens, first.finish_reason) == (20, 0, None)
        assert all(len(c.token_ids) == 1 and c.prompt_tokens == 0 for c in rest)
        assert [c.finish_reason for c in rest] == [None] * 398 + ["length"]

    serve(model, body)


def test_a_stop_id_ends_the_generation(model: LlamaForCausalLM) -> None:
    prompt = prompts(1, 20, seed=5)[0]

    async def body(engine: BuiltinEngine) -> None:
        free = await tokens(engine, GenerationRequest(prompt, 10))
        stop = free[3]
        out = await chunks(engine, GenerationRequest(prompt, 10, stop_ids=(stop,)))
        produced = [t for c in out for t in c.token_ids]
        assert produced == free[: free.index(stop) + 1]
        assert out[-1].finish_reason == "stop"

    serve(model, body)


def test_batched_greedy_equals_one_at_a_time(model: LlamaForCausalLM) -> None:
    g = torch.Generator().manual_seed(6)
    lengths = [5, 17, 33, 48, 61, 7, 90, 31]
    requests = [
        GenerationRequest(tuple(torch.randint(0, VOCAB, (n,), generator=g).tolist()), 10 + 3 * i)
        for i, n in enumerate(lengths)
    ]
    alone: list[list[int]] = []

    async def one_at_a_time(engine: BuiltinEngine) -> None:
        alone.extend([await tokens(engine, r) for r in requests])

    async def together(engine: BuiltinEngine) -> None:
        outputs = await asyncio.gather(*(tokens(engine, r) for r in requests))
        assert outputs == alone
        stats = engine.stats()
        assert stats.steps < stats.decode_tokens / 4  # the decode steps really were batched
        assert engine.load().running == 0

    serve(model, one_at_a_time, max_batch=1)
    serve(model, together, max_batch=8)


def test_sampling_is_reproducible_with_a_seed(model: LlamaForCausalLM) -> None:
    prompt, other = prompts(2, 24, seed=7)

    async def body(engine: BuiltinEngine) -> None:
        def request(seed: int | None) -> GenerationRequest:
            return GenerationRequest(prompt, 16, temperature=1.0, seed=seed)

        alone = await tokens(engine, request(42))
        batched = await asyncio.gather(
            tokens(engine, request(42)), tokens(engine, request(43)), tokens(engine, GenerationRequest(other, 20))
        )
        assert batched[0] == alone
        assert batched[1] != alone
        assert await tokens(engine, request(None)) != await tokens(engine, request(None))
        greedy = await tokens(engine, GenerationRequest(prompt, 16))
        assert alone != greedy

    serve(model, body)


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (GenerationRequest((), 4), "empty prompt"),
        (GenerationRequest((1,) * 500, 13), "exceeds 512"),
        (GenerationRequest((1, 2), 0), "max_tokens"),
        (GenerationRequest((1, VOCAB), 4), "token ids"),
        (GenerationRequest((-1, 2), 4), "token ids"),
        (GenerationRequest((1, 2), 4, temperature=-0.5), "temperature"),
        (GenerationRequest((1, 2), 4, temperature=math.nan), "temperature"),
        (GenerationRequest((1, 2), 4, temperature=1.0, seed=-1), "seed"),
    ],
)
def test_bad_requests_fail_before_the_first_chunk(
    model: LlamaForCausalLM, request_: GenerationRequest, message: str
) -> None:
    async def body(engine: BuiltinEngine) -> None:
        with pytest.raises(EngineError, match=message):
            await anext(engine.generate(request_))
        assert engine.load().queued == 0
        assert len(await tokens(engine, GenerationRequest((1,) * 499, 13))) == 13  # exactly at the limit

    serve(model, body)


def test_close_fails_running_and_queued_requests(model: LlamaForCausalLM) -> None:
    rec = Recorder()

    async def main() -> None:
        engine = BuiltinEngine(model, "tiny-llama", max_batch=1)
        engine.on_cache_events(rec)
        streams = [engine.generate(GenerationRequest(p, 400)) for p in prompts(3, 40, seed=8)]
        await anext(streams[0])
        waiting = [asyncio.ensure_future(anext(s)) for s in streams[1:]]
        await asyncio.sleep(0)
        assert engine.load() == EngineLoad(running=1, queued=2, capacity=1)
        await engine.close()
        with pytest.raises(EngineError, match="closed"):
            async for _ in streams[0]:
                pass
        for pending in waiting:
            with pytest.raises(EngineError, match="closed"):
                await pending
        with pytest.raises(EngineError, match="closed"):
            await anext(engine.generate(GenerationRequest((1, 2), 4)))
        assert len(engine.cache) == 0 and isinstance(rec.events[-1], AllBlocksCleared)
        await engine.close()  # twice is harmless

    asyncio.run(main())


def test_a_consumer_that_goes_away_frees_its_slot_and_blocks(model: LlamaForCausalLM) -> None:
    hog, queued, later = prompts(3, 40, seed=9)

    async def body(engine: BuiltinEngine) -> None:
        stream = engine.generate(GenerationRequest(hog, 400))
        await anext(stream)
        waiting = engine.generate(GenerationRequest(queued, 400))
        task = asyncio.ensure_future(anext(waiting))
        await asyncio.sleep(0)
        assert engine.load().queued == 1
        task.cancel()  # a queued request abandoned before its first chunk
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await waiting.aclose()
        assert engine.load().queued == 0
        await stream.aclose()  # the running one, mid-stream
        out = await asyncio.wait_for(tokens(engine, GenerationRequest(later, 5)), timeout=10)
        assert len(out) == 5
        assert engine.load().running == 0
        assert all(engine.cache.block(h).refs == 0 for h in engine.cache)
        assert engine.stats().decode_tokens < 400

    serve(model, body, max_batch=1)


def test_a_late_listener_first_receives_the_current_cache(model: LlamaForCausalLM) -> None:
    shared, a, b = prompts(3, 32, seed=10)

    def broken(events: list[CacheEvent]) -> None:
        raise RuntimeError("a listener bug")

    async def body(engine: BuiltinEngine) -> None:
        engine.on_cache_events(broken)  # logged; the engine carries on
        await tokens(engine, GenerationRequest(shared + a, 2))
        await tokens(engine, GenerationRequest(shared + b, 2))
        rec = Recorder()
        engine.on_cache_events(rec)
        assert all(isinstance(e, BlockStored) for e in rec.events)
        assert sorted(rec.stored()) == sorted(engine.cache)
        seen: set[int | None] = {None}
        for event in rec.events:  # parents always come first, each chain in one event
            assert event.parent_block_hash in seen
            seen.update(event.block_hashes)
            assert len(event.token_ids) == 16 * len(event.block_hashes)
        assert len(rec.events) == 2  # the first chain, then the branch off its trunk
        count = len(rec.events)
        new = prompts(1, 32, seed=11)[0]
        await tokens(engine, GenerationRequest(new, 2))
        assert rec.events[count:] == [BlockStored(tuple(block_hashes(new, 16)), None, new, 16)]

    serve(model, body)



# -- chunked prefill, failures and memory admission --------------------------------------------------


POISON = VOCAB - 1


def poisoned_prefill(ids: torch.Tensor) -> bool:
    return ids.shape[1] > 1 and bool((ids == POISON).any())


def test_a_chunked_prefill_gives_the_same_tokens_as_one_forward(model: LlamaForCausalLM) -> None:
    long_prompts = prompts(3, 300, seed=12)
    whole: list[list[int]] = []

    async def one_forward(engine: BuiltinEngine) -> None:
        whole.extend([await tokens(engine, GenerationRequest(p, 12)) for p in long_prompts])

    async def chunked(engine: BuiltinEngine) -> None:
        out = await asyncio.gather(*(tokens(engine, GenerationRequest(p, 12)) for p in long_prompts))
        assert out == whole
        assert engine.stats().prefill_tokens == 900  # every prompt position computed exactly once

    serve(model, one_forward, prefill_chunk=512)
    serve(model, chunked, prefill_chunk=37)


@pytest.mark.parametrize(("chunk", "fewest", "most"), [(32, 8, 60), (512, 0, 2)])
def test_a_long_prompt_costs_running_decodes_one_chunk_per_step(
    model: LlamaForCausalLM, chunk: int, fewest: int, most: int
) -> None:
    """Tokens the running request receives while a 480-token prompt is prefilled: about one per chunk
    of 32, where an unchunked prefill lets none through."""
    short, long_ = prompts(1, 8, seed=13)[0], prompts(1, 480, seed=14)[0]
    seen: list[str] = []

    async def body(engine: BuiltinEngine) -> None:
        running = engine.generate(GenerationRequest(short, 60))
        await anext(running)

        async def drain() -> None:
            async for _ in running:
                seen.append("short")

        async def arrive() -> None:
            async for _ in engine.generate(GenerationRequest(long_, 1)):
                seen.append("long")

        await asyncio.gather(drain(), arrive())

    serve(model, body, prefill_chunk=chunk)
    assert fewest <= seen.index("long") <= most


def test_a_failing_request_fails_alone_and_the_engine_keeps_serving(model: LlamaForCausalLM) -> None:
    good = prompts(3, 30, seed=15)
    bad = (*prompts(1, 30, seed=16)[0], POISON)
    alone: list[list[int]] = []

    async def reference(engine: BuiltinEngine) -> None:
        alone.extend([await tokens(engine, GenerationRequest(p, 20)) for p in good])

    async def body(engine: BuiltinEngine) -> None:
        with fault(model, poisoned_prefill):
            results = await asyncio.gather(
                *(tokens(engine, GenerationRequest(p, 20)) for p in [good[0], bad, *good[1:]]),
                return_exceptions=True,
            )
        assert isinstance(results[1], EngineError)
        assert "generation failed" in str(results[1]) and "injected device fault" in str(results[1])
        assert [results[0], *results[2:]] == alone
        assert await tokens(engine, GenerationRequest(bad, 3))  # the same prompt, once the device is well
        assert engine.load() == EngineLoad(running=0, queued=0, capacity=8)
        assert all(engine.cache.block(h).refs == 0 for h in engine.cache)

    serve(model, reference)
    serve(model, body)


def test_a_failed_decode_step_is_retried_request_by_request(model: LlamaForCausalLM) -> None:
    """A decode step that fails is run again for each request on its own: a fault of the whole batch (out
    of memory at its width, say) fails none, and every answer is the one a fault-free engine gives; a
    fault that follows one request fails it alone."""
    first, second, later = prompts(3, 20, seed=17)

    async def body(engine: BuiltinEngine) -> None:
        clean = [await tokens(engine, GenerationRequest(p, 30)) for p in (first, second)]
        culprit = next(t for t in clean[0][2:] if t not in clean[1])  # a token only the first answer holds

        raised: list[int] = []

        def batch_only(hidden: torch.Tensor) -> bool:
            hit = hidden.shape[:2] == (2, 1)
            if hit:
                raised.append(len(hidden))
            return hit

        # failing in the last layer, after the others wrote the step's KV, which the retries must not see
        with fault(model, batch_only, model.model.layers[-1]):
            assert await asyncio.gather(*(tokens(engine, GenerationRequest(p, 30)) for p in (first, second))) == clean
        assert raised and set(raised) == {2}  # every step the two shared failed, and was retried

        def follows_culprit(ids: torch.Tensor) -> bool:
            hit = ids.shape[1] == 1 and culprit in ids[:, 0].tolist()
            if hit:
                raised.append(len(ids))
            return hit

        raised.clear()
        with fault(model, follows_culprit):
            failing, passing = (asyncio.ensure_future(tokens(engine, GenerationRequest(p, 30))) for p in (first, second))
            with pytest.raises(EngineError, match="injected device fault"):
                await failing
            assert await passing == clean[1]
            assert len(await tokens(engine, GenerationRequest(later, 10))) == 10
        assert raised == [2, 1]  # the batch's step, then the culprit's own

    serve(model, body)


def test_kv_memory_is_reserved_at_admission_and_refused_when_it_cannot_fit(model: LlamaForCausalLM) -> None:
    a, b, c = prompts(3, 60, seed=18)
    peak: list[EngineLoad] = []

    async def body(engine: BuiltinEngine) -> None:
        with pytest.raises(EngineError, match=r"needs more KV memory than this engine has \(200 positions\)"):
            await anext(engine.generate(GenerationRequest(a, 141)))

        async def one(prompt: tuple[int, ...]) -> int:
            count = 0
            async for _ in engine.generate(GenerationRequest(prompt, 40)):
                peak.append(engine.load())
                count += 1
            return count

        assert await asyncio.gather(*(one(p) for p in (a, b, c))) == [40, 40, 40]
        assert max(load.running for load in peak) == 2  # 3 x 100 positions would not fit in 200
        assert any(load.queued == 1 for load in peak)

    serve(model, body, kv_budget_tokens=200)


def test_a_full_queue_is_refused_as_overloaded(model: LlamaForCausalLM) -> None:
    hog, waiting, refused = prompts(3, 20, seed=19)

    async def body(engine: BuiltinEngine) -> None:
        with fault(model, lambda ids: False) as paused:
            running = engine.generate(GenerationRequest(hog, 30))
            await anext(running)
            paused.gate.clear()  # the engine stalls inside its next forward
            queued = asyncio.ensure_future(tokens(engine, GenerationRequest(waiting, 5)))
            await asyncio.sleep(0.05)
            assert engine.load().queued == 1
            with pytest.raises(EngineOverloaded, match="1 requests are already waiting"):
                await anext(engine.generate(GenerationRequest(refused, 5)))
            paused.gate.set()
            assert len([c async for c in running]) == 29
            assert len(await queued) == 5

    serve(model, body, max_batch=1, max_queue=1)


def test_prompts_are_scored_one_at_a_time_and_a_full_wait_is_refused(model: LlamaForCausalLM) -> None:
    """`prompt_logprobs` passes hold a prompt's logits over the whole vocabulary outside the batch's KV
    budget: one runs at a time, `max_queue` wait, more are refused, and a caller that leaves does not
    free its pass's place while the pass still runs. A pass the device fails fails alone."""
    first, second, third = prompts(3, 20, seed=23)

    async def body(engine: BuiltinEngine) -> None:
        with fault(model, lambda ids: ids.shape[1] == len(first) + 1) as paused:
            paused.gate.clear()  # the first pass stalls inside its forward
            running = asyncio.ensure_future(engine.prompt_logprobs(first, 1))
            await asyncio.sleep(0.1)
            waiting = asyncio.ensure_future(engine.prompt_logprobs(second, 1))
            await asyncio.sleep(0.05)
            with pytest.raises(EngineOverloaded, match="1 prompts already wait to be scored"):
                await engine.prompt_logprobs(third, 1)
            running.cancel()
            await asyncio.sleep(0.1)
            assert not waiting.done() and engine.stats().prompts_scored == 1
            paused.gate.set()
            assert len(await waiting) == len(second)
            assert engine.stats().prompts_scored == 2
            with pytest.raises(EngineFailure, match="injected device fault"):
                await engine.prompt_logprobs((*first, 1), 1)
            assert len(await tokens(engine, GenerationRequest(third, 3))) == 3

    serve(model, body, max_queue=1)


def test_the_node_home_sizes_the_engines_prefill_chunk_and_kv_budget(tmp_path) -> None:
    config = ModelNodeConfig(org_id="acme", model_id="m", prefill_chunk=128, kv_budget_tokens=4096)
    config.save(tmp_path)
    loaded = ModelNodeConfig.load(tmp_path)
    assert (loaded.prefill_chunk, loaded.kv_budget_tokens) == (128, 4096)
    raw = json.loads((tmp_path / "node.json").read_text())
    for bad in ({"prefill_chunk": 0}, {"kv_budget_tokens": -1}):
        (tmp_path / "node.json").write_text(json.dumps({**raw, **bad}))
        with pytest.raises(HomeError, match="prefill_chunk must be >= 1 and kv_budget_tokens >= 0"):
            ModelNodeConfig.load(tmp_path)
    with pytest.raises(ValueError, match="prefill_chunk and max_queue must be >= 1"):
        BuiltinEngine(random_llama(), "m", prefill_chunk=0)
