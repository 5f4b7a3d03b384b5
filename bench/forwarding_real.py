"""Overlay forwarding on real engines: model nodes with the built-in engine over the trained gt, on
this machine, serving the same requests three times: without forwarding (each entry node serves what
it gets, `no_forward`), with PlanetServe's forwarding (HR-tree + F_LB, cache-state sync over TLS), and
through a centralized router that sees every engine's prefix cache as it is (sgl-router's cache-aware
policy with perfect, instant knowledge: the bound no forwarding policy can beat). Then the simulator
(bench/sim) runs the same requests with a cost table measured from this model, so its prediction is
checked against what the engines did.

With `--shape` (0.5b, 1b, 3b, 8b) the nodes serve a model of that published shape with random weights
instead of gt (one copy shared by the nodes' engines, one each with `--processes`; on the GPU when
there is one, in bf16): what latency and the cache's savings depend on is the model's size, not its
weights. It speaks gt's tokenizer, so its vocabulary is gt's rather than the shape's (a smaller output
layer: 262M of the 1B shape's 1.50B parameters are its 128,256-word embedding and head).

    .venv/bin/python bench/forwarding_real.py [--nodes 4] [--workload mixed] [--mix 3:6:1] [--rate 1.5]
        [--duration 60] [--scale 0.05] [--capacity 4] [--model gt] [--data-dir DIR] [--shape 1b] [--processes]

The nodes share this process unless `--processes` gives each one a process (and a copy of the model)
of its own, as on machines of their own: on a GPU, where the built-in engine is bound by the Python that
launches its kernels, four nodes in one process serve what one would (one GIL); on a CPU their engines'
work runs outside the GIL either way.

Latency is from sending the request to its last streamed chunk, TTFT to its first; the hit rate is
the fraction of prompt tokens the engines served from their prefix caches (usage.cached_tokens). Each
mode's line says what each node served and prefilled; "skew" is the busiest node's prefill against an
even share (1.00: even), what placing by prefix gives up against round robin.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Container, Sequence
from dataclasses import replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Protocol

import httpx
import numpy as np
from transformers import PreTrainedModel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.forwarding import mix_ratio  # noqa: E402
from bench.machine import describe  # noqa: E402
from bench.processes import Processes  # noqa: E402
from bench.sim import (  # noqa: E402
    A100_LLAMA3_8B,
    Centralized,
    Cluster,
    NoForwarding,
    Overlay,
    Prepared,
    fit_measured,
    summarize,
)
from planetserve.chain.keys import KeySet  # noqa: E402
from planetserve.node.engine.base import Engine, Tokenizer  # noqa: E402
from planetserve.node.engine.kvcache import block_hashes  # noqa: E402
from planetserve.node.engine.profile import SHAPES, measure_costs, params, sized_llama  # noqa: E402
from planetserve.node.home import ModelNodeConfig  # noqa: E402
from planetserve.node.model_node import ModelNode  # noqa: E402
from planetserve.node.routing.cachesync import SyncConfig
from planetserve.node.routing.group import GroupView
from planetserve.node.runner import builtin_engine  # noqa: E402
from planetserve.registry.entities import ModelNode as NodeRecord  # noqa: E402
from planetserve.workloads import Request, detokenize, generate  # noqa: E402

MODES = ("no-forwarding", "planetserve", "centralized")


def prompt_limit(args: argparse.Namespace) -> int:
    """Leaves room for the longest output in gt's 2,048 positions, or in a shaped model's 8,192."""
    return 7900 if args.shape else 1900


def node_config(args: argparse.Namespace, index: int) -> ModelNodeConfig:
    http, peer = args.port + 2 * index, args.port + 2 * index + 1
    return ModelNodeConfig(org_id="bench", model_id="gt", model=args.model, data_dir=args.data_dir or "",
                           http=f"127.0.0.1:{http}", peer=f"127.0.0.1:{peer}", capacity=args.capacity,
                           cache_tokens=args.cache_tokens, max_prompt_tokens=prompt_limit(args),
                           delta_interval=0.1, load_interval=0.1, sync_interval=5.0)


def shaped_model(shape: str, tokenizer: Tokenizer) -> PreTrainedModel:
    """A random-weight model of `shape` speaking `tokenizer`: on the GPU in bf16 when there is one."""
    import torch

    cuda = torch.cuda.is_available()
    model = sized_llama(shape, device="cuda" if cuda else "cpu",
                        dtype=torch.bfloat16 if cuda else torch.float32, vocab=len(tokenizer))
    if hasattr(tokenizer, "model_max_length"):  # the shape's context, not gt's 2,048: no warning per prompt
        tokenizer.model_max_length = model.config.max_position_embeddings
    return model


def shaped_engine(config: ModelNodeConfig, model: PreTrainedModel, tokenizer: Tokenizer
                  ) -> tuple[Engine, Tokenizer, int, tuple[int, ...]]:
    """builtin_engine's answer for a random-weight model built once and shared by the group's engines."""
    from planetserve.node.engine.builtin import BuiltinEngine

    engine = BuiltinEngine(model, config.model_id, block_size=config.block_size, max_batch=config.capacity,
                           cache_capacity_tokens=config.cache_tokens, prefill_chunk=config.prefill_chunk)
    return engine, tokenizer, engine.vocab_size, ()


async def own_engine(config: ModelNodeConfig, shape: str | None
                     ) -> tuple[Engine, Tokenizer, int, tuple[int, ...]]:
    """builtin_engine's answer for the configured model or, with `shape`, for a random-weight model of
    that shape (a copy of its own) speaking the configured model's tokenizer."""
    loaded = builtin_engine(config)
    if shape is None:
        return loaded
    engine, tokenizer, _, _ = loaded
    await engine.close()
    return shaped_engine(config, shaped_model(shape, tokenizer), tokenizer)


