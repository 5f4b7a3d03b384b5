"""planetserve's sampling inside vLLM, without vLLM: the batched noise and noised logits against the
per-row specification (planetserve.sampling) for mixed batches in float32, float16 and bfloat16; the
processor's row table following vLLM's batch updates (adds, removes, one-way moves, swaps, recycled
slots, preemption) through a simulated persistent batch whose greedy argmax must give every request
exactly the tokens `sample` gives it alone; what validate_params refuses; and the remote engine's
requests as a real local HTTP server receives them, checked by the processor's own validation."""

from __future__ import annotations

import ast
import json
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import Enum, auto
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp import web
from test_remote_engine import sse_body, vllm_chunk
from waiting import run

import planetserve
from planetserve import sampling
from planetserve.node.engine.base import GenerationRequest, TokenChunk
from planetserve.node.engine.remote import RemoteEngine, RemoteEngineError
from planetserve.node.engine.vllm_sampling import (
    XARG_SEED,
    XARG_TEMPERATURE,
    XARG_TOP_P,
    RowTable,
    check_params,
    protocol_decoding,
    refusals,
)
from planetserve.node.home import HomeError, ModelNodeConfig
from planetserve.sampling import (
    SEED_LIMIT,
    VECTORS,
    gumbel_row,
    gumbel_rows,
    noise_rows_,
    noised_logits,
    sample,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# -- the batched core --------------------------------------------------------------------------------


def test_the_batched_noise_is_the_per_row_noise_bit_for_bit():
    seeds = [seed for seed, _, _, _ in VECTORS] + [7, 7, 2**63, 123456789]
    positions = [position for _, position, _, _ in VECTORS] + [0, 1, 5, 2**40]
    rows = gumbel_rows(seeds, positions, 12_400)
    assert rows.dtype == torch.float64 and rows.shape == (len(seeds), 12_400)
    for r, (seed, position) in enumerate(zip(seeds, positions, strict=True)):
        assert torch.equal(rows[r], gumbel_row(seed, position, 12_400))
    for r, (_, _, token, value) in enumerate(VECTORS):
        assert rows[r, token].item() == value
    with pytest.raises(ValueError, match="seed must lie in"):
        gumbel_rows([SEED_LIMIT], [0], 4)


def mixed_batch(dtype: torch.dtype, rows: int = 48, vocab: int = 3_000, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=generator) * 3).to(dtype)
    rng = random.Random(seed)
    temperatures = [rng.choice([0.0, 0.0, 0.25, 0.7, 1.0, 1.3, 2.0]) for _ in range(rows)]
    seeds = [rng.randrange(SEED_LIMIT) for _ in range(rows)]
    positions = [rng.randrange(4096) for _ in range(rows)]
    return logits, temperatures, seeds, positions


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_noised_logits_pick_what_the_specification_picks_in_a_mixed_batch(dtype):
    logits, temperatures, seeds, positions = mixed_batch(dtype)
    before = logits.clone()
    out = noised_logits(logits, temperatures, seeds, positions)
    assert out.dtype == dtype and out.shape == logits.shape and torch.equal(logits, before)
    picked = out.argmax(-1).tolist()
    for b, (t, seed, position) in enumerate(zip(temperatures, seeds, positions, strict=True)):
        assert picked[b] == sample(logits[b], t, seed, position), b
        if t == 0:
            assert torch.equal(out[b], logits[b])  # greedy rows untouched
        else:
            expected = (logits[b].double() / t + gumbel_row(seed, position, logits.shape[1])).to(dtype)
            others = torch.arange(logits.shape[1]) != picked[b]
            assert torch.equal(out[b][others], expected[others])  # logits / T + g, in the logits' dtype
    assert 0 < sum(t > 0 for t in temperatures) < len(temperatures)


