"""Measured costs of the built-in engine, for benchmarks and for calibrating a serving simulator.

`measure_costs` times the engine's own forward paths (prefill, batched decode step) without the
scheduler; `prefix_hit_ttft`, `decode_throughput` and `prefill_stall` go through a running BuiltinEngine
end to end. `sized_llama` builds a model of a published size from its configuration alone, with random
weights: what latency, throughput and cache behaviour depend on, with nothing to download.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from planetserve.node.engine.base import GenerationRequest, TokenChunk
from planetserve.node.engine.builtin import BuiltinEngine, decode_step, merge_batches, prefill


def random_llama(
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    max_len: int = 2048,
    seed: int = 0,
) -> LlamaForCausalLM:
    """A randomly initialised Llama, the same for the same arguments, without touching the global RNG."""
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 8 // 3,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_len,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config).eval()


@dataclass(frozen=True)
class Shape:
    """The dimensions of a published decoder, as its Hugging Face config gives them."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int


SHAPES = {
    "0.5b": Shape(hidden=896, layers=24, heads=14, kv_heads=2, ffn=4864, vocab=151936),  # Qwen2.5-0.5B
    "1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=128256),  # Llama-3.2-1B
    "3b": Shape(hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192, vocab=128256),  # Llama-3.2-3B
    "8b": Shape(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256),  # Llama-3.1-8B
}


def sized_llama(
    shape: str, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
    max_len: int = 8192, seed: int = 0, vocab: int | None = None,
) -> LlamaForCausalLM:
    """A Llama of `shape`'s dimensions with random weights, built directly on `device` in `dtype` (an 8B
    model never passes through host memory) and using PyTorch's SDPA attention. `vocab` replaces the
    shape's vocabulary, for a model that must speak another tokenizer's ids."""
    dims = SHAPES[shape]
    config = LlamaConfig(
        vocab_size=vocab or dims.vocab, hidden_size=dims.hidden, intermediate_size=dims.ffn,
        num_hidden_layers=dims.layers, num_attention_heads=dims.heads, num_key_value_heads=dims.kv_heads,
        max_position_embeddings=max_len, attn_implementation="sdpa",
    )
    default = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        torch.set_default_dtype(dtype)
        try:
            return LlamaForCausalLM(config).eval()
        finally:
            torch.set_default_dtype(default)


def params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def random_prompts(count: int, length: int, vocab_size: int, seed: int = 0) -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(0, vocab_size, (length,), generator=g).tolist()) for _ in range(count)]


def _warm_up(model: PreTrainedModel) -> None:
    """One forward first, so the first timed one does not pay for lazy initialisation."""
    with torch.inference_mode():
        prefill(model, (0,) * 8, None)


