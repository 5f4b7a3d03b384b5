"""Pipeline execution (node/pipeline/stages.py, node/pipeline/coordinator.py): a model split by layers
across stage servers, hidden states over real TLS on loopback, gives the unsplit model's logits and
tokens; a stage lost mid-request moves the request to another chain without changing its output;
malformed steps are refused with a reason while the server keeps serving."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import sys
import time
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from modelfix import DEEP_LAYERS
from stagecluster import chain_router, cluster, refuse
from waiting import run, until

from planetserve.chain.keys import KeySet
from planetserve.models import LoadedModel, load
from planetserve.node.engine.base import GenerationRequest
from planetserve.node.overlay.transport import Peering, RemoteError
from planetserve.node.pipeline import stages
from planetserve.node.pipeline.chains import Hop
from planetserve.node.pipeline.coordinator import PipelineClient, PipelineError, StageAddress, sampler
from planetserve.node.pipeline.stages import (
    ModelShape,
    StageError,
    StageModel,
    StageServer,
    decode_tensor,
    encode_tensor,
)

PROMPT = "Return a new"
LAYERS = DEEP_LAYERS
THREE = {"a": (0, 2), "b": (2, 4), "c": (4, 6)}
REPLICATED = {"a": (0, 2), "b1": (2, 4), "b2": (2, 4), "c": (4, 6)}


@pytest.fixture(scope="module")
def gt(quick_family: Path) -> LoadedModel:
    return load("gt", data_dir=quick_family)


def prompt_ids(loaded: LoadedModel, text: str = PROMPT) -> list[int]:
    return loaded.tokenizer(text)["input_ids"]


@torch.inference_mode()
def unsplit_tokens(loaded: LoadedModel, ids: list[int], n: int, temperature: float = 0.0,
                   seed: int | None = None) -> list[int]:
    """The whole model, recomputed from scratch for every token (no cache to share a bug with)."""
    pick, tokens = sampler(temperature, seed), list(ids)
    for position in range(n):
        tokens.append(pick(loaded.model(torch.tensor([tokens])).logits[0, -1].numpy(), position))
    return tokens[len(ids):]




def test_wire_tensors_round_trip_and_are_checked():
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert np.array_equal(decode_tensor(encode_tensor(torch.from_numpy(array)), "x", 3, 2), array)
    with pytest.raises(StageError, match="x of 2 rows: expected 1 to 1"):
        decode_tensor(encode_tensor(array), "x", 3, 1)


def test_stage_slices_match_the_whole_model(gt: LoadedModel, monkeypatch: pytest.MonkeyPatch):
    """No network: two stages of the real quick gt, prefilled in chunks then decoding, and one stage
    entered at each of its layers in turn, give the model's own logits at every step."""
    ids = prompt_ids(gt, "If the argument is a string")
    first, second, whole = StageModel(gt.model, 0, 1), StageModel(gt.model, 1, 2), StageModel(gt.model, 0, 2)
    caches = first.new_cache(), second.new_cache(), whole.new_cache()
    with torch.inference_mode():
        reference = gt.model(torch.tensor([ids])).logits[0]
    for a, b in ((0, 4), (4, len(ids) - 1), (len(ids) - 1, len(ids))):  # chunks, then one position
        chunk = torch.tensor(ids[a:b])
        split = second.forward(first.forward(chunk, caches[0], 0, 1), caches[1], 1, 2)
        entered = whole.forward(whole.forward(chunk, caches[2], 0, 1), caches[2], 1, 2)
        assert split.shape == (1, gt.model.config.vocab_size)
        assert torch.allclose(split[0], reference[b - 1], atol=1e-5)
        assert torch.allclose(entered[0], reference[b - 1], atol=1e-5)
    assert whole.length(caches[2], 0) == whole.length(caches[2], 1) == len(ids)
    models = []

    def tracked_load(*args, **kwargs) -> LoadedModel:
        loaded = load(*args, **kwargs)
        models.append(weakref.ref(loaded.model))
        return loaded

    monkeypatch.setattr(stages, "load", tracked_load)
    loaded = StageModel.load(gt.path, 1, 2)
    gc.collect()
    assert models[0]() is None  # the full model, and with it the layers the stage does not run, is gone
    assert sorted(loaded.layers) == [1] and loaded.embed is None and loaded.head is not None
    with pytest.raises(StageError, match="Linear is not a Llama-style causal LM"):
        StageModel(torch.nn.Linear(1, 1), 0, 1)
    with pytest.raises(StageError, match=r"layers \[1, 1\) are not a non-empty range of \[0, 2\)"):
        StageModel(gt.model, 1, 1)
    with pytest.raises(StageError, match=r"outside this stage's \[1, 2\)"):
        second.forward(torch.zeros(1, 64), second.new_cache(), 0, 2)