def near_tie(dtype: torch.dtype, vocab: int = 64):
    """A row whose float64 winner (token 1) beats token 0 by 1e-9: below a unit in the last place of
    every dtype here, so a plain cast of the noised logits would hand the argmax to token 0."""
    for seed in range(1000):
        g = gumbel_row(seed, 3, vocab)
        if 1.0 < g[0] - g[1] < 9.0:
            break
    temperature = 2.0 / (g[0] - g[1] + 1e-9).item()  # 3/T + g1 = 1/T + g0 + 1e-9
    logits = torch.full((vocab,), -60.0)
    logits[0], logits[1] = 1.0, 3.0
    return logits.to(dtype), temperature, seed, 3


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_near_tie_that_rounding_would_flip_keeps_the_specifications_winner(dtype):
    logits, temperature, seed, position = near_tie(dtype)
    assert sample(logits, temperature, seed, position) == 1
    noise = gumbel_row(seed, position, logits.shape[0])
    assert int((logits.double() / temperature + noise).to(dtype).argmax()) == 0  # what a plain cast picks
    batch = torch.stack([logits, logits])
    out = noised_logits(batch, [temperature, 0.0], [seed, seed], [position, position])
    assert out.argmax(-1).tolist() == [1, int(logits.argmax())]


def test_chunks_of_the_batch_give_the_same_logits(monkeypatch):
    logits, temperatures, seeds, positions = mixed_batch(torch.float32, rows=20, vocab=1_000, seed=5)
    whole = noised_logits(logits, temperatures, seeds, positions)
    monkeypatch.setattr(sampling, "CHUNK_ELEMENTS", 2_500)  # two rows at a time
    assert torch.equal(noised_logits(logits, temperatures, seeds, positions), whole)


def test_noised_logits_refuse_what_they_cannot_compute():
    logits = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="as many temperatures"):
        noised_logits(logits, [1.0], [0, 0], [0, 0])
    with pytest.raises(ValueError, match="finite and at least 0"):
        noised_logits(logits, [1.0, -0.5], [0, 0], [0, 0])
    with pytest.raises(ValueError, match=r"\[batch, vocab\]"):
        noised_logits(logits[0], [1.0], [0], [0])
    assert torch.equal(noised_logits(logits, [0.0, 0.0], [0, 0], [0, 0]), logits)
    with pytest.raises(ValueError, match=r"rows must lie in \[0, 2\)"):
        noise_rows_(logits, [2], [1.0], [0], [0])


def test_noise_rows_works_in_place_on_the_rows_named():
    logits, temperatures, seeds, positions = mixed_batch(torch.float32, rows=10, vocab=800, seed=9)
    expected = noised_logits(logits, temperatures, seeds, positions)
    rows = [7, 2, 5]  # any order; rows not named stay as they are
    work = logits.clone()
    assert noise_rows_(work, rows, [temperatures[r] for r in rows], [seeds[r] for r in rows],
                       [positions[r] for r in rows]) is work
    for r in range(10):
        assert torch.equal(work[r], expected[r] if r in rows else logits[r])


# -- vLLM's inputs, shaped as vLLM shapes them (vllm/v1/sample/logits_processor/interface.py) ----------


class MoveDirectionality(Enum):
    UNIDIRECTIONAL = auto()
    SWAP = auto()


@dataclass(frozen=True)
class BatchUpdate:
    batch_size: int
    removed: list[int]
    added: list[tuple[int, Any, list[int] | None, list[int]]]
    moved: list[tuple[int, int, MoveDirectionality]]


@dataclass
class SamplingParams:
    """The fields of vLLM's SamplingParams that the processor reads, with vLLM's defaults."""

    temperature: float = 1.0
    extra_args: dict[str, Any] | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: Any = None
    logprobs: int | None = None


def protocol(temperature: float, seed: int, top_p: float | None = None, **others: Any) -> SamplingParams:
    """What vLLM's server makes of a model node's request: temperature 0, the protocol in extra_args."""
    extra = {XARG_TEMPERATURE: temperature, XARG_SEED: seed, **({} if top_p is None else {XARG_TOP_P: top_p})}
    return SamplingParams(temperature=0.0, extra_args=extra, **others)