def _sync(model: PreTrainedModel) -> None:
    """Wait for queued GPU work, which would otherwise escape the timer."""
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def _median_seconds(model: PreTrainedModel, fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        _sync(model)
        t0 = time.perf_counter()
        fn()
        _sync(model)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_costs(
    model: PreTrainedModel,
    *,
    prompt_lens: Sequence[int] = (128, 512),
    batch_sizes: Sequence[int] = (1, 4, 8),
    context: int = 256,
    decode_steps: int = 16,
    repeats: int = 3,
) -> dict[str, dict[int, float]]:
    """Milliseconds per token: `prefill_ms_per_token[L]` for an uncached prompt of L tokens,
    `decode_ms_per_step[b]` and `decode_ms_per_token[b]` for a decode step over b sequences of about
    `context` tokens."""
    vocab = model.get_input_embeddings().num_embeddings
    costs: dict[str, dict[int, float]] = {
        "prefill_ms_per_token": {}, "decode_ms_per_step": {}, "decode_ms_per_token": {}
    }
    _warm_up(model)
    with torch.inference_mode():
        for length in prompt_lens:
            prompt = random_prompts(1, length, vocab, seed=length)[0]
            seconds = _median_seconds(model, lambda p=prompt: prefill(model, p, None), repeats)
            costs["prefill_ms_per_token"][length] = 1000 * seconds / length
        for batch in batch_sizes:
            prompts = random_prompts(batch, context, vocab, seed=batch)
            last = torch.zeros(batch, dtype=torch.long, device=model.device)
            times = []
            for _ in range(repeats):
                past = merge_batches([prefill(model, p, None)[1] for p in prompts])
                _sync(model)
                t0 = time.perf_counter()
                for step in range(decode_steps):
                    decode_step(model, past, last, torch.full_like(last, context + step))
                _sync(model)
                times.append(time.perf_counter() - t0)
            seconds = statistics.median(times) / decode_steps
            costs["decode_ms_per_step"][batch] = 1000 * seconds
            costs["decode_ms_per_token"][batch] = 1000 * seconds / batch
    return costs


async def _first_chunk_seconds(engine: BuiltinEngine, prompt: tuple[int, ...]) -> float:
    t0 = time.perf_counter()
    async for _ in engine.generate(GenerationRequest(prompt, max_tokens=1)):
        break
    return time.perf_counter() - t0


def prefix_hit_ttft(
    model: PreTrainedModel, prompt_lens: Sequence[int], *, shared: float = 0.75, repeats: int = 3,
    block_size: int = 16,
) -> list[dict[str, float]]:
    """Time to first token of a prompt on a cold engine and on one that already served another prompt
    sharing its first `shared` fraction; medians over `repeats` fresh prompt pairs."""
    vocab = model.get_input_embeddings().num_embeddings

    async def one(length: int, seed: int) -> tuple[float, float, int]:
        first, second = random_prompts(2, length, vocab, seed=seed)
        prompt = first[: int(length * shared)] + second[int(length * shared) :]
        cold = BuiltinEngine(model, "profile", block_size=block_size, cache_capacity_tokens=4 * length)
        warm = BuiltinEngine(model, "profile", block_size=block_size, cache_capacity_tokens=4 * length)
        try:
            cold_s = await _first_chunk_seconds(cold, prompt)
            await _first_chunk_seconds(warm, first)
            before = warm.stats().prefill_tokens
            warm_s = await _first_chunk_seconds(warm, prompt)
            return cold_s, warm_s, warm.stats().prefill_tokens - before
        finally:
            await cold.close()
            await warm.close()

    _warm_up(model)
    rows = []
    for length in prompt_lens:
        asyncio.run(one(length, repeats))  # unrecorded: a GPU plans kernels for each new shape once
        runs = [asyncio.run(one(length, seed)) for seed in range(repeats)]
        rows.append({
            "prompt_tokens": length,
            "computed_on_hit": runs[0][2],
            "cold_ms": 1000 * statistics.median(r[0] for r in runs),
            "hit_ms": 1000 * statistics.median(r[1] for r in runs),
        })
    return rows


def decode_throughput(
    model: PreTrainedModel, batch_sizes: Sequence[int], *, prompt_len: int = 32, new_tokens: int = 64,
    sequential_up_to: int | None = None,
) -> list[dict[str, float]]:
    """Generated tokens per second for `b` concurrent requests against the same requests one at a time
    (the latter only up to `sequential_up_to` requests, where it is given: it is the slow baseline)."""
    vocab = model.get_input_embeddings().num_embeddings

    async def generate(engine: BuiltinEngine, prompt: tuple[int, ...]) -> int:
        count = 0
        async for chunk in engine.generate(GenerationRequest(prompt, max_tokens=new_tokens)):
            count += len(chunk.token_ids)
        return count

    async def tokens_per_second(batch: int, concurrent: bool) -> float:
        prompts = random_prompts(batch, prompt_len, vocab, seed=batch)
        engine = BuiltinEngine(model, "profile", max_batch=batch)
        try:
            t0 = time.perf_counter()
            if concurrent:
                made = sum(await asyncio.gather(*(generate(engine, p) for p in prompts)))
            else:
                made = sum([await generate(engine, p) for p in prompts])
            return made / (time.perf_counter() - t0)
        finally:
            await engine.close()

    _warm_up(model)
    rows = []
    for batch in batch_sizes:
        asyncio.run(tokens_per_second(batch, True))  # unrecorded, as above
        concurrent = asyncio.run(tokens_per_second(batch, True))
        baseline = sequential_up_to is None or batch <= sequential_up_to
        sequential = asyncio.run(tokens_per_second(batch, False)) if baseline else float("nan")
        rows.append({"batch": batch, "batched_tok_s": concurrent, "sequential_tok_s": sequential})
    return rows


def prefill_stall(
    model: PreTrainedModel, *, long_len: int, chunk: int, running: int = 4, prompt_len: int = 32,
) -> dict[str, float]:
    """What a long prompt's arrival costs `running` decoding requests: the longest gap between two of
    their tokens while it is prefilled `chunk` tokens per step, and its own time to first token."""
    vocab = model.get_input_embeddings().num_embeddings
    short = random_prompts(running, prompt_len, vocab, seed=running)
    long_prompt = random_prompts(1, long_len, vocab, seed=long_len)[0]

    async def main() -> dict[str, float]:
        engine = BuiltinEngine(model, "profile", max_batch=running + 1, prefill_chunk=chunk,
                               max_model_len=max(long_len, prompt_len + 1024) + 1)
        done = asyncio.Event()

        async def watch(stream: AsyncIterator[TokenChunk]) -> list[float]:
            """Arrival times of a running request's tokens, up to one after the long prompt's first."""
            times = []
            async for _ in stream:
                times.append(time.perf_counter())
                if done.is_set():
                    break
            await stream.aclose()
            return times

        try:
            streams = [engine.generate(GenerationRequest(p, max_tokens=1024)) for p in short]
            for stream in streams:
                await anext(stream)
            watchers = [asyncio.ensure_future(watch(s)) for s in streams]
            await asyncio.sleep(0.2)
            t0 = time.perf_counter()
            ttft = await _first_chunk_seconds(engine, long_prompt)
            t1 = time.perf_counter()
            done.set()
            arrivals = await asyncio.gather(*watchers)
        finally:
            await engine.close()
        gaps = [b - a for times in arrivals for a, b in itertools.pairwise(times) if b > t0 and a < t1]
        return {"long_tokens": long_len, "chunk": chunk, "long_ttft_ms": 1000 * ttft,
                "longest_gap_ms": 1000 * max(gaps, default=0.0)}

    asyncio.run(main())  # unrecorded: a GPU plans kernels for each new shape once
    return asyncio.run(main())