def group_engine(args: argparse.Namespace, config: ModelNodeConfig
                 ) -> tuple[Engine, Tokenizer, int, tuple[int, ...]]:
    if args.shaped is None:
        return builtin_engine(config)
    return shaped_engine(config, *args.shaped)


def placement(node: ModelNode) -> dict[str, int]:
    """What a node did in a run: requests it served and forwarded, and prompt tokens it prefilled."""
    counters = node.counters
    return {"served": counters["served"], "forwarded": counters["forwarded"],
            "prefilled": counters["prompt_tokens"] - counters["cached_prompt_tokens"]}


def member(key: bytes, address: str, capacity: int) -> NodeRecord:
    return NodeRecord(key, "bench", "gt", address, "cpu", capacity, "global", "active", 1)


class Group(Protocol):
    """The four (or --nodes) model nodes of one mode's run, fresh: where to ask them, what their engines
    cache and each one's counters (what it served, forwarded and prefilled)."""

    urls: list[str]

    async def cached(self, hashes: list[int]) -> Sequence[Container[int]]: ...

    async def counters(self) -> list[dict[str, int]]: ...

    async def close(self) -> None: ...


class LocalGroup:
    """The nodes in this process, sharing one copy of a shaped model and this process's GIL: on a CPU
    their engines' work runs in parallel outside the GIL, on a GPU the group launches what one thread
    can."""

    def __init__(self, nodes: list[ModelNode]) -> None:
        self.nodes = nodes
        self.urls = [n.http_url for n in nodes]

    @classmethod
    async def start(cls, args: argparse.Namespace) -> LocalGroup:
        nodes = []
        for i in range(args.nodes):
            config = node_config(args, i)
            engine, tokenizer, vocab, stop = await asyncio.to_thread(group_engine, args, config)
            node = ModelNode(config, KeySet.generate(), engine, tokenizer, vocab_size=vocab, eos_ids=stop,
                             group=None)
            await node.start()
            nodes.append(node)
        members = {n.keys.public: member(n.keys.public, n.config.address, args.capacity) for n in nodes}
        for node in nodes:
            node.apply_view(GroupView(1, members))
        await asyncio.sleep(1.0)  # one round of loads and snapshots
        return cls(nodes)

    async def cached(self, hashes: list[int]) -> Sequence[Container[int]]:
        return [n.engine.cache for n in self.nodes]  # type: ignore[attr-defined]

    async def counters(self) -> list[dict[str, int]]:
        return [placement(n) for n in self.nodes]

    async def close(self) -> None:
        for node in self.nodes:
            await node.close()
            await node.engine.close()


def serve_node(pipe: Connection, args: argparse.Namespace, index: int) -> None:
    """A model node's process: its own engine (and copy of a shaped model), serving until told to stop;
    between, it answers the benchmark's questions about its cache and its forwards."""
    asyncio.run(_serve_node(pipe, args, index))


