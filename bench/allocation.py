"""Parallax phase-1 scheduling time (seed parallax.txt 4.3, Fig. 5): `registry.allocation.allocate`.

The paper: phase 1 "increases from 0.10 ms (4 GPUs) to 8.55 ms (256 GPUs)". Here an L = 80 model
(a 70B-class model at 16 bits, about 1.75 GB a layer) is placed on seeded heterogeneous clusters of
4, 16, 64 and 256 GPUs in regions of at most 64 (256 GPUs: 4 regions of 64). Each GPU is drawn from
the mix below (layer capacity from VRAM, dense FP16 GFLOP/s); a cluster is redrawn until every region
holds the model. Z uses T_comp 50 ms, r_RTT 10 ms (the paper's testbed) and α 1 unless told otherwise.
Every cluster is allocated --repeats times; the table gives the median and p95 over all runs, the
mean number of pipelines and stages chosen, and the paper's figure with the ratio paper/ours.

    .venv/bin/python bench/allocation.py [--clusters 20] [--repeats 20] [--seed 0] [--alpha 1]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from fractions import Fraction
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from planetserve.registry.allocation import AllocationParams, Gpu, allocate  # noqa: E402

NUM_LAYERS = 80
MIX = (
    ("H100-80G", 40, 989_000, 10),
    ("A100-80G", 40, 312_000, 5),
    ("L40S", 24, 362_000, 8),
    ("A6000", 24, 155_000, 7),
    ("A100-40G", 20, 312_000, 10),
    ("RTX5090", 16, 210_000, 20),
    ("RTX4090", 12, 165_000, 15),
    ("RTX3090", 12, 71_000, 10),
    ("T4", 8, 65_000, 12),
    ("RTX3080", 5, 60_000, 8),
)
"""(name, layer capacity for L = 80 with KV headroom, GFLOP/s, weight in the draw)."""
SCALES = (4, 16, 64, 256)
REGION_SIZE = 64
PAPER_MS = {4: 0.10, 256: 8.55}


def draw_cluster(rng: random.Random, gpus: int) -> list[Gpu]:
    regions = max(1, gpus // REGION_SIZE)
    while True:
        kinds = rng.choices(MIX, [w for *_, w in MIX], k=gpus)
        cluster = [Gpu(f"g{i:04d}", f"region{i % regions}", c, f) for i, (_, c, f, _) in enumerate(kinds)]
        held = [sum(g.layers for g in cluster if g.region == f"region{r}") for r in range(regions)]
        if min(held) >= NUM_LAYERS:
            return cluster


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clusters", type=int, default=20, help="seeded clusters per scale")
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per cluster")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--alpha", type=Fraction, default=Fraction(1))
    parser.add_argument("--t-comp-us", type=int, default=50_000)
    parser.add_argument("--rtt-us", type=int, default=10_000)
    args = parser.parse_args()
    params = AllocationParams(NUM_LAYERS, args.t_comp_us, args.rtt_us, args.alpha)

    print(
        f"{'GPUs':>5} {'regions':>7} {'median ms':>10} {'p95 ms':>8} {'pipelines':>9} {'stages':>7} "
        f"{'paper ms':>9} {'paper/ours':>10}"
    )
    for scale in SCALES:
        rng = random.Random(f"{args.seed}/{scale}")
        times, pipelines, stages = [], [], []
        for _ in range(args.clusters):
            cluster = draw_cluster(rng, scale)
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                plan = allocate(cluster, params)
                times.append(time.perf_counter() - t0)
            pipelines.append(len(plan.pipelines))
            stages.append(sum(len(p.stages) for p in plan.pipelines))
        median = statistics.median(times) * 1000
        p95 = statistics.quantiles(times, n=20)[-1] * 1000 if len(times) > 1 else median
        paper = PAPER_MS.get(scale)
        paper_cols = f"{paper:9.2f} {paper / median:9.1f}x" if paper else f"{'-':>9} {'-':>10}"
        print(
            f"{scale:>5} {max(1, scale // REGION_SIZE):>7} {median:10.3f} {p95:8.3f} "
            f"{statistics.fmean(pipelines):9.1f} {statistics.fmean(stages):7.1f} {paper_cols}"
        )


if __name__ == "__main__":
    main()