def test_three_stages_over_tls_match_the_unsplit_model(deep_gt: LoadedModel):
    ids = prompt_ids(deep_gt)
    with torch.inference_mode():
        reference = deep_gt.model(torch.tensor([ids])).logits[0, -1].numpy()
    greedy = unsplit_tokens(deep_gt, ids, 12)
    sampled = unsplit_tokens(deep_gt, ids, 12, temperature=1.0, seed=5)
    generated = deep_gt.model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    assert len(set(sampled)) > 4  # greedy output of a model this small repeats itself; samples vary

    async def main():
        c = await cluster(deep_gt, THREE)
        chunked = PipelineClient(c.peering, c.router, {g: c.address(g) for g in THREE},
                                 ModelShape.of(deep_gt.model.config), deep_gt.tokenizer, chunk_tokens=2)
        try:
            assert np.allclose(await c.client.logits(ids), reference, atol=1e-4)
            assert np.allclose(await chunked.logits(ids), reference, atol=1e-4)
            out = await c.client.complete(PROMPT, 12)
            assert list(out.token_ids) == greedy and out.finish_reason == "length"
            assert out.text == deep_gt.tokenizer.decode(greedy, skip_special_tokens=True)
            assert [h[:] for h in out.chains[0].hops] == [Hop("a", 0, 2), Hop("b", 2, 4), Hop("c", 4, 6)]
            stopped = await c.client.complete(ids, 12, stop_ids=deep_gt.stop_token_ids)
            assert list(stopped.token_ids) == generated[0, len(ids):].tolist()
            out = await c.client.complete(ids, 12, temperature=1.0, seed=5)
            assert list(out.token_ids) == sampled
            await until(lambda: c.held() == 0)  # every request freed its caches at the end
        finally:
            await c.close()

    run(main(), 60)


@pytest.mark.faults
def test_a_stage_lost_mid_request_moves_it_to_a_replica(deep_gt: LoadedModel):
    ids = prompt_ids(deep_gt)
    expected = unsplit_tokens(deep_gt, ids, 12)

    async def main():
        c = await cluster(deep_gt, REPLICATED)
        try:
            chains, tokens = [], []
            async for chunk in c.client.generate(GenerationRequest(tuple(ids), 12), chains):
                tokens.extend(chunk.token_ids)
                if len(tokens) == 4:
                    await c.stages["b1"].close()  # b1 dies between two decode steps
            assert tokens == expected
            assert [[h.gpu for h in chain.hops] for chain in chains] == [["a", "b1", "c"], ["a", "b2", "c"]]
            assert c.router.excluded == {"b1"}
            out = await c.client.complete(ids, 3)  # new requests avoid the lost stage from the start
            assert [h.gpu for h in out.chains[0].hops] == ["a", "b2", "c"] and len(out.chains) == 1
            await until(lambda: c.held() == 0)
        finally:
            await c.close()

    run(main(), 60)


def test_a_stage_that_stops_answering_is_lost(deep_gt: LoadedModel):
    ids = prompt_ids(deep_gt)

    async def hang(peer, msg_type, body):
        await asyncio.sleep(3600)

    async def main():
        c = await cluster(deep_gt, REPLICATED, step_timeout=2.0)
        c.stages["b1"].peering.handler = hang  # alive and connected, but silent
        try:
            out = await c.client.complete(ids, 5)
            assert list(out.token_ids) == unsplit_tokens(deep_gt, ids, 5)
            assert [h.gpu for h in out.chains[-1].hops] == ["a", "b2", "c"] and c.router.excluded == {"b1"}
            await c.stages["b2"].close()
            with pytest.raises(PipelineError, match=r"no chain left .*layers \[2, 4\)"):
                await c.client.complete(ids, 2)
        finally:
            await c.close()

    run(main(), 60)