async def _serve_node(pipe: Connection, args: argparse.Namespace, index: int) -> None:
    import torch

    torch.set_num_threads(1)
    config = node_config(args, index)
    engine, tokenizer, vocab, stop = await own_engine(config, args.shape)
    node = ModelNode(config, KeySet.generate(), engine, tokenizer, vocab_size=vocab, eos_ids=stop, group=None)
    await node.start()
    pipe.send((node.keys.public, config.address, node.http_url))
    node.apply_view(await asyncio.to_thread(pipe.recv))
    while (command := await asyncio.to_thread(pipe.recv)) != "stop":
        if command == "counters":
            pipe.send(placement(node))
        else:
            pipe.send(frozenset(h for h in command if h in engine.cache))  # type: ignore[attr-defined]
    await node.close()
    await engine.close()


class ProcessGroup:
    """Each node in a process of its own, as on a machine of its own, each with its own copy of the
    model: no node waits for another's GIL, so on a GPU the group launches what four nodes would."""

    def __init__(self, processes: Processes, pipes: list[Connection], urls: list[str]) -> None:
        self.processes = processes
        self.pipes = pipes
        self.locks = [asyncio.Lock() for _ in pipes]
        self.urls = urls

    @classmethod
    async def start(cls, args: argparse.Namespace) -> ProcessGroup:
        processes = Processes()
        unpicklable = ("shaped", "tokenizer")
        plain = argparse.Namespace(**{k: v for k, v in vars(args).items() if k not in unpicklable})
        started = [processes.start(serve_node, plain, i) for i in range(args.nodes)]
        listed = [await processes.answer(process, pipe, f"model node {i}")
                  for i, (process, pipe) in enumerate(started)]
        view = GroupView(1, {key: member(key, address, args.capacity) for key, address, _ in listed})  # type: ignore[misc]
        for _, pipe in started:
            pipe.send(view)
        await asyncio.sleep(1.0)  # one round of loads and snapshots
        return cls(processes, [pipe for _, pipe in started], [url for *_, url in listed])  # type: ignore[misc]

    async def _ask(self, index: int, command: object) -> object:
        async with self.locks[index]:
            self.pipes[index].send(command)
            return await asyncio.to_thread(self.pipes[index].recv)

    async def cached(self, hashes: list[int]) -> Sequence[Container[int]]:
        return await asyncio.gather(*(self._ask(i, hashes) for i in range(len(self.pipes))))  # type: ignore[return-value]

    async def counters(self) -> list[dict[str, int]]:
        return await asyncio.gather(*(self._ask(i, "counters") for i in range(len(self.pipes))))  # type: ignore[return-value]

    async def close(self) -> None:
        await self.processes.stop()


class CentralRouter:
    """bench/sim's Centralized (sgl-router's cache-aware policy) over the real engines: it sees each
    engine's prefix cache as it is when a request arrives and counts the requests it sent each node
    until they end."""

    def __init__(self, group: Group, tokenizer: Tokenizer, block_size: int) -> None:
        self.group = group
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.policy = Centralized()
        self.policy.start(len(group.urls))
        self.outstanding = [0] * len(group.urls)

    async def route(self, text: str) -> tuple[int, list[int]]:
        hashes = block_hashes(self.tokenizer(text)["input_ids"], self.block_size)
        chosen = self.policy.choose(self.outstanding, await self.group.cached(hashes), hashes)
        self.outstanding[chosen] += 1
        return chosen, hashes

    def prefilled(self, chosen: int, hashes: list[int]) -> None:
        self.policy.release(chosen, hashes)

    def finished(self, chosen: int) -> None:
        self.outstanding[chosen] -= 1


