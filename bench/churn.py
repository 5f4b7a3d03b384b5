"""Path failures and churn (seed planetserve.md appendix A4 and 5.2, Figs. 13/14): how often k of the
n clove paths survive, for PlanetServe ((n, k) = (4, 3), 3-relay paths from the real `choose_routes`),
onion routing (one 3-relay path, (1, 1)) and garlic cast (n random walks of 6 relays, as in
`bench/anonymity.py`).

A4: every relay fails independently with probability f during one round of communication, so
    P(X >= k) = sum_{i=k}^{n} C(n, i) (1 - f)^{3i} (1 - (1 - f)^3)^{n - i}.
It is computed exactly and checked by simulation: a --nodes network, paths for --sources users,
each node failing with probability f in every draw. The paper: > 95 % at f = 3 %.

Churn (Figs. 13/14): a 3,119-node network where departures form a Poisson process of 200 nodes per
minute; each departure picks a uniformly random node, which is replaced at once by a new node in the
same slot (the size stays 3,119; a newcomer takes over its slot's overlay neighbours). Each slot then
sees an independent Poisson process of rate 200 / 3,119 per minute, so a relay survives t minutes
with probability exp(-200 t / 3,119) and the closed forms below are exact for disjoint paths.
- survival: paths built once at t = 0 and never rebuilt; a communication survives while >= k of its
  n paths have lost no relay (the user's own departure is not counted). The paper: PlanetServe above
  80 % after 15 minutes.
- delivery: every user sends a message each --interval seconds; it is delivered when >= k paths are
  intact at that moment. "rebuilt": after each message the user replaces every dead path (PlanetServe
  and onion through `choose_routes`, avoiding its other paths' relays; GC by a new walk), with no
  spare proxies (N = n). "built once": the same messages over the t = 0 paths.

    .venv/bin/python bench/churn.py [--quick] [--nodes 3119] [--rate 200] [--minutes 20] [--seed 0]
"""

from __future__ import annotations

import argparse
import bisect
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.anonymity import (  # noqa: E402
    GC_DEGREE,
    GC_HOPS,
    binomial_tail,
    neighbour_graph,
    node_ids,
    random_walk,
    routes_of,
)
from planetserve.node.overlay.routes import PATH_LENGTH, choose_routes
from planetserve.node.overlay.sida import DEFAULT_K, DEFAULT_N

A4_FRACTIONS = (0.01, 0.03, 0.05, 0.1)
PAPER_A4 = (0.03, 0.95)
"""At f = 3 % PlanetServe's success rate is > 95 %."""
NODES = 3119
RATE = 200.0
"""Departures per minute."""
MINUTES = 20
PAPER_SURVIVAL = (15, 0.80)
"""PlanetServe's survival is above 80 % after 15 minutes."""
SYSTEMS = ("planetserve", "onion", "gc")
REPORT_MINUTES = (0, 1, 2, 3, 4, 5, 6, 8, 10, 15, 20)


def a4_success(fraction: float, n: int, k: int, hops: int = PATH_LENGTH) -> float:
    """A4's P(X >= k): at least k of n paths of `hops` relays have no failed relay."""
    return binomial_tail(n, k, (1 - fraction) ** hops)


def a4_simulated(
    fraction: float,
    n: int,
    k: int,
    *,
    nodes: int = NODES,
    sources: int = 200,
    draws: int = 200,
    seed: int = 0,
) -> float:
    """A4 by simulation: routes from `choose_routes` for `sources` users, then `draws` independent
    failure draws of the whole network (each node down with probability `fraction`)."""
    rng = random.Random(f"a4/{seed}/{fraction}/{n}/{k}")
    ids = node_ids(nodes)
    routes = np.array([routes_of(ids, s, n, rng) for s in rng.sample(range(nodes), sources)])
    failed = np.random.default_rng(rng.getrandbits(64)).random((draws, nodes)) < fraction
    intact = ~failed[:, routes].any(axis=-1)
    return float((intact.sum(axis=-1) >= k).mean())