def test_the_row_table_follows_adds_removes_moves_and_reads_positions_from_live_output_lists():
    table = RowTable()
    outputs = {name: [] for name in "ABCDE"}
    table.update(BatchUpdate(4, [], [
        (0, protocol(0.7, 11), [1, 2], outputs["A"]),
        (1, SamplingParams(temperature=0.0), [1], outputs["B"]),  # greedy, no protocol: untouched
        (2, protocol(0.0, 33), [1], outputs["C"]),  # the protocol at temperature 0: plain argmax
        (3, protocol(1.0, SEED_LIMIT - 1, top_p=0.9), None, outputs["D"]),
    ], []))
    assert table.batch() == ([0, 3], [0.7, 1.0], [11, SEED_LIMIT - 1], [0, 0], [1.0, 0.9])
    outputs["A"] += [5, 6]
    outputs["D"] += [7]
    table.update(None)  # new tokens, same batch: positions follow vLLM's lists
    assert table.batch()[3] == [2, 1]

    # B finishes; E takes its slot; A is preempted (removed) and D condensed into slot 0
    table.update(BatchUpdate(3, [0], [(1, protocol(1.3, 55), [9], outputs["E"])],
                             [(3, 0, MoveDirectionality.UNIDIRECTIONAL)]))
    assert table.batch() == ([0, 1], [1.0, 1.3], [SEED_LIMIT - 1, 55], [1, 0], [0.9, 1.0])

    # A resumes with the tokens it had (its live list), in the free slot 3; then E and A swap
    table.update(BatchUpdate(4, [], [(3, protocol(0.7, 11), [1, 2], outputs["A"])],
                             [(1, 3, MoveDirectionality.SWAP)]))
    assert table.batch() == ([0, 1, 3], [1.0, 0.7, 1.3], [SEED_LIMIT - 1, 11, 55], [1, 2, 0], [0.9, 1.0, 1.0])

    # a swap with an untracked slot moves the row and leaves nothing behind; a recycled slot forgets
    table.update(BatchUpdate(4, [], [(3, SamplingParams(), [4], outputs["B"])],
                             [(0, 2, MoveDirectionality.SWAP)]))
    assert table.batch() == ([1, 2], [0.7, 1.0], [11, SEED_LIMIT - 1], [2, 1], [1.0, 0.9])

    with pytest.raises(RuntimeError, match="outside a batch of 2"):
        table.update(BatchUpdate(2, [], [], []))


def fake_model(request_id: int, position: int, vocab: int) -> torch.Tensor:
    """A deterministic stand-in for a model's next-token logits for one request at one position."""
    return torch.randn(vocab, generator=torch.Generator().manual_seed(request_id * 10_007 + position)) * 2


@dataclass
class Request:
    rid: int
    params: SamplingParams
    length: int
    output: list[int] = field(default_factory=list)


def test_a_simulated_vllm_batch_gives_every_request_the_tokens_sample_gives_it_alone():
    """vLLM's persistent batch played step by step: requests arrive, take the lowest free slots, finish or
    are preempted (and resume later with their output so far), holes are condensed by one-way moves and
    rows are swapped now and then; the logits of every step go through the table, then vLLM's greedy
    argmax. Each request must get what `sample` gives it position by position, alone."""
    rng, vocab = random.Random(3), 500
    kinds = [lambda: protocol(rng.choice([0.5, 0.8, 1.0, 1.7]), rng.randrange(SEED_LIMIT)),
             lambda: protocol(rng.choice([0.7, 1.0]), rng.randrange(SEED_LIMIT), top_p=rng.choice([0.5, 0.9])),
             lambda: protocol(0.0, rng.randrange(SEED_LIMIT)), lambda: SamplingParams(temperature=0.0)]
    waiting = [Request(i, rng.choice(kinds)(), rng.randrange(1, 12)) for i in range(40)]
    requests = list(waiting)
    slots: list[Request | None] = []
    table = RowTable()
    steps, seen = 0, {"resumed": 0, "condensed": 0, "swapped": 0, "recycled": 0}
    while waiting or any(slots):
        steps += 1
        removed = []
        for s, request in enumerate(slots):
            if request is not None and (len(request.output) >= request.length or rng.random() < 0.08):
                if len(request.output) < request.length:
                    waiting.append(request)  # preempted: it comes back with its output so far
                slots[s] = None
                removed.append(s)
        added = []
        for _ in range(rng.randrange(0, 4)):
            if not waiting:
                break
            request = waiting.pop(0)
            free = [s for s, r in enumerate(slots) if r is None]
            s = free[0] if free else len(slots)
            if s == len(slots):
                slots.append(None)
            slots[s] = request
            if s in removed:
                removed.remove(s)  # vLLM reuses a removed slot and reports only the add
                seen["recycled"] += 1
            seen["resumed"] += bool(request.output)
            added.append((s, request.params, None, request.output))
        moved = []
        while None in slots:  # condense: the last request fills the first hole
            hole = slots.index(None)
            while slots and slots[-1] is None:
                slots.pop()
            if hole >= len(slots):
                break
            moved.append((len(slots) - 1, hole, MoveDirectionality.UNIDIRECTIONAL))
            seen["condensed"] += 1
            slots[hole] = slots.pop()
        if len(slots) >= 2 and rng.random() < 0.3:
            a, b = rng.sample(range(len(slots)), 2)
            slots[a], slots[b] = slots[b], slots[a]
            moved.append((a, b, MoveDirectionality.SWAP))
            seen["swapped"] += 1
        update = BatchUpdate(len(slots), removed, added, moved) if (removed or added or moved) else None
        table.update(update)
        if not slots:
            continue
        logits = torch.stack([fake_model(r.rid, len(r.output), vocab) for r in slots])
        for request, token in zip(slots, table.apply(logits).argmax(-1).tolist(), strict=True):
            request.output.append(token)
        assert steps < 2_000
    for request in requests:
        extra = request.params.extra_args or {XARG_TEMPERATURE: 0.0, XARG_SEED: 0}
        expected = [sample(fake_model(request.rid, i, vocab), extra[XARG_TEMPERATURE], extra[XARG_SEED], i,
                           extra.get(XARG_TOP_P, 1.0))
                    for i in range(request.length)]
        assert request.output == expected, request.rid
    assert sum(1 for r in requests if r.params.extra_args and r.params.extra_args[XARG_TEMPERATURE] > 0) > 10
    assert min(seen.values()) >= 3, seen


