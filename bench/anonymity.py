"""Sender anonymity (seed planetserve.md 4.1, appendix A5, Fig. 8) and message confidentiality (4.2,
Fig. 9) of PlanetServe's clove paths against onion routing and garlic cast (GC), by Monte Carlo on a
10,000-user network where a fraction f of the users collude.

Every trial draws a fresh malicious set of round(f * users) users and an honest source, then builds
- PlanetServe: n paths from the real `choose_routes` (3 relays each, the last is the proxy); one clove
  per path; every link of every path has its own path id, so relays on different paths cannot tell
  that their cloves belong to one message.
- onion: one path from `choose_routes(count=1)` carrying the whole message.
- GC: n non-backtracking random walks of --gc-hops relays over a random overlay of --gc-degree
  neighbours per user. GC also hides the provider, so a clove crosses the initiator's walk and the
  responder's: 6 relays by default (3 + 3). Every clove of a message carries the same identifier.

Anonymity (A5): a chain is a maximal run of consecutive malicious relays on one path; its
predecessor (the source or an honest relay) is a candidate. For one view of the adversary with
candidate set G and scope L (relays it attributes the view to),
    Pr(x = src) = 1 / (L + 1 - f L) for x in G, the rest spread evenly over the other honest users,
and the score is H / log2(users). If |G| / (L + 1 - f L) >= 1 the mass is spread evenly over G.
- onion: one view, its path, L = 3.
- PlanetServe: one view per path, L = 3 (views cannot be joined); the message scores the mean of its
  n views, i.e. what an adversary holding one clove knows about its sender.
- PlanetServe (A5 text): A5 read literally: the candidates of the first k paths pooled with
  L = 3k, the k paths' nodes diluting every guess.
- GC: the shared identifier lets the adversary pool the candidates of all n walks into one view, and
  tells it which walk each chain sits on, so each guess competes only with its own walk: L = walk
  length (--gc-hops).

Confidentiality: the fraction of messages whose content the adversary cannot recover.
- brute force: it recovers when malicious relays sit on >= k of the message's paths (trying every
  k-combination of the cloves it holds).
- without brute force: it must know which cloves belong together. PlanetServe: only cloves on one
  relay could be (never, as `choose_routes` keeps the paths disjoint). GC: the identifier joins
  cloves across colluding relays, so this equals brute force; "GC lone relay" also shows one relay
  alone holding >= k cloves (walks sharing a relay near the source).

    .venv/bin/python bench/anonymity.py [--quick] [--users 10000] [--trials 5000] [--seed 0]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from planetserve.node.overlay.routes import PATH_LENGTH, choose_routes
from planetserve.node.overlay.sida import DEFAULT_K, DEFAULT_N

USERS = 10_000
FRACTIONS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.2, 0.3, 0.5)
GC_HOPS = 2 * PATH_LENGTH
GC_DEGREE = 8
ENTROPY_SYSTEMS = ("planetserve", "planetserve-a5", "onion", "gc")
CONFIDENTIALITY_SYSTEMS = ("planetserve brute force", "planetserve no brute force", "gc", "gc lone relay")
PAPER_ENTROPY_F = 0.05
PAPER_ENTROPY = {"planetserve": 0.965, "planetserve-a5": 0.965, "onion": 0.954, "gc": 0.903}
PAPER_CONFIDENTIALITY_F = 0.1
PAPER_CONFIDENTIALITY = {
    "planetserve brute force": 0.88,
    "planetserve no brute force": 1.0,
    "gc": 0.73,
    "gc lone relay": 1.0,
}


def node_ids(count: int) -> list[bytes]:
    """User-list entries for `choose_routes`: user i is i as 4 big-endian bytes."""
    return [i.to_bytes(4, "big") for i in range(count)]


def routes_of(ids: Sequence[bytes], source: int, count: int, rng: random.Random) -> list[tuple[int, ...]]:
    """`count` paths from the real path selection, as user indices."""
    chosen = choose_routes(ids, count, exclude={ids[source]}, rng=rng)
    return [tuple(int.from_bytes(relay, "big") for relay in route) for route in chosen]


def neighbour_graph(count: int, degree: int, rng: random.Random) -> list[list[int]]:
    """Random overlay for GC's walks: the union of degree/2 random matchings i - perm(i), so every
    user has about `degree` neighbours and the graph is undirected."""
    graph: list[list[int]] = [[] for _ in range(count)]
    for _ in range(max(1, degree // 2)):
        perm = list(range(count))
        rng.shuffle(perm)
        for i, j in enumerate(perm):
            if i != j:
                graph[i].append(j)
                graph[j].append(i)
    return graph


def random_walk(graph: Sequence[Sequence[int]], start: int, hops: int, rng: random.Random) -> tuple[int, ...]:
    """A non-backtracking walk of `hops` relays from `start` (GC's proxy discovery)."""
    walk = []
    previous, here = -1, start
    for _ in range(hops):
        options = [v for v in graph[here] if v != previous] or list(graph[here])
        previous, here = here, rng.choice(options)
        walk.append(here)
    return tuple(walk)


def chain_predecessors(source: int, path: Iterable[int], malicious: Sequence[int]) -> set[int]:
    """Predecessors of the maximal runs of malicious relays on one path (A5's chains)."""
    predecessors = set()
    before, inside = source, False
    for node in path:
        if malicious[node]:
            if not inside:
                predecessors.add(before)
            inside = True
        else:
            inside = False
        before = node
    return predecessors


def a5_entropy(candidates: int, scope: int, fraction: float, users: int, honest: int) -> float:
    """A5's normalized entropy H(S) / log2(users) for one view: `candidates` predecessors, each at
    1 / (scope + 1 - fraction * scope), the rest evenly over the `honest` - `candidates` others."""
    weight = 1.0 / (scope + 1 - fraction * scope)
    others = honest - candidates
    if candidates and (candidates * weight >= 1.0 or others <= 0):
        return math.log2(candidates) / math.log2(users)
    rest = 1.0 - candidates * weight
    bits = -rest * math.log2(rest / others)
    if candidates:
        bits -= candidates * weight * math.log2(weight)
    return bits / math.log2(users)


def binomial_tail(n: int, k: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p)."""
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k, n + 1))


def recovery_closed_form(fraction: float, n: int, k: int, hops: int) -> float:
    """P(malicious relays on >= k of n disjoint paths of `hops` uniformly chosen relays)."""
    return binomial_tail(n, k, 1 - (1 - fraction) ** hops)


def held_by_one(paths: Sequence[Sequence[int]], malicious: Sequence[int]) -> int:
    """The most paths of one message that a single malicious relay sits on."""
    counts = Counter(node for path in paths for node in set(path) if malicious[node])
    return max(counts.values(), default=0)


@dataclass(frozen=True)
class Measured:
    fraction: float
    trials: int
    entropy: dict[str, float]
    """Mean normalized entropy per system."""
    entropy_se: dict[str, float]
    confidentiality: dict[str, float]
    """Fraction of messages the adversary cannot recover, per system and attack."""


def simulate(
    fraction: float,
    *,
    users: int = USERS,
    trials: int = 1000,
    seed: int = 0,
    n: int = DEFAULT_N,
    k: int = DEFAULT_K,
    gc_hops: int = GC_HOPS,
    gc_degree: int = GC_DEGREE,
) -> Measured:
    """Entropy and confidentiality of every system over `trials` independent (malicious set,
    source, paths) draws; one trial scores all systems on the same malicious set and source."""
    rng = random.Random(f"anonymity/{seed}/{fraction}/{users}")
    ids = node_ids(users)
    graph = neighbour_graph(users, gc_degree, rng)
    bad = round(fraction * users)
    f = bad / users
    honest = users - bad
    scores: dict[str, list[float]] = {name: [] for name in ENTROPY_SYSTEMS}
    recovered: Counter[str] = Counter()
    for _ in range(trials):
        malicious = bytearray(users)
        for node in rng.sample(range(users), bad):
            malicious[node] = 1
        source = rng.randrange(users)
        while malicious[source]:
            source = rng.randrange(users)
        routes = routes_of(ids, source, n, rng)
        onion = routes_of(ids, source, 1, rng)[0]
        walks = [random_walk(graph, source, gc_hops, rng) for _ in range(n)]

        per_path = [chain_predecessors(source, r, malicious) for r in routes]
        scores["planetserve"].append(
            statistics.fmean(a5_entropy(len(g), PATH_LENGTH, f, users, honest) for g in per_path)
        )
        pooled = set().union(*per_path[:k])
        scores["planetserve-a5"].append(a5_entropy(len(pooled), PATH_LENGTH * k, f, users, honest))
        scores["onion"].append(
            a5_entropy(len(chain_predecessors(source, onion, malicious)), PATH_LENGTH, f, users, honest)
        )
        gc_pooled = set().union(*(chain_predecessors(source, w, malicious) for w in walks))
        scores["gc"].append(a5_entropy(len(gc_pooled), gc_hops, f, users, honest))

        compromised = sum(any(malicious[v] for v in r) for r in routes)
        walks_compromised = sum(any(malicious[v] for v in w) for w in walks)
        recovered["planetserve brute force"] += compromised >= k
        recovered["planetserve no brute force"] += held_by_one(routes, malicious) >= k
        recovered["gc"] += walks_compromised >= k
        recovered["gc lone relay"] += held_by_one(walks, malicious) >= k
    return Measured(
        fraction=fraction,
        trials=trials,
        entropy={name: statistics.fmean(v) for name, v in scores.items()},
        entropy_se={name: statistics.pstdev(v) / math.sqrt(len(v)) for name, v in scores.items()},
        confidentiality={name: 1 - recovered[name] / trials for name in CONFIDENTIALITY_SYSTEMS},
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="400 trials per fraction instead of 5,000")
    parser.add_argument("--users", type=int, default=USERS)
    parser.add_argument("--trials", type=int)
    parser.add_argument("--fractions", default=",".join(str(f) for f in FRACTIONS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n", type=int, default=DEFAULT_N)
    parser.add_argument("--k", type=int, default=DEFAULT_K)
    parser.add_argument("--gc-hops", type=int, default=GC_HOPS)
    parser.add_argument("--gc-degree", type=int, default=GC_DEGREE)
    args = parser.parse_args()
    trials = args.trials or (400 if args.quick else 5000)
    fractions = [float(f) for f in args.fractions.split(",")]

    t0 = time.perf_counter()
    results = [
        simulate(f, users=args.users, trials=trials, seed=args.seed, n=args.n, k=args.k,
                 gc_hops=args.gc_hops, gc_degree=args.gc_degree)
        for f in fractions
    ]
    print(f"{args.users:,} users, (n, k) = ({args.n}, {args.k}), {PATH_LENGTH}-relay paths, GC walks of "
          f"{args.gc_hops} relays on a degree-{args.gc_degree} overlay, {trials} trials per f, "
          f"seed {args.seed}")
    print()
    print("Normalized entropy H(S)/log2(N), mean over trials (largest standard error shown)")
    row = "{:>6} {:>12} {:>15} {:>9} {:>9} {:>9}"
    print(row.format("f", "PlanetServe", "PS (A5 text)", "onion", "GC", "max s.e."))
    for r in results:
        e = r.entropy
        print(row.format(r.fraction, f"{e['planetserve']:.4f}", f"{e['planetserve-a5']:.4f}",
                         f"{e['onion']:.4f}", f"{e['gc']:.4f}", f"{max(r.entropy_se.values()):.4f}"))
    anchor = next((r for r in results if r.fraction == PAPER_ENTROPY_F), None)
    if anchor:
        parts = [f"{name} {anchor.entropy[name]:.4f}/{paper} = {anchor.entropy[name] / paper:.3f}"
                 for name, paper in PAPER_ENTROPY.items()]
        print(f"measured/paper at f = {PAPER_ENTROPY_F}: " + ", ".join(parts))

    print()
    print("Confidentiality: fraction of messages the colluding relays cannot recover")
    row = "{:>6} {:>10} {:>10} {:>11} {:>9} {:>10} {:>9}"
    print(row.format("f", "PS brute", "PS exact", "PS no brute", "GC", "GC exact", "GC lone"))
    for r in results:
        c = r.confidentiality
        print(row.format(
            r.fraction,
            f"{c['planetserve brute force']:.4f}",
            f"{1 - recovery_closed_form(r.fraction, args.n, args.k, PATH_LENGTH):.4f}",
            f"{c['planetserve no brute force']:.4f}",
            f"{c['gc']:.4f}",
            f"{1 - recovery_closed_form(r.fraction, args.n, args.k, args.gc_hops):.4f}",
            f"{c['gc lone relay']:.4f}",
        ))
    anchor = next((r for r in results if r.fraction == PAPER_CONFIDENTIALITY_F), None)
    if anchor:
        measured = anchor.confidentiality
        parts = [f"{name} {measured[name]:.4f}/{paper} = {measured[name] / paper:.3f}"
                 for name, paper in PAPER_CONFIDENTIALITY.items()]
        print(f"measured/paper at f = {PAPER_CONFIDENTIALITY_F}: " + ", ".join(parts))
        four = 1 - recovery_closed_form(PAPER_CONFIDENTIALITY_F, args.n, args.k, PATH_LENGTH + 1)
        print(f"closed form with {PATH_LENGTH + 1} relays per PlanetServe path at f = "
              f"{PAPER_CONFIDENTIALITY_F}: {four:.4f}")
    print(f"{time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