def relay_survival(minutes: float, rate: float = RATE, nodes: int = NODES) -> float:
    """P(one slot sees no departure in `minutes`) under uniform Poisson churn."""
    return math.exp(-rate * minutes / nodes)


def survival_closed_form(
    minutes: float, n: int, k: int, hops: int, rate: float = RATE, nodes: int = NODES
) -> float:
    """P(>= k of n disjoint paths of `hops` relays survive `minutes` of churn)."""
    return binomial_tail(n, k, relay_survival(minutes, rate, nodes) ** hops)


def bisect_root(fn: Callable[[float], float], low: float, high: float, steps: int = 100) -> float:
    """A root of a function whose sign changes once between `low` and `high`."""
    sign = fn(low) > 0
    for _ in range(steps):
        mid = (low + high) / 2
        if (fn(mid) > 0) == sign:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def rate_for(target: float, minutes: float, n: int, k: int, nodes: int = NODES) -> float:
    """The churn rate (departures per minute) at which PlanetServe's built-once survival after
    `minutes` equals `target`."""
    return bisect_root(lambda r: survival_closed_form(minutes, n, k, PATH_LENGTH, r, nodes) - target,
                       1e-9, 10.0 * nodes)


def crossover_minutes(n: int, k: int, rate: float = RATE, nodes: int = NODES) -> float:
    """When PlanetServe's built-once survival (>= k of n paths) first falls below one onion path's:
    0 if it starts below (k = n), inf if it never does (k = 1)."""
    def gap(t: float) -> float:
        return survival_closed_form(t, n, k, PATH_LENGTH, rate, nodes) - survival_closed_form(
            t, 1, 1, PATH_LENGTH, rate, nodes
        )

    step = nodes / rate / 100
    grid = [step * i for i in range(1, 10_001)]
    if gap(grid[0]) <= 0:
        return 0.0
    low = next((t for t in grid if gap(t) < 0), None)
    return math.inf if low is None else bisect_root(gap, low - step, low)


@dataclass(frozen=True)
class Churn:
    """One realisation of the departures: per slot, the sorted times (minutes) its occupant left."""

    departures: list[list[float]]

    @classmethod
    def draw(cls, nodes: int, rate: float, minutes: float, rng: np.random.Generator) -> Churn:
        count = rng.poisson(rate * minutes)
        times = np.sort(rng.uniform(0.0, minutes, count))
        slots = rng.integers(0, nodes, count)
        departures: list[list[float]] = [[] for _ in range(nodes)]
        for t, s in zip(times.tolist(), slots.tolist(), strict=True):
            departures[s].append(t)
        return cls(departures)

    def death(self, path: Sequence[int], built: float = 0.0) -> float:
        """When a path built at `built` loses its first relay (inf if it outlives the run)."""
        first = math.inf
        for slot in path:
            times = self.departures[slot]
            i = bisect.bisect_right(times, built)
            if i < len(times):
                first = min(first, times[i])
        return first


def comm_death(deaths: Sequence[float], n: int, k: int) -> float:
    """A communication over n paths needing k dies with its (n - k + 1)-th path."""
    return sorted(deaths)[n - k]


def build_paths(
    system: str, source: int, *, ids: Sequence[bytes], graph: Sequence[Sequence[int]], n: int, gc_hops: int,
    rng: random.Random,
) -> list[tuple[int, ...]]:
    """A user's paths at t = 0, the way each system builds them."""
    if system == "gc":
        return [random_walk(graph, source, gc_hops, rng) for _ in range(n)]
    return routes_of(ids, source, 1 if system == "onion" else n, rng)