def test_apply_refuses_rows_outside_the_logits():
    table = RowTable()
    table.update(BatchUpdate(3, [], [(2, protocol(1.0, 1), None, [])], []))
    with pytest.raises(RuntimeError, match="outside logits of 2 rows"):
        table.apply(torch.zeros(2, 8))


# -- validate_params -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("others", "named"), [
    ({"presence_penalty": 0.5}, "presence_penalty=0.5: vLLM applies penalties after this processor"),
    ({"frequency_penalty": -0.2}, "frequency_penalty=-0.2"),
    ({"repetition_penalty": 1.1}, "repetition_penalty=1.1"),
    ({"top_p": 0.9}, "top_p=0.9: send it as planetserve_top_p, which this processor applies"),
    ({"top_k": 40}, "top_k=40"),
    ({"min_p": 0.05}, "min_p=0.05"),
    ({"min_tokens": 4}, "min_tokens=4: it hides the stop tokens"),
    ({"logit_bias": {5: 2.0}}, "logit_bias={5: 2.0}"),
    ({"allowed_token_ids": [1, 2]}, "allowed_token_ids=[1, 2]"),
    ({"bad_words": ["x"]}, "bad_words=['x']"),
    ({"structured_outputs": {"json": {}}}, "structured_outputs="),
    ({"n": 2}, "n=2: every answer would share one seed"),
    ({"temperature": 0.7}, "temperature=0.7: send temperature 0"),
])
def test_validate_params_refuses_what_cannot_go_with_the_protocol(others, named):
    params = protocol(0.7, 1)
    for name, value in others.items():
        setattr(params, name, value)
    with pytest.raises(ValueError, match="planetserve sampling") as caught:
        check_params(params)
    assert named in str(caught.value)


def test_validate_params_lets_through_what_the_protocol_leaves_alone():
    check_params(protocol(0.7, 1))
    check_params(protocol(0.0, 0, top_k=-1, logit_bias={}, bad_words=[], logprobs=5))
    # requests without the protocol's arguments are vLLM's business, penalties and all
    check_params(SamplingParams(temperature=0.9, top_p=0.5, repetition_penalty=1.3))
    check_params(SamplingParams(extra_args={"other_extension": 1}))
    params = protocol(0.7, 1, top_k=5, repetition_penalty=1.2)
    params.temperature = 1.0
    assert len(refusals(params)) == 3