async def send(client: httpx.AsyncClient, group: Group, request: Request, mode: str,
               started: float, router: CentralRouter | None) -> dict:
    await asyncio.sleep(max(0.0, started + request.arrival - time.monotonic()))
    sent = time.monotonic()
    if router is not None:
        chosen, hashes = await router.route(request.text)
    else:
        chosen, hashes = request.id % len(group.urls), []
    body = {"model": "gt", "prompt": request.text, "max_tokens": request.output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "planetserve": {"no_forward": mode != "planetserve"}}
    first = None
    usage: dict = {}
    try:
        async with client.stream("POST", f"{group.urls[chosen]}/v1/completions", json=body) as response:
            if response.status_code != 200:
                return {"error": (await response.aread()).decode()[:200]}
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if first is None and chunk.get("choices"):
                    first = time.monotonic()
                    if router is not None:
                        router.prefilled(chosen, hashes)
                usage = chunk.get("usage") or usage
    finally:
        if router is not None:
            if first is None:
                router.prefilled(chosen, hashes)
            router.finished(chosen)
    done = time.monotonic()
    return {"latency": done - sent, "ttft": (first or done) - sent, "prompt": usage.get("prompt_tokens", 0),
            "cached": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)}


async def run_mode(args: argparse.Namespace, mode: str, requests: list[Request]) -> dict:
    group: Group = await (ProcessGroup if args.processes else LocalGroup).start(args)
    block_size = node_config(args, 0).block_size
    router = CentralRouter(group, args.tokenizer, block_size) if mode == "centralized" else None
    try:
        async with httpx.AsyncClient(timeout=600) as client:
            started = time.monotonic()
            results = await asyncio.gather(*(send(client, group, r, mode, started, router) for r in requests))
        nodes = await group.counters()
    finally:
        await group.close()
    failed = [r["error"] for r in results if "error" in r]
    if failed:
        raise SystemExit(f"{len(failed)} of {len(requests)} requests failed, e.g. {failed[0]}")
    latency = np.array([r["latency"] for r in results])
    ttft = np.array([r["ttft"] for r in results])
    return {"mode": mode, "mean": float(latency.mean()), "p99": float(np.percentile(latency, 99)),
            "ttft": float(ttft.mean()), "ttft99": float(np.percentile(ttft, 99)),
            "hit": sum(r["cached"] for r in results) / max(1, sum(r["prompt"] for r in results)),
            "forwarded": sum(n["forwarded"] for n in nodes) / len(requests), "nodes": nodes,
            "skew": skew([n["prefilled"] for n in nodes])}


def skew(values: list[int]) -> float:
    """The busiest node's share against an even one (1.0: perfectly even)."""
    return max(values) * len(values) / max(1, sum(values))


def with_model_tokens(requests: list[Request], tokenizer) -> list[Request]:
    """The same requests counted in the model's own tokens: the prefix is what a request shares with
    its pool entry once both are tokenised (BPE may merge across the boundary)."""
    pools: dict[str, tuple[int, ...]] = {}
    out = []
    for r in requests:
        ids = tuple(tokenizer(r.text)["input_ids"])
        pool = pools.setdefault(r.prefix_id, tuple(tokenizer(detokenize(r.prefix_ids))["input_ids"]))
        common = next((i for i, (a, b) in enumerate(zip(pool, ids, strict=False)) if a != b),
                      min(len(pool), len(ids)))
        out.append(replace(r, prefix_ids=ids[:common], suffix_ids=ids[common:]))
    return out


def simulate(args: argparse.Namespace, requests: list[Request], tokenizer, model) -> dict[str, dict]:
    # The built-in engine holds running sequences' KV outside its prefix cache; the simulated node
    # keeps both in one pool, so the pool gets room for a full batch of the longest prompts too.
    pool = args.cache_tokens + args.capacity * prompt_limit(args)
    base = replace(A100_LLAMA3_8B, max_seqs=args.capacity, kv_capacity_tokens=pool)
    costs = fit_measured(measure_costs(model, prompt_lens=(128, 384, 768), batch_sizes=(1, 2, 4)), base)
    prepared = Prepared.of(with_model_tokens(requests, tokenizer), costs.block_size)
    out = {}
    node = node_config(args, 0)  # the simulated group routes with the real nodes' settings
    overlay = Overlay(balance=True, seed=args.seed, min_depth=node.match_depth,
                      config=SyncConfig(batch_interval=node.delta_interval, load_interval=node.load_interval,
                                        snapshot_interval=node.sync_interval))
    policies = (("no-forwarding", NoForwarding()), ("planetserve", overlay), ("centralized", Centralized()))
    for mode, policy in policies:
        s = summarize(Cluster(prepared, policy, costs, args.nodes, net_delay=0.0005).run())
        out[mode] = {"mean": s.mean_latency, "p99": s.p99_latency, "ttft": s.mean_ttft, "hit": s.hit_rate}
    return out