def replacement(
    system: str, source: int, others: Sequence[Sequence[int]], *, ids: Sequence[bytes],
    graph: Sequence[Sequence[int]], gc_hops: int, rng: random.Random,
) -> tuple[int, ...]:
    """A new path for a dead one; `choose_routes` keeps it off the relays of the user's other paths."""
    if system == "gc":
        return random_walk(graph, source, gc_hops, rng)
    exclude = {ids[source]} | {ids[v] for path in others for v in path}
    (route,) = choose_routes(ids, 1, exclude=exclude, rng=rng)
    return tuple(int.from_bytes(relay, "big") for relay in route)


def rebuilt_deliveries(
    churn: Churn,
    paths: Sequence[tuple[int, ...]],
    need: int,
    sends: Sequence[float],
    renew: Callable[[list[tuple[int, ...]]], tuple[int, ...]],
) -> int:
    """Messages delivered at times `sends` when every dead path is replaced (by `renew`, given the
    user's other paths) right after the message that found it dead."""
    current = [(p, 0.0) for p in paths]
    delivered = 0
    for t in sends:
        alive = [churn.death(p, built) > t for p, built in current]
        delivered += sum(alive) >= need
        for i in (i for i, ok in enumerate(alive) if not ok):
            current[i] = (renew([p for j, (p, _) in enumerate(current) if j != i]), t)
    return delivered


@dataclass(frozen=True)
class ChurnResult:
    samples: int
    """Users simulated per system (sources x networks)."""
    survival: dict[str, list[float]]
    """Per system, the fraction of communications alive at minute 0, 1, ..., minutes."""
    delivery: dict[str, dict[str, float]]
    """Per system, the delivered fraction of messages for "built once" and "rebuilt"."""