@pytest.mark.faults
def test_three_stage_processes(deep_gt: LoadedModel, tmp_path: Path):
    """Each stage a process of its own (`planetserve node stage`); one is killed with
    SIGKILL in the middle of a request, which finishes on the replica."""
    ids = prompt_ids(deep_gt)
    expected = unsplit_tokens(deep_gt, ids, 12)
    client_keys = KeySet.generate()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    async def start(gpu: str, layers: tuple[int, int]) -> asyncio.subprocess.Process:
        KeySet.generate().save(tmp_path / f"{gpu}.json")
        with (tmp_path / f"{gpu}.log").open("w") as log:  # the stage keeps its own descriptor
            return await asyncio.create_subprocess_exec(
                sys.executable, "-m", "planetserve", "node", "stage", "--model", str(deep_gt.path),
                "--layers", f"{layers[0]}:{layers[1]}", "--keys", str(tmp_path / f"{gpu}.json"),
                "--allow", client_keys.public.hex(), "--port", "0",
                stdout=asyncio.subprocess.PIPE, stderr=log, env=env)

    async def main():
        procs = dict(zip(REPLICATED, await asyncio.gather(*(start(g, r) for g, r in REPLICATED.items())),
                         strict=True))
        try:
            ready = {g: json.loads(await asyncio.wait_for(p.stdout.readline(), 50)) for g, p in procs.items()}
            addresses = {g: StageAddress(bytes.fromhex(r["key"]), r["address"]) for g, r in ready.items()}
            peering = Peering(client_keys, refuse, {a.key for a in addresses.values()}.__contains__)
            client = PipelineClient(peering, chain_router(REPLICATED), addresses,
                                    ModelShape.of(deep_gt.model.config), deep_gt.tokenizer)
            out = await client.complete(ids, 12)
            assert list(out.token_ids) == expected and len(out.chains) == 1
            chains, tokens = [], []
            async for chunk in client.generate(GenerationRequest(tuple(ids), 12), chains):
                tokens.extend(chunk.token_ids)
                if len(tokens) == 5:
                    procs["b1"].kill()
                    await procs["b1"].wait()
            assert tokens == expected
            assert [[h.gpu for h in chain.hops] for chain in chains] == [["a", "b1", "c"], ["a", "b2", "c"]]
            await peering.close()
        finally:
            for proc in procs.values():
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()

    run(main(), 60)


