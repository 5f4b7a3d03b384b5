"""Parallax phase 2 (seed parallax.txt §3.3 and Fig. 5): time per request of GPU chain selection
(`planetserve.node.chains.select_chain`) at 4, 16, 64 and 256 GPUs, against the paper's 0.0136 ms/req
at 4 GPUs and 6.6339 ms/req at 256.

Placements are shaped like phase 1's: GPUs of a few types (layer capacity, ms per layer) spread over
regions (1 region at 4 GPUs, 2 at 16, 4 at 64 and 256); within a region, GPUs sorted by capacity fill
pipelines of contiguous blocks over L = 80 layers, the blocks sized by water-filling on speed within
capacity; GPUs left over take, as the paper's join rule, a slice starting at the layer with the fewest
copies. RTTs are a few ms inside a region and 60-250 ms across. Every request sees its own live tau (each
GPU's base latency times a load factor drawn from [1, 2]); the links stay those of one refresh. The
timed call is `select_chain` alone, reading that snapshot; building the snapshot from the latency table
("refresh", once per 1-2 s) and compiling the placement (once per membership change) are timed apart.

    .venv/bin/python bench/chains.py [--gpus 4,16,64,256] [--requests 2000] [--engine auto] [--seed 0]

Target: at least 4x faster than the paper at 4 and at 256 GPUs.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from planetserve.node.pipeline.chains import Latencies, LatencyTable, LayerDag, select_chain

LAYERS = 80
PAPER_MS = {4: 0.0136, 256: 6.6339}
TARGET = 4.0
GPU_TYPES = (("rtx4090", 20, 1.00), ("rtx5090", 28, 0.75), ("l40s", 40, 0.85), ("a100", 60, 0.55),
             ("h100", 60, 0.35))
"""(name, layers it can hold, ms per layer): capacities of an 80-layer model in FP8 with KV room."""
INTRA_RTT_MS = (2.0, 10.0)
INTER_RTT_MS = (60.0, 250.0)
VARIANTS = 64
"""Distinct load draws per scale, cycled over the requests."""


@dataclass(frozen=True)
class Gpu:
    name: str
    region: int
    capacity: int
    ms_per_layer: float


def regions_for(n: int) -> int:
    return 1 if n <= 4 else 2 if n <= 16 else 4


def make_gpus(n: int, rng: random.Random) -> list[Gpu]:
    regions = regions_for(n)
    gpus = []
    for i in range(n):
        kind, capacity, ms = rng.choice(GPU_TYPES)
        gpus.append(Gpu(f"r{i % regions}-{kind}-{i:03d}", i % regions, capacity, ms * rng.uniform(0.9, 1.1)))
    return gpus


def water_fill(members: list[Gpu], layers: int) -> list[int]:
    """Integer layer counts proportional to speed, capped by capacity, summing to `layers`."""
    speed = [1 / g.ms_per_layer for g in members]
    lo, hi = 0.0, layers / min(speed)
    for _ in range(60):
        mid = (lo + hi) / 2
        filled = sum(min(g.capacity, mid * s) for g, s in zip(members, speed, strict=True))
        lo, hi = (mid, hi) if filled < layers else (lo, mid)
    share = [min(g.capacity, hi * s) for g, s in zip(members, speed, strict=True)]
    counts = [int(x) for x in share]
    by_remainder = sorted(range(len(members)), key=lambda i: counts[i] - share[i])
    for i in itertools.islice(itertools.cycle(by_remainder), layers - sum(counts)):
        counts[i] += 1
    return counts


def place(gpus: list[Gpu]) -> tuple[dict[str, tuple[int, int]], int]:
    """Phase-1-shaped ranges per GPU and the number of full pipelines."""
    ranges: dict[str, tuple[int, int]] = {}
    leftovers: list[Gpu] = []
    pipelines = 0
    for region in sorted({g.region for g in gpus}):
        members: list[Gpu] = []
        for gpu in sorted((g for g in gpus if g.region == region), key=lambda g: (-g.capacity, g.name)):
            members.append(gpu)
            if sum(g.capacity for g in members) >= LAYERS:
                start = 0
                for g, count in zip(members, water_fill(members, LAYERS), strict=True):
                    ranges[g.name] = (start, start + count)
                    start += count
                pipelines, members = pipelines + 1, []
        leftovers.extend(members)
    for gpu in leftovers:
        copies = [sum(s <= layer < e for s, e in ranges.values()) for layer in range(LAYERS)]
        start = min(range(LAYERS), key=lambda layer: (copies[layer], layer))
        ranges[gpu.name] = (start, min(LAYERS, start + gpu.capacity))
    return ranges, pipelines


def fill_table(gpus: list[Gpu], rng: random.Random, now: float) -> LatencyTable:
    table = LatencyTable(default_layer_ms=1.0, default_rtt_ms=max(INTER_RTT_MS),
                         profiled_layer_ms={g.name: g.ms_per_layer for g in gpus})
    for a, b in itertools.combinations(gpus, 2):
        rtt = rng.uniform(*(INTRA_RTT_MS if a.region == b.region else INTER_RTT_MS))
        table.observe_rtt(a.name, b.name, rtt, now)
    for g in gpus:
        table.observe_layer(g.name, g.ms_per_layer, now)
    return table


@dataclass(frozen=True)
class Row:
    gpus: int
    regions: int
    pipelines: int
    copies: float
    segments: int
    edges: int
    engine: str
    compile_ms: float
    refresh_ms: float
    median_ms: float
    p95_ms: float


def run(n: int, requests: int, engine: str, seed: int) -> Row:
    rng = random.Random(seed * 1000 + n)
    gpus = make_gpus(n, rng)
    ranges, pipelines = place(gpus)
    vectorized = None if engine == "auto" else engine == "arrays"
    t0 = time.perf_counter()
    dag = LayerDag(ranges, LAYERS, vectorized=vectorized)
    compile_ms = (time.perf_counter() - t0) * 1000
    table = fill_table(gpus, rng, now=0.0)
    t0 = time.perf_counter()
    base = table.snapshot(dag.gpus, now=1.0)
    refresh_ms = (time.perf_counter() - t0) * 1000
    loads = np.random.default_rng(seed).uniform(1.0, 2.0, size=(VARIANTS, len(dag.gpus)))
    snapshots = [Latencies(base.gpus, base.layer_ms * load, base.link_ms) for load in loads]
    samples = []
    for i in range(requests):
        snapshot = snapshots[i % VARIANTS]
        t0 = time.perf_counter_ns()
        select_chain(dag, snapshot)
        samples.append((time.perf_counter_ns() - t0) / 1e6)
    copies = sum(e - s for s, e in ranges.values()) / LAYERS
    return Row(n, regions_for(n), pipelines, copies, len(dag.segments), dag.edge_count,
               "arrays" if dag.vectorized else "lists", compile_ms, refresh_ms, statistics.median(samples),
               statistics.quantiles(samples, n=20)[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", default="4,16,64,256", help="comma-separated cluster sizes")
    parser.add_argument("--requests", type=int, default=2000, help="timed selections per size")
    parser.add_argument("--engine", choices=("auto", "lists", "arrays"), default="auto")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    print(f"{'GPUs':>5} {'regions':>7} {'pipes':>5} {'R':>6} {'segs':>5} {'edges':>6} {'engine':>6} "
          f"{'compile ms':>10} {'refresh ms':>10} {'median ms':>10} {'p95 ms':>8} {'paper ms':>9} "
          f"{'paper/ours':>10}")
    verdicts = []
    for n in (int(x) for x in args.gpus.split(",")):
        row = run(n, args.requests, args.engine, args.seed)
        paper = PAPER_MS.get(n)
        ratio = f"{paper / row.median_ms:10.1f}" if paper else f"{'-':>10}"
        print(f"{row.gpus:5d} {row.regions:7d} {row.pipelines:5d} {row.copies:6.1f} {row.segments:5d} "
              f"{row.edges:6d} {row.engine:>6} {row.compile_ms:10.2f} {row.refresh_ms:10.2f} "
              f"{row.median_ms:10.4f} {row.p95_ms:8.4f} {paper if paper else '-':>9} {ratio}")
        if paper:
            speedup = paper / row.median_ms
            verdicts.append(f"{n} GPUs {speedup:.1f}x ({'met' if speedup >= TARGET else 'NOT met'})")
    print("R: copies per layer on average (the paper's R-bar); edges: canonical switch edges per request")
    if verdicts:
        print(f"target paper/ours >= {TARGET:g}: " + ", ".join(verdicts))


if __name__ == "__main__":
    main()
