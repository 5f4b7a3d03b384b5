"""HR-tree false positives, lookup time and memory (seed planetserve.md 3.3).

False positives: the paper puts the false-positive rate of a depth-d match at 1/256^d for 8-bit chunk
hashes. Each trial searches a fresh prompt whose chunks share no tokens with anything stored, and
records the depth it matched by chance; the rate for d is the fraction of trials reaching depth >= d.
For a tree of one stored path the expected rate is exactly 1/2^(bits·d); for a populated tree it is
(tree nodes at depth d) / 2^(bits·d), which the rows with more paths show (the paper's figure is the
one-path case). Each row's trials are spread over 16 trees with different stored paths. 1/256^2 is
too small to measure well at 8 bits in reasonable time, so 4- and 2-bit hashes carry the curve deeper:
the claim is about the hash, not about the width. The ratio column is measured / expected with a 95%
Wilson interval.

Lookup: search() for an 8k-token prompt (128 chunks of 64 tokens) in a tree of 10,000 other prompts:
a full hit hashes every chunk, a miss stops at the first unmatched one (10,000 prompts take all 256
first-chunk values, so at 8 bits every miss matches one chunk by chance).

Memory: tracemalloc of a tree holding 100,000 prefixes (tree nodes), with one holder per prefix and with
four, and of the sender-side LocalCache (which keeps each chunk's tokens) for the same prompts: its
tuples are counted, the int objects in them are the caller's and are not.

    .venv/bin/python bench/hrtree_fpr.py [--trials 2000000] [--quick]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
import tracemalloc
from collections import Counter

from planetserve.node.routing.cachesync import LocalCache
from planetserve.node.routing.hrtree import ChunkHasher, HRTree
from planetserve.node.routing.sentry import ChunkPlan

KEY = b"bench-group-key-0123456789abcdef"
CHUNK = 16


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), centre + half


def chance_depths(tree: HRTree, trials: range, depth: int, seed: int) -> Counter[int]:
    """Matched depth of prompts whose chunks are all new: stored tokens are >= 2^31, and each query
    chunk starts with (trial number, chunk index)."""
    filler = [random.Random(seed).randrange(1 << 30) for _ in range(CHUNK - 2)]
    depths: Counter[int] = Counter()
    for i in trials:
        prompt: list[int] = []
        for j in range(depth):
            prompt += [i, j, *filler]
        depths[tree.search(prompt).depth] += 1
    return depths


def fpr_rows(bits: int, stored: int, depth: int, trials: int, seed: int, trees: int = 16) -> list[tuple]:
    """The trials are spread over `trees` trees with different stored paths, so that the measurement is
    of the hash rather than of how one stored path's hashes happen to fall."""
    hits_at: Counter[int] = Counter()
    expected_at: Counter[int] = Counter()
    per_tree = trials // trees
    for t in range(trees):
        rng = random.Random(seed * 1000 + t)
        tree = HRTree(ChunkHasher(ChunkPlan(default_chunk=CHUNK), KEY, bits))
        tree.table.upsert("holder")
        for _ in range(stored):
            tree.insert("holder", [rng.randrange(1 << 31, 1 << 32) for _ in range(CHUNK * depth)])
        nodes_at = Counter(len(p) for p in _all_prefixes(tree))
        depths = chance_depths(tree, range(t * per_tree, (t + 1) * per_tree), depth, seed)
        for d in range(1, depth + 1):
            hits_at[d] += sum(n for k, n in depths.items() if k >= d)
            expected_at[d] += nodes_at[d] / 2 ** (bits * d) / trees
    n = per_tree * trees
    rows = []
    for d in range(1, depth + 1):
        hits, expected = hits_at[d], expected_at[d]
        lo, hi = wilson(hits, n)
        rows.append((bits, stored, d, n, hits, hits / n, expected, lo / expected, hi / expected))
    return rows


def _all_prefixes(tree: HRTree) -> set[tuple[int, ...]]:
    return {p[:i] for p in tree.paths("holder") for i in range(1, len(p) + 1)}