@pytest.mark.parametrize(("extra", "message"), [
    ({XARG_TEMPERATURE: 0.7}, "planetserve_seed is missing"),
    ({XARG_SEED: 3}, "planetserve_temperature is missing"),
    ({XARG_TEMPERATURE: 0.7, XARG_SEED: -1}, r"integer in \[0, 2\*\*64\)"),
    ({XARG_TEMPERATURE: 0.7, XARG_SEED: SEED_LIMIT}, r"integer in \[0, 2\*\*64\)"),
    ({XARG_TEMPERATURE: 0.7, XARG_SEED: 1.0}, r"integer in \[0, 2\*\*64\)"),
    ({XARG_TEMPERATURE: 0.7, XARG_SEED: "12"}, r"integer in \[0, 2\*\*64\)"),
    ({XARG_TEMPERATURE: 0.7, XARG_SEED: True}, r"integer in \[0, 2\*\*64\)"),
    ({XARG_TEMPERATURE: -0.1, XARG_SEED: 1}, "finite number of at least 0"),
    ({XARG_TEMPERATURE: float("nan"), XARG_SEED: 1}, "finite number of at least 0"),
    ({XARG_TEMPERATURE: "hot", XARG_SEED: 1}, "finite number of at least 0"),
    ({XARG_TEMPERATURE: 0.7, XARG_SEED: 1, XARG_TOP_P: 1.5}, r"planetserve_top_p must be a number in \[0, 1\]"),
    ({XARG_TEMPERATURE: 0.7, XARG_SEED: 1, XARG_TOP_P: True}, r"planetserve_top_p must be a number in \[0, 1\]"),
])
def test_malformed_protocol_arguments_are_refused(extra, message):
    with pytest.raises(ValueError, match=message):
        check_params(SamplingParams(temperature=0.0, extra_args=extra))
    with pytest.raises(ValueError, match=message):
        protocol_decoding(extra)


def test_only_the_processor_module_imports_vllm_and_nothing_imports_it():
    """planetserve installs and runs without vLLM: vLLM loads the processor, planetserve never does."""
    package = Path(planetserve.__file__).parent
    importers: dict[str, set[str]] = {}
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                importers.setdefault(name.split(".")[0], set()).add(path.name)
                if name.startswith("planetserve.node.engine.vllm_processor"):
                    importers.setdefault("processor", set()).add(path.name)
    assert importers["vllm"] == {"vllm_processor.py"}
    assert "processor" not in importers


# -- the remote engine's requests, as a real local HTTP server receives them -----------------------------


def params_from(body: dict[str, Any]) -> SamplingParams:
    """The fields the processor reads, as vLLM's OpenAI server fills SamplingParams from a completion
    request (vllm_xargs becomes extra_args)."""
    return SamplingParams(
        temperature=body.get("temperature", 1.0), extra_args=body.get("vllm_xargs"), n=body.get("n", 1),
        presence_penalty=body.get("presence_penalty", 0.0), frequency_penalty=body.get("frequency_penalty", 0.0),
        repetition_penalty=body.get("repetition_penalty", 1.0), top_p=body.get("top_p", 1.0),
        top_k=body.get("top_k", 0), min_p=body.get("min_p", 0.0), min_tokens=body.get("min_tokens", 0),
        logit_bias=body.get("logit_bias"), allowed_token_ids=body.get("allowed_token_ids"),
        bad_words=body.get("bad_words"))


def with_server(processor: bool, body: Callable[[str, list[dict[str, Any]]], Awaitable[None]]) -> None:
    """An OpenAI-compatible server on a free local port that records every completion request and, like
    `vllm serve` with (`processor`) or without planetserve's logits processor, refuses with vLLM's 400
    what validate_params refuses, else streams two tokens."""
    seen: list[dict[str, Any]] = []

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model", "max_model_len": 64}]})

    async def completions(request: web.Request) -> web.Response:
        payload = await request.json()
        seen.append(payload)
        if processor:
            try:
                check_params(params_from(payload))
            except ValueError as exc:
                return web.json_response({"error": {"message": str(exc), "type": "BadRequestError",
                                                    "param": None, "code": 400}}, status=400)
        data = sse_body(vllm_chunk([5], prompt=payload["prompt"]), vllm_chunk([6], "length"), b"[DONE]")
        return web.Response(body=data, content_type="text/event-stream")

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        try:
            await body(f"http://127.0.0.1:{runner.addresses[0][1]}", seen)
        finally:
            await runner.cleanup()

    run(main(), 60)


async def tokens(engine: RemoteEngine, request: GenerationRequest) -> list[TokenChunk]:
    return [chunk async for chunk in engine.generate(request)]