def simulate_churn(
    *,
    nodes: int = NODES,
    rate: float = RATE,
    minutes: int = MINUTES,
    sources: int = 300,
    networks: int = 10,
    interval_s: float = 30.0,
    seed: int = 0,
    n: int = DEFAULT_N,
    k: int = DEFAULT_K,
    gc_hops: int = GC_HOPS,
    gc_degree: int = GC_DEGREE,
) -> ChurnResult:
    """Survival of paths built once, and delivery with and without rebuilding, for `sources` users
    in each of `networks` independent churn realisations."""
    ids = node_ids(nodes)
    sends = [j * interval_s / 60 for j in range(1, int(minutes * 60 / interval_s) + 1)]
    deaths: dict[str, list[float]] = {s: [] for s in SYSTEMS}
    delivered = {s: {"built once": 0, "rebuilt": 0} for s in SYSTEMS}
    for net in range(networks):
        rng = random.Random(f"churn/{seed}/{net}/{nodes}")
        churn = Churn.draw(nodes, rate, minutes, np.random.default_rng(rng.getrandbits(64)))
        graph = neighbour_graph(nodes, gc_degree, rng)
        for source in rng.sample(range(nodes), sources):
            for system in SYSTEMS:
                count, need = (1, 1) if system == "onion" else (n, k)
                paths = build_paths(system, source, ids=ids, graph=graph, n=n, gc_hops=gc_hops, rng=rng)
                ends = [churn.death(p) for p in paths]
                deaths[system].append(comm_death(ends, count, need))
                delivered[system]["built once"] += sum(sum(e > t for e in ends) >= need for t in sends)
                renew = partial(replacement, system, source, ids=ids, graph=graph, gc_hops=gc_hops, rng=rng)
                delivered[system]["rebuilt"] += rebuilt_deliveries(churn, paths, need, sends, renew)
    samples = networks * sources
    return ChurnResult(
        samples=samples,
        survival={s: [sum(d > m for d in deaths[s]) / samples for m in range(minutes + 1)] for s in SYSTEMS},
        delivery={s: {mode: v / (samples * len(sends)) for mode, v in delivered[s].items()} for s in SYSTEMS},
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer users, draws and networks")
    parser.add_argument("--nodes", type=int, default=NODES)
    parser.add_argument("--rate", type=float, default=RATE, help="departures per minute")
    parser.add_argument("--minutes", type=int, default=MINUTES)
    parser.add_argument("--interval", type=float, default=30.0, help="seconds between a user's messages")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n", type=int, default=DEFAULT_N)
    parser.add_argument("--k", type=int, default=DEFAULT_K)
    parser.add_argument("--gc-hops", type=int, default=GC_HOPS)
    parser.add_argument("--gc-degree", type=int, default=GC_DEGREE)
    args = parser.parse_args()
    a4_sources, a4_draws = (100, 100) if args.quick else (500, 400)
    sources, networks = (100, 2) if args.quick else (300, 10)
    n, k = args.n, args.k
    t0 = time.perf_counter()

    print(f"A4: P(>= k of n paths intact), every relay down with probability f; simulation on {args.nodes:,} "
          f"nodes, {a4_sources} users x {a4_draws} failure draws")
    row = "{:>6} {:>10} {:>10} {:>10} {:>10}"
    print(row.format("f", f"PS ({n},{k})", "simulated", "onion", "simulated"))
    for f in A4_FRACTIONS:
        sim = [a4_simulated(f, c, q, nodes=args.nodes, sources=a4_sources, draws=a4_draws, seed=args.seed)
               for c, q in ((n, k), (1, 1))]
        print(row.format(f, f"{a4_success(f, n, k):.4f}", f"{sim[0]:.4f}", f"{a4_success(f, 1, 1):.4f}",
                         f"{sim[1]:.4f}"))
    f, floor = PAPER_A4
    print(f"paper: > {floor:.0%} at f = {f:.0%}; exact {a4_success(f, n, k):.4f} "
          f"(measured/paper floor {a4_success(f, n, k) / floor:.3f})")

    result = simulate_churn(nodes=args.nodes, rate=args.rate, minutes=args.minutes, sources=sources,
                            networks=networks, interval_s=args.interval, seed=args.seed, n=n, k=k,
                            gc_hops=args.gc_hops, gc_degree=args.gc_degree)
    print()
    print(f"Churn: {args.nodes:,} nodes, Poisson departures {args.rate:g}/min, each replaced at once; "
          f"paths built at t = 0 and never rebuilt; {result.samples} users per system ({networks} networks)")
    row = "{:>4} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8}"
    print(row.format("min", "PS", "exact", "onion", "exact", "GC", "exact"))
    for m in (m for m in REPORT_MINUTES if m <= args.minutes):
        exact = [survival_closed_form(m, c, q, h, args.rate, args.nodes)
                 for c, q, h in ((n, k, PATH_LENGTH), (1, 1, PATH_LENGTH), (n, k, args.gc_hops))]
        print(row.format(m, f"{result.survival['planetserve'][m]:.4f}", f"{exact[0]:.4f}",
                         f"{result.survival['onion'][m]:.4f}", f"{exact[1]:.4f}",
                         f"{result.survival['gc'][m]:.4f}", f"{exact[2]:.4f}"))
    at, paper = PAPER_SURVIVAL
    if at <= args.minutes:
        measured = result.survival["planetserve"][at]
        print(f"paper: PlanetServe > {paper:.0%} after {at} min; measured {measured:.4f} "
              f"(measured/paper {measured / paper:.3f})")
    needed = rate_for(paper, at, n, k, args.nodes)
    print(f"PlanetServe keeps {paper:.0%} at {at} min only with <= {needed:.1f} departures/min on "
          f"{args.nodes:,} nodes (mean stay {args.nodes / needed:.0f} min; "
          f"here {args.nodes / args.rate:.1f} min)")
    print(f"PlanetServe ({n},{k}) falls below one onion path after "
          f"{crossover_minutes(n, k, args.rate, args.nodes):.2f} min")

    print()
    print(f"Delivery: one message per user every {args.interval:g} s for {args.minutes} min")
    row = "{:>12} {:>11} {:>9}"
    print(row.format("system", "built once", "rebuilt"))
    for system in SYSTEMS:
        d = result.delivery[system]
        print(row.format(system, f"{d['built once']:.4f}", f"{d['rebuilt']:.4f}"))
    print(f"{time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