def test_bad_steps_are_refused_and_the_server_keeps_serving(deep_gt: LoadedModel):
    hidden = deep_gt.model.config.hidden_size
    ones = encode_tensor(np.ones((3, hidden), dtype=np.float32))

    def tensor(**fields):
        return {**ones, **fields}

    def step(**fields):
        return {"op": "start", "id": b"r1", "layers": [2, 4], "pos": 0, "hidden": ones, **fields}

    refused = [
        ([], "must be a map"),
        (step(op="pause"), "op must be start, continue, end or ping"),
        (step(id="r1"), "id must be 1 to 32 bytes"),
        (step(layers=[0, 4]), r"layers must be \[a, b\) within this stage's \[2, 4\)"),
        (step(pos=-1), r"pos must be an integer in \[0, 16\]"),
        (step(hidden=tensor(dtype="float16")), "hidden states must be float32, got 'float16'"),
        (step(hidden=tensor(shape=[3, hidden // 2])), f"width {hidden // 2} do not match the model's {hidden}"),
        (step(hidden=tensor(shape=[3])), "shape must be"),
        (step(hidden=tensor(data=b"\0" * 10)), f"need {3 * hidden * 4} bytes, got 10"),
        (step(hidden=encode_tensor(np.full((1, hidden), np.nan, dtype=np.float32))), "non-finite"),
        (step(hidden=encode_tensor(np.ones((17, hidden), dtype=np.float32))), "17 rows: expected 1 to 16"),
        (step(tokens=[1, 2]), "carries hidden, not tokens"),
        (step(op="continue", id=b"never"), "unknown request 6e65766572"),
        (step(pos=2), "pos 2 does not follow the 0 positions"),
    ]

    async def main():
        c = await cluster(deep_gt, {"a": (0, 2), "b": (2, 4), "c": (4, 6)}, max_tokens=16)
        conn = await c.peering.connect(c.keys["b"].public, c.address("b").address)
        first = await c.peering.connect(c.keys["a"].public, c.address("a").address)
        try:
            for body, reason in refused:
                with pytest.raises(RemoteError, match=reason):
                    await conn.call("stage", body)
            with pytest.raises(RemoteError, match="unknown message type 'generate'"):
                await conn.call("generate", {})
            with pytest.raises(RemoteError, match=r"token ids must be integers in \[0, 1024\)"):
                await first.call("stage", {"op": "start", "id": b"t", "layers": [0, 2], "pos": 0,
                                           "tokens": [5, 1024]})
            # the refused start with a wrong pos left nothing behind: the same id starts cleanly now
            reply = await conn.call("stage", step())
            assert decode_tensor(reply["hidden"], "hidden", hidden, 3).shape == (3, hidden)
            with pytest.raises(RemoteError, match="request 7231 was already started"):
                await conn.call("stage", step())
            with pytest.raises(RemoteError, match=r"runs layers \[2, 4\) here, not \[3, 4\)"):
                await conn.call("stage", step(op="continue", layers=[3, 4], pos=3))
            big = encode_tensor(np.ones((14, hidden), dtype=np.float32))
            with pytest.raises(RemoteError, match="would reach 17 positions, over the limit of 16"):
                await conn.call("stage", step(op="continue", pos=3, hidden=big))
            assert await conn.call("stage", {"op": "end", "id": b"r1"}) == {"ended": True}
            assert await conn.call("stage", {"op": "end", "id": b"r1"}) == {"ended": False}
            # the client refuses what no stage would take, and a stage's refusal ends the request
            # without counting the stage as lost
            with pytest.raises(PipelineError, match=r"prompt token ids must lie in \[0, 1024\)"):
                await c.client.complete([5, 4096], 2)
            with pytest.raises(PipelineError, match="stage a refused layers .*17 positions, over the limit of 16"):
                await c.client.complete(list(range(3, 17)), 4)
            assert c.router.excluded == set()
            out = await c.client.complete(prompt_ids(deep_gt), 3)
            assert list(out.token_ids) == unsplit_tokens(deep_gt, prompt_ids(deep_gt), 3)
            await until(lambda: c.held() == 0)  # a refused request, too, freed what its chain held
        finally:
            await c.close()

    run(main(), 60)


def test_caches_are_freed_when_idle_and_bounded_in_number(deep_gt: LoadedModel):
    """A stage holds `max_requests` caches, one peer's at most half of them (one coordinator held all 64
    with steps the stage refused, each of which kept its request alive); a step the stage refuses keeps
    nothing alive, so an idle request is dropped however many refused steps name it."""
    server = StageServer(StageModel(deep_gt.model, 0, 2), max_requests=4, idle_timeout=0.2)
    peer, other, third = b"p" * 32, b"q" * 32, b"r" * 32

    def start(request: bytes) -> dict:
        return {"op": "start", "id": request, "layers": [0, 2], "pos": 0, "tokens": [5, 6]}

    def keep_alive(request: bytes) -> dict:
        return {**start(request), "op": "continue", "pos": 7, "tokens": [7]}

    async def main():
        await server.handle(peer, "stage", start(b"1"))
        await server.handle(peer, "stage", start(b"2"))
        with pytest.raises(StageError, match="already holds 2 of this peer's requests"):
            await server.handle(peer, "stage", start(b"3"))
        await server.handle(other, "stage", start(b"1"))
        await server.handle(other, "stage", start(b"2"))
        with pytest.raises(StageError, match="already holds 4 requests"):
            await server.handle(third, "stage", start(b"1"))
        await asyncio.sleep(0.12)
        with pytest.raises(StageError, match="pos 7 does not follow the 2 positions"):
            await server.handle(peer, "stage", keep_alive(b"1"))
        await asyncio.sleep(0.12)
        with pytest.raises(StageError, match="unknown request 31 .*idle for over 0.2 s"):
            await server.handle(peer, "stage", keep_alive(b"1"))
        await server.handle(third, "stage", start(b"3"))  # the idle ones were dropped first
        assert set(server.sessions) == {(third, b"3")}
        # requests are private to the peer that started them
        with pytest.raises(StageError, match="unknown request 33"):
            await server.handle(b"q" * 32, "stage", {**start(b"3"), "op": "continue", "pos": 2, "tokens": [7]})

    try:
        run(main(), 60)
    finally:
        server.close()


def test_a_local_stage_and_live_measurements(deep_gt: LoadedModel):
    """The coordinator holds the first stage itself; pings measure the links, one-token steps the
    stages; a lost stage that answers pings again is readmitted, one that does not stays out."""
    ids = prompt_ids(deep_gt)
    expected = unsplit_tokens(deep_gt, ids, 6)

    async def main():
        c = await cluster(deep_gt, REPLICATED)
        local = StageServer(StageModel(deep_gt.model, 0, 2))
        client = PipelineClient(c.peering, c.router, {g: c.address(g) for g in ("b1", "b2", "c")},
                                ModelShape.of(deep_gt.model.config), deep_gt.tokenizer, local=("a", local))
        table = c.router.table
        try:
            await client.measure()
            now = time.monotonic()
            assert all(table.fresh_rtt("a", g, now) for g in ("b1", "b2", "c"))
            assert table.rtt_ms("b1", "c", now) == pytest.approx(table.rtt_ms("a", "b1", now)
                                                                 + table.rtt_ms("a", "c", now))
            out = await client.complete(ids, 6)
            assert list(out.token_ids) == expected and out.chains[0].hops[0] == Hop("a", 0, 2)
            assert c.stages["a"].server.sessions == {} and local.sessions == {}  # "a" ran here, and ended
            measured = {g: table.layer_ms(g, time.monotonic()) for g in ("a", "c")}
            assert all(ms != table.default_layer_ms for ms in measured.values())  # decode steps were timed

            c.router.exclude("b1")
            c.router.exclude("b2")
            await c.stages["b2"].close()
            await client.measure()
            assert c.router.excluded == {"b2"}  # b1 answered its ping; b2 is gone
            short = StageServer(local.stage, max_tokens=2)
            strict = PipelineClient(c.peering, c.router, {g: c.address(g) for g in ("b1", "b2", "c")},
                                    ModelShape.of(deep_gt.model.config), deep_gt.tokenizer, local=("a", short))
            refused = r"this node's stage refused layers \[0, 2\): tokens must be a list of 1 to 2"
            with pytest.raises(PipelineError, match=refused):
                await strict.complete(ids, 1)
        finally:
            local.close()
            await c.close()

    run(main(), 60)


def test_the_pipeline_engine_serves_like_an_engine(deep_gt: LoadedModel):
    from planetserve.node.engine.base import EngineError
    from planetserve.node.pipeline.engine import PipelineEngine

    ids = prompt_ids(deep_gt)

    async def main():
        c = await cluster(deep_gt, THREE)
        shape = ModelShape.of(deep_gt.model.config)
        addresses = {g: c.address(g) for g in THREE}
        engine = PipelineEngine(lambda peering: PipelineClient(peering, c.router, addresses, shape, deep_gt.tokenizer),
                                "deep", max_model_len=shape.max_positions, capacity=1, refresh_s=0.05)
        try:
            with pytest.raises(EngineError, match="still starting"):
                await anext(engine.generate(GenerationRequest(tuple(ids), 2)))
            await engine.start(c.peering)
            tokens = [t async for chunk in engine.generate(GenerationRequest(tuple(ids), 6))
                      for t in chunk.token_ids]
            assert tokens == unsplit_tokens(deep_gt, ids, 6)
            # log-probabilities as the built-in engine reports them: the whole model's log-softmax at
            # each position, the chosen token's and the two likeliest
            scored = [chunk async for chunk in engine.generate(GenerationRequest(tuple(ids), 4, logprobs=2))]
            with torch.inference_mode():
                rows = deep_gt.model(torch.tensor([ids + tokens[:3]])).logits[0, len(ids) - 1:].log_softmax(-1)
            for chunk, row in zip(scored, rows, strict=True):
                (entry,) = chunk.logprobs
                assert entry.logprob == pytest.approx(row[chunk.token_ids[0]].item(), abs=1e-4)
                assert [i for i, _ in entry.top] == row.topk(2).indices.tolist()
            with pytest.raises(EngineError, match="logprobs must lie in"):
                await anext(engine.generate(GenerationRequest(tuple(ids), 2, logprobs=99)))
            with pytest.raises(EngineError, match="max_tokens must be >= 1"):
                await anext(engine.generate(GenerationRequest(tuple(ids), 0)))
            first = engine.generate(GenerationRequest(tuple(ids), 4))
            await anext(first)
            second = asyncio.ensure_future(anext(engine.generate(GenerationRequest(tuple(ids), 1))))
            await until(lambda: engine.load().queued == 1)  # capacity 1: the second waits for the first
            assert engine.load().running == 1
            await first.aclose()
            assert (await second).token_ids and engine.load().queued == 0  # the first's slot went to it
            await until(lambda: c.router.table.fresh_rtt("coordinator", "b", time.monotonic()))  # the loop
        finally:
            await engine.close()
            await c.close()

    run(main(), 60)