def _change(new: float, old: float) -> str:
    return f"{100 * (new / old - 1):+.0f}%"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--workload", default="mixed")
    parser.add_argument("--mix", type=mix_ratio, help="Mixed's tooluse:coding:longdoc ratio (default 3:6:1)")
    parser.add_argument("--rate", type=float, default=1.5, help="requests per second, whole group")
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--scale", type=float, default=0.05)
    parser.add_argument("--capacity", type=int, default=4)
    parser.add_argument("--cache-tokens", type=int, default=8192)
    parser.add_argument("--model", default="gt")
    parser.add_argument("--data-dir", default="")
    parser.add_argument("--port", type=int, default=18400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shape", choices=sorted(SHAPES), help="serve a random-weight model of this shape")
    parser.add_argument("--processes", action="store_true",
                        help="each node in a process of its own, with its own copy of the model")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    requests = generate(args.workload, rate=args.rate, duration=args.duration, seed=args.seed,
                        scale=args.scale, mix=args.mix)
    engine, tokenizer, _, _ = asyncio.run(own_engine(node_config(args, 0), args.shape))
    args.shaped = (engine.model, tokenizer) if args.shape is not None else None  # type: ignore[attr-defined]
    limit = prompt_limit(args)
    fits = [r for r in requests if len(tokenizer(r.text)["input_ids"]) <= limit]
    if len(fits) < len(requests):
        print(f"left out {len(requests) - len(fits)} requests whose prompt exceeds {limit} "
              f"tokens (the model's context is {engine.max_model_len})")
    requests = fits
    args.tokenizer = tokenizer
    served = f"a random {args.shape} shape ({params(engine.model) / 1e9:.2f}B)" if args.shape else args.model
    print(f"machine: {describe()}")
    print(f"{len(requests)} {args.workload} requests over {args.duration:.0f} s at {args.rate} req/s, "
          f"{args.nodes} nodes of capacity {args.capacity}, model {served}", flush=True)
    measured = {}
    for mode in MODES:
        started = time.monotonic()
        measured[mode] = m = asyncio.run(run_mode(args, mode, requests))
        served, prefilled = ("/".join(str(n[key]) for n in m["nodes"]) for key in ("served", "prefilled"))
        print(f"  {mode}: mean {m['mean']:.2f} s, TTFT {m['ttft']:.2f} s, hit {m['hit']:.2f} "
              f"({time.monotonic() - started:.0f} s); served {served}, prefilled {prefilled} tokens",
              flush=True)
    predicted = simulate(args, requests, tokenizer, engine.model)
    asyncio.run(engine.close())

    print(f"\n{'mode':14} {'mean s':>8} {'p99 s':>8} {'ttft s':>8} {'ttft99':>8} {'hit':>6} {'fwd':>6}"
          f" {'skew':>5}   {'sim mean':>8} {'sim ttft':>8} {'sim hit':>7}   {'real/sim':>8}")
    for mode in MODES:
        m, p = measured[mode], predicted[mode]
        print(f"{mode:14} {m['mean']:8.2f} {m['p99']:8.2f} {m['ttft']:8.2f} {m['ttft99']:8.2f} "
              f"{m['hit']:6.2f} {m['forwarded']:6.2f} {m['skew']:5.2f}   {p['mean']:8.2f} {p['ttft']:8.2f} "
              f"{p['hit']:7.2f}   {m['mean'] / p['mean']:8.2f}")
    for name, table in (("measured", measured), ("simulated", predicted)):
        base, ps = table["no-forwarding"], table["planetserve"]
        print(f"PlanetServe vs no forwarding, {name}: mean latency {_change(ps['mean'], base['mean'])}, "
              f"TTFT {_change(ps['ttft'], base['ttft'])}, hit rate {base['hit']:.2f} -> {ps['hit']:.2f}")
        central = table["centralized"]
        print(f"PlanetServe vs the centralized router, {name}: mean latency "
              f"{_change(ps['mean'], central['mean'])}, TTFT {_change(ps['ttft'], central['ttft'])}, "
              f"hit rate {ps['hit'] / max(central['hit'], 1e-9):.2f}x the router's")
    if args.json:
        args.json.write_text(json.dumps({"measured": measured, "predicted": predicted}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