def test_a_sampled_request_reaches_vllm_at_temperature_0_with_the_protocol_in_vllm_xargs():
    async def body(url: str, seen: list[dict[str, Any]]) -> None:
        engine = await RemoteEngine.connect(url, vllm_processor=True)
        try:
            assert seen[0]["vllm_xargs"] == {XARG_TEMPERATURE: 1.0, XARG_SEED: -1}  # the check at connect
            sampled = GenerationRequest((1, 2, 3), 2, temperature=0.7, seed=SEED_LIMIT - 1, stop_ids=(9,))
            assert await tokens(engine, sampled) == [TokenChunk((5,), None, 3, 0), TokenChunk((6,), "length", 3, 0)]
            sent = seen[-1]
            assert sent["temperature"] == 0.0 and "seed" not in sent
            assert sent["vllm_xargs"] == {XARG_TEMPERATURE: 0.7, XARG_SEED: SEED_LIMIT - 1}
            assert (sent["top_p"], sent["top_k"], sent["min_p"], sent["repetition_penalty"]) == (1.0, -1, 0.0, 1.0)
            assert sent["prompt"] == [1, 2, 3] and sent["stop_token_ids"] == [9] and sent["ignore_eos"] is True
            assert protocol_decoding(params_from(sent).extra_args) is not None and not refusals(params_from(sent))

            await tokens(engine, GenerationRequest((1, 2, 3), 2, temperature=0.7, seed=5, top_p=0.9))
            nucleus_sent = seen[-1]  # the nucleus is the processor's to apply; vLLM's own stays whole
            assert nucleus_sent["vllm_xargs"] == {XARG_TEMPERATURE: 0.7, XARG_SEED: 5, XARG_TOP_P: 0.9}
            assert nucleus_sent["top_p"] == 1.0 and not refusals(params_from(nucleus_sent))
            assert protocol_decoding(params_from(nucleus_sent).extra_args).top_p == 0.9

            await tokens(engine, GenerationRequest((1, 2, 3), 2, temperature=0.0, seed=4))  # greedy
            assert seen[-1]["temperature"] == 0.0 and "vllm_xargs" not in seen[-1] and "seed" not in seen[-1]

            for _ in range(2):  # no seed: a fresh one for each request, as on the built-in engine
                await tokens(engine, GenerationRequest((1, 2, 3), 2, temperature=1.0))
            fresh = [s["vllm_xargs"][XARG_SEED] for s in seen[-2:]]
            assert fresh[0] != fresh[1] and all(0 <= s < SEED_LIMIT for s in fresh)

            with pytest.raises(RemoteEngineError, match=r"seed must lie in \[0, 2\*\*64\)"):
                await tokens(engine, GenerationRequest((1, 2, 3), 2, temperature=1.0, seed=SEED_LIMIT))
            assert len(seen) == 6
        finally:
            await engine.close()

    with_server(True, body)


def test_a_server_without_the_processor_is_refused_at_connect():
    async def body(url: str, seen: list[dict[str, Any]]) -> None:
        with pytest.raises(RemoteEngineError, match="--logits-processors planetserve.node.engine.vllm_processor:"
                                                     "PlanetServeSampling"):
            await RemoteEngine.connect(url, vllm_processor=True)
        assert len(seen) == 1

    with_server(False, body)


def test_a_plain_server_gets_temperature_and_seed_and_no_check():
    async def body(url: str, seen: list[dict[str, Any]]) -> None:
        engine = await RemoteEngine.connect(url)
        try:
            assert seen == []
            await tokens(engine, GenerationRequest((1, 2, 3), 2, temperature=0.7, seed=42))
            assert seen[-1]["temperature"] == 0.7 and seen[-1]["seed"] == 42 and "vllm_xargs" not in seen[-1]
        finally:
            await engine.close()

    with_server(False, body)


def test_the_node_home_names_how_its_engine_server_samples(tmp_path):
    config = ModelNodeConfig(org_id="acme", model_id="m", engine_url="http://127.0.0.1:8001",
                             engine_sampling="vllm-processor")
    config.save(tmp_path)
    assert ModelNodeConfig.load(tmp_path).engine_sampling == "vllm-processor"
    assert ModelNodeConfig(org_id="acme", model_id="m").engine_sampling == "server"
    raw = json.loads((tmp_path / "node.json").read_text())
    (tmp_path / "node.json").write_text(json.dumps({**raw, "engine_sampling": "vllm"}))
    with pytest.raises(HomeError, match="unknown engine_sampling 'vllm'; valid: server, vllm-processor"):
        ModelNodeConfig.load(tmp_path)