def lookup_times(repeats: int) -> list[tuple[str, float, int]]:
    rng = random.Random(7)
    tree = HRTree(ChunkHasher(ChunkPlan(default_chunk=64), KEY, 8))
    tree.table.upsert("a")
    tree.table.upsert("b")
    for _ in range(10_000):
        tree.insert("b", [rng.randrange(50_000) for _ in range(512)])
    prompt = [rng.randrange(50_000) for _ in range(8192)]
    tree.insert("a", prompt)
    other = [rng.randrange(50_000, 60_000) for _ in range(8192)]
    path = tree.hasher.path(prompt)
    cases = {"search, full hit (128 chunks)": lambda: tree.search(prompt),
             "search, miss": lambda: tree.search(other),
             "hash the 128 chunks only": lambda: tree.hasher.path(prompt),
             "search_path, full hit": lambda: tree.search_path(path)}
    out = []
    for name, fn in cases.items():
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            result = fn()
            samples.append(time.perf_counter() - t0)
        depth = result.depth if hasattr(result, "depth") else len(result)
        out.append((name, statistics.median(samples) * 1e6, depth))
    return out


def memory_rows(prefixes: int) -> list[tuple[str, int, float]]:
    """Prompts of 8 chunks until the tree has `prefixes` nodes (8-bit hashes merge some near the root)."""
    rng = random.Random(9)
    hasher = ChunkHasher(ChunkPlan(default_chunk=64), KEY, 8)
    counter = HRTree(hasher)
    counter.table.upsert("n0")
    prompts = []
    while len(counter) < prefixes:
        prompts.append([rng.randrange(1 << 20) for _ in range(64 * 8)])
        counter.insert("n0", prompts[-1])
    paths = [hasher.path(p) for p in prompts]
    del counter
    rows = []
    for holders in (1, 4):
        tracemalloc.start()
        tree = HRTree(hasher)
        for h in range(holders):
            tree.table.upsert(f"n{h}")
        for path in paths:
            for h in range(holders):
                tree.insert_path(f"n{h}", path)
        used = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        rows.append((f"HRTree, {holders} holder(s) per prefix", len(tree), used / len(tree)))
        del tree
    tracemalloc.start()
    local = LocalCache(hasher, max_entries=10 * prefixes, max_depth=4096)
    for p in prompts:
        local.stored(p)
    used = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    rows.append(("LocalCache (keeps 64 tokens per chunk)", local.entries, used / local.entries))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=2_000_000, help="trials for the 8-bit single-path row")
    parser.add_argument("--quick", action="store_true", help="a tenth of the trials")
    args = parser.parse_args()
    scale = 0.1 if args.quick else 1.0
    trials = max(1000, int(args.trials * scale))

    print("False-positive rate of a depth-d match (trials: prompts sharing no chunk with the tree)")
    print(f"{'bits':>4} {'paths':>6} {'d':>2} {'trials':>9} {'hits':>7} {'measured':>11} {'expected':>11} "
          f"{'ratio 95% CI':>15}")
    cases = [(8, 1, 2, trials), (4, 1, 4, trials // 4), (2, 1, 6, trials // 8),
             (8, 64, 2, trials // 4), (4, 16, 3, trials // 8)]
    for bits, stored, depth, n in cases:
        for row in fpr_rows(bits, stored, depth, n, seed=bits * 100 + stored):
            b, s, d, n_, hits, measured, expected, lo, hi = row
            ci = f"{lo:.2f}-{hi:.2f}" if hits else f"<{hi:.2f}"
            print(f"{b:>4} {s:>6} {d:>2} {n_:>9} {hits:>7} {measured:11.3e} {expected:11.3e} {ci:>15}")
    print("(expected = tree nodes at depth d / 2^(bits*d); for one stored path that is the paper's 1/256^d "
          "at 8 bits)")

    print("\nLookup of an 8,192-token prompt (64-token chunks) in a tree of 10,000 other prompts")
    print(f"{'operation':34} {'median µs':>10} {'depth':>6}")
    for name, micros, depth in lookup_times(200 if not args.quick else 50):
        print(f"{name:34} {micros:10.1f} {depth:>6}")

    prefixes = 100_000
    print(f"\nMemory for {prefixes:,} cached prefixes (tracemalloc)")
    print(f"{'structure':40} {'prefixes':>9} {'bytes/prefix':>13} {'MiB per 100k':>13}")
    for name, count, per in memory_rows(prefixes):
        print(f"{name:40} {count:>9} {per:13.0f} {per * 100_000 / 2**20:13.1f}")


if __name__ == "__main__":
    main()
