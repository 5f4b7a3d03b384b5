"""Per-request GPU chain selection over a layer placement (Parallax §3.3, phase 2 scheduling).

The placement (phase 1's output) gives every GPU one contiguous half-open layer range [start, end) of an
L-layer model; ranges may overlap or repeat (replicas). The paper's DAG has a node (l, g) for every
layer l that GPU g hosts and an edge (l, g) -> (l+1, g') whenever g' hosts l+1, weighted
rho(g, g') + tau(g') — rho 0 when g' = g (staying on a GPU costs no link). A chain is a path through all
L layers, written as hops (gpu, start, end): it may enter a GPU at any layer it hosts and leave it at
any later one, and may come back to a GPU it left.

Weights. tau(g) is GPU g's latency per layer (ms), one number per GPU: decoder layers are identical in
shape, so what differs between layers of one GPU is noise; the live value includes the GPU's load,
which is how the sweep deflects traffic from busy pipelines. rho(g, g') is the one-way link latency
(ms), RTT / 2 of a measured round trip (`LatencyTable` halves what it is fed).

Sweep. One forward pass over the layer boundaries where some range starts or ends (between two of
them the set of hosts is fixed), then back-pointers from the best last GPU. A switch g -> g' is only
tried at a boundary where g's range ends or g''s begins ("canonical" switches); staying is free. This is
exact (some best chain of the layer DAG is canonical) whenever rho >= 0 obeys the triangle inequality:
a switch at a layer both GPUs host can move by one layer so that the faster of the two runs one more
layer, at no extra cost; when that empties a hop, dropping the hop costs no more by the triangle
inequality; so switches slide until one of the two ranges begins or ends there. With triangle violations
the sweep can miss a chain that runs one layer on a GPU only to use it as a network shortcut; what it
returns is still a valid chain with its exact latency. The work is one relaxation per canonical edge:
at each boundary, (GPUs ending there) x (hosts of the next layer) + (hosts of the previous layer) x
(GPUs starting there) + one stay per continuing host. That is at most L R^2 in all (R: hosts per layer,
the paper's R-bar) and at most (2 N + boundaries) R (N GPUs): since each GPU ends and starts once, a
sweep at 256 GPUs relaxes tens of thousands of edges rather than L R^2.

Ties. At each boundary a GPU keeps its stay edge on a tie, otherwise takes the source with the lowest
id; among equal last GPUs the lowest id wins. GPUs are ordered by id before the sweep, so equal inputs
give the same chain whatever order they come in. Excluded GPUs get an infinite tau.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from planetserve.node.routing.balance import LatencyEWMA

ALPHA = 0.3
"""EWMA weight of a new sample: values arrive every 1-2 s and carry load, so three samples at a new level
move the estimate 66 % of the way there (1 - 0.7^3), while one noisy sample moves it by 30 % of its
error."""
MAX_AGE_S = 5.0
"""A value not refreshed for this long (2.5 to 5 publication intervals of 1-2 s) is stale."""
VECTORIZE_EDGES_PER_BOUNDARY = 8
"""Above this many edges per boundary on average the sweep runs on numpy arrays (four array operations
per boundary, about 1 us each); below it on Python lists, cheaper per call but not per edge (measured
crossover: 7-11 edges per boundary)."""


class Hop(NamedTuple):
    gpu: str
    start: int
    end: int


class Chain(NamedTuple):
    hops: tuple[Hop, ...]
    latency_ms: float

    @property
    def gpus(self) -> frozenset[str]:
        return frozenset(hop.gpu for hop in self.hops)


class NoChainError(LookupError):
    """No chain of usable GPUs covers every layer."""


@dataclass(frozen=True)
class Latencies:
    """One snapshot of the live map, aligned to `gpus` (sorted): what a sweep reads."""

    gpus: tuple[str, ...]
    layer_ms: np.ndarray
    """tau: shape (N,), ms per layer."""
    link_ms: np.ndarray
    """rho: shape (N, N), one-way ms from row to column; zero diagonal; inf = unusable link."""

    def __post_init__(self) -> None:
        n = len(self.gpus)
        if list(self.gpus) != sorted(set(self.gpus)):
            raise ValueError("gpus must be distinct and sorted by id")
        if self.layer_ms.shape != (n,) or self.link_ms.shape != (n, n):
            raise ValueError(f"need layer_ms of shape ({n},) and link_ms of shape ({n}, {n}), "
                             f"got {self.layer_ms.shape} and {self.link_ms.shape}")
        if not (np.isfinite(self.layer_ms).all() and (self.layer_ms >= 0).all()):
            raise ValueError("layer latencies must be finite and non-negative")
        if np.isnan(self.link_ms).any() or (self.link_ms < 0).any() or np.diagonal(self.link_ms).any():
            raise ValueError("link latencies must be non-negative numbers with a zero diagonal")

    @classmethod
    def build(cls, layer_ms: Mapping[str, float], link_ms: Callable[[str, str], float]) -> Latencies:
        """From per-GPU tau and a one-way link function (any input order: the result is sorted)."""
        gpus = tuple(sorted(layer_ms))
        link = np.zeros((len(gpus), len(gpus)))
        for (i, a), (j, b) in itertools.permutations(enumerate(gpus), 2):
            link[i, j] = link_ms(a, b)
        return cls(gpus, np.array([layer_ms[g] for g in gpus], dtype=float), link)


class _Step(NamedTuple):
    """The canonical edges at one boundary, grouped by destination (a host of the next segment)."""

    src: list[int]
    """Per edge: the source's position among the previous segment's hosts."""
    groups: list[slice]
    """Per destination: its edges — a stay edge first, then sources in id order."""
    starts: np.ndarray
    """The groups' first edges, for numpy's reduceat."""
    edges: slice
    """This step's part of the DAG-wide edge arrays."""
    src_array: np.ndarray


class LayerDag:
    """A placement compiled for the sweep: its segments and canonical edges (rebuilt when it changes)."""

    def __init__(self, ranges: Mapping[str, tuple[int, int]], num_layers: int, *,
                 vectorized: bool | None = None) -> None:
        """`vectorized` picks the engine (None: by size); both give bit-identical results."""
        if num_layers < 1:
            raise ValueError(f"num_layers must be at least 1, got {num_layers}")
        for gpu, (start, end) in ranges.items():
            if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < end <= num_layers):
                raise ValueError(f"GPU {gpu!r} hosts [{start}, {end}), not a non-empty range of "
                                 f"[0, {num_layers})")
        self.num_layers = num_layers
        self.gpus = tuple(sorted(ranges))
        self.ranges = {g: tuple(ranges[g]) for g in self.gpus}
        self.index = {g: i for i, g in enumerate(self.gpus)}
        self.boundaries = tuple(sorted({0, num_layers} | {x for r in ranges.values() for x in r}))
        self.segments = tuple(itertools.pairwise(self.boundaries))
        spans = [self.ranges[g] for g in self.gpus]
        self.hosts = tuple(tuple(i for i, (s, e) in enumerate(spans) if s <= a and b <= e)
                           for a, b in self.segments)
        """Per segment, its hosts' positions in `gpus`."""
        self.gap = next((seg for seg, h in zip(self.segments, self.hosts, strict=True) if not h), None)
        self._flat: list[int] = []
        self._steps = [] if self.gap else [self._step(k) for k in range(1, len(self.segments))]
        self.edge_count = len(self._flat)
        per_boundary = self.edge_count / max(1, len(self._steps))
        self.vectorized = per_boundary > VECTORIZE_EDGES_PER_BOUNDARY if vectorized is None else vectorized
        self._flat_array = np.array(self._flat, dtype=np.intp)
        self._seg_hosts = [g for h in self.hosts for g in h]
        self._seg_lengths = [b - a for (a, b), h in zip(self.segments, self.hosts, strict=True) for _ in h]
        self._seg_hosts_array = np.array(self._seg_hosts, dtype=np.intp)
        self._seg_lengths_array = np.array(self._seg_lengths, dtype=float)
        offsets = itertools.accumulate(map(len, self.hosts), initial=0)
        self._seg_slices = [slice(a, b) for a, b in itertools.pairwise(offsets)]

    def _step(self, k: int) -> _Step:
        t, n = self.boundaries[k], len(self.gpus)
        prev, position = self.hosts[k - 1], {g: i for i, g in enumerate(self.hosts[k - 1])}
        enders = [g for g in prev if self.ranges[self.gpus[g]][1] == t]
        first, src, groups = len(self._flat), [], []
        for q in self.hosts[k]:
            a = len(src)
            sources = [q, *enders] if q in position else list(prev)
            src.extend(position[p] for p in sources)
            self._flat.extend(p * n + q for p in sources)
            groups.append(slice(a, len(src)))
        return _Step(src, groups, np.array([g.start for g in groups], dtype=np.intp),
                     slice(first, len(self._flat)), np.array(src, dtype=np.intp))


def select_chain(dag: LayerDag, latencies: Latencies, exclude: Collection[str] = ()) -> Chain:
    """The minimum-latency chain over all L layers avoiding `exclude`; NoChainError when there is none."""
    if latencies.gpus != dag.gpus:
        raise ValueError("latencies must be a snapshot of exactly the placement's GPUs (dag.gpus)")
    if dag.gap is not None:
        raise NoChainError(f"no GPU hosts layers [{dag.gap[0]}, {dag.gap[1]})")
    tau = latencies.layer_ms
    if exclude:
        unknown = set(exclude) - dag.index.keys()
        if unknown:
            raise ValueError(f"cannot exclude GPUs outside the placement: {sorted(unknown)}")
        tau = tau.copy()
        tau[[dag.index[g] for g in exclude]] = math.inf
    sweep = _sweep_arrays if dag.vectorized else _sweep_lists
    cands, mins, last = sweep(dag, tau, latencies.link_ms)
    best = min(range(len(last)), key=last.__getitem__)
    if last[best] == math.inf:
        raise NoChainError(_stuck(dag, tau))
    return Chain(_backtrack(dag, cands, mins, best), float(last[best]))


def chain_latency(chain: Chain, latencies: Latencies) -> float:
    """A chain's latency under another snapshot (e.g. how a pinned chain fares now)."""
    index = {g: i for i, g in enumerate(latencies.gpus)}
    total, prev = 0.0, None
    for gpu, start, end in chain.hops:
        i = index[gpu]
        link = 0.0 if prev is None else latencies.link_ms[prev, i]
        total += float(link + latencies.layer_ms[i] * (end - start))
        prev = i
    return total


Sweep = tuple[list, list, list]
"""Per boundary the candidate costs of its edges and their per-destination minima; the final costs."""


def _sweep_lists(dag: LayerDag, tau: np.ndarray, link: np.ndarray) -> Sweep:
    tau_list, weights = tau.tolist(), link.take(dag._flat_array).tolist()
    compute = list(map(operator.mul, map(tau_list.__getitem__, dag._seg_hosts), dag._seg_lengths))
    cost = compute[dag._seg_slices[0]]
    cands, mins = [None], [None]
    for step, segment in zip(dag._steps, dag._seg_slices[1:], strict=True):
        cand = list(map(operator.add, map(cost.__getitem__, step.src), weights[step.edges]))
        low = list(map(min, map(cand.__getitem__, step.groups)))
        cost = list(map(operator.add, low, compute[segment]))
        cands.append(cand)
        mins.append(low)
    return cands, mins, cost


def _sweep_arrays(dag: LayerDag, tau: np.ndarray, link: np.ndarray) -> Sweep:
    weights = link.take(dag._flat_array)
    compute = tau.take(dag._seg_hosts_array) * dag._seg_lengths_array
    cost = compute[dag._seg_slices[0]]
    cands, mins = [None], [None]
    for step, segment in zip(dag._steps, dag._seg_slices[1:], strict=True):
        cand = cost.take(step.src_array) + weights[step.edges]
        low = np.minimum.reduceat(cand, step.starts)
        cost = low + compute[segment]
        cands.append(cand)
        mins.append(low)
    return cands, mins, cost


def _backtrack(dag: LayerDag, cands: list, mins: list, q: int) -> tuple[Hop, ...]:
    """Follows the first minimal edge into each destination back from the best last host."""
    hops, end = [], dag.num_layers
    for k in range(len(dag._steps), 0, -1):
        step, cand = dag._steps[k - 1], cands[k]
        group = step.groups[q]
        a = group.start
        e = a if cand[a] == mins[k][q] else min(range(a + 1, group.stop), key=cand.__getitem__)
        p = step.src[e]
        if dag.hosts[k - 1][p] != dag.hosts[k][q]:
            hops.append(Hop(dag.gpus[dag.hosts[k][q]], dag.boundaries[k], end))
            end = dag.boundaries[k]
        q = p
    hops.append(Hop(dag.gpus[dag.hosts[0][q]], 0, end))
    return tuple(reversed(hops))


def _stuck(dag: LayerDag, tau: np.ndarray) -> str:
    for (a, b), hosts in zip(dag.segments, dag.hosts, strict=True):
        if all(tau[g] == math.inf for g in hosts):
            names = ", ".join(dag.gpus[g] for g in hosts)
            return f"no usable GPU hosts layers [{a}, {b}): its hosts ({names}) are all excluded"
    return f"every chain over layers [0, {dag.num_layers}) crosses an unusable (infinite) link"


class LatencyTable:
    """The live performance map of one model node: tau per GPU and RTT per pair, each an EWMA
    (`ALPHA`) of timestamped measurements. A value older than `max_age_s` is stale and reads as the
    GPU's profiled tau (or the default); a sample arriving for a stale value starts it afresh. Time is
    always passed in (seconds, any monotonic origin)."""

    def __init__(self, *, default_layer_ms: float, default_rtt_ms: float, max_age_s: float = MAX_AGE_S,
                 alpha: float = ALPHA, profiled_layer_ms: Mapping[str, float] | None = None) -> None:
        if not 0 < alpha <= 1 or max_age_s <= 0:
            raise ValueError(f"need 0 < alpha <= 1 and max_age_s > 0, got {alpha}, {max_age_s}")
        if min(default_layer_ms, default_rtt_ms) < 0:
            raise ValueError("default latencies must be non-negative")
        self.default_layer_ms, self.default_rtt_ms = default_layer_ms, default_rtt_ms
        self.max_age_s, self.alpha = max_age_s, alpha
        self.profiled_layer_ms = dict(profiled_layer_ms or {})
        self._layer: dict[str, tuple[LatencyEWMA, float]] = {}
        self._rtt: dict[tuple[str, str], tuple[LatencyEWMA, float]] = {}

    def observe_layer(self, gpu: str, ms: float, now: float) -> float:
        """A measured per-layer latency of `gpu` (load included); returns the smoothed value."""
        return self._observe(self._layer, gpu, ms, now)

    def observe_rtt(self, a: str, b: str, ms: float, now: float) -> float:
        """A measured round trip between two GPUs (either direction); returns the smoothed RTT."""
        return self._observe(self._rtt, _pair(a, b), ms, now)

    def layer_ms(self, gpu: str, now: float) -> float:
        fallback = self.profiled_layer_ms.get(gpu, self.default_layer_ms)
        return self._read(self._layer.get(gpu), now, fallback)

    def rtt_ms(self, a: str, b: str, now: float) -> float:
        return self._read(self._rtt.get(_pair(a, b)), now, self.default_rtt_ms)

    def fresh_rtt(self, a: str, b: str, now: float) -> bool:
        """Whether the pair has a measured round trip that is not stale."""
        entry = self._rtt.get(_pair(a, b))
        return entry is not None and self._fresh(entry, now)

    def snapshot(self, gpus: Iterable[str], now: float) -> Latencies:
        """What the 1-2 s refresh loop takes: tau and one-way links (RTT / 2) for `gpus`, as of `now`."""
        order = tuple(sorted(set(gpus)))
        index = {g: i for i, g in enumerate(order)}
        link = np.full((len(order), len(order)), self.default_rtt_ms / 2)
        np.fill_diagonal(link, 0.0)
        for (a, b), entry in self._rtt.items():
            if a in index and b in index and self._fresh(entry, now):
                link[index[a], index[b]] = link[index[b], index[a]] = entry[0].value / 2
        tau = np.array([self.layer_ms(g, now) for g in order], dtype=float)
        return Latencies(order, tau, link)

    def _observe(self, table: dict, key: object, ms: float, now: float) -> float:
        entry = table.get(key)
        if entry is None or not self._fresh(entry, now):
            entry = (LatencyEWMA(self.alpha), now)
        ewma, at = entry
        value = ewma.observe(ms)
        table[key] = (ewma, max(at, now))
        return value

    def _fresh(self, entry: tuple[LatencyEWMA, float], now: float) -> bool:
        return now - entry[1] <= self.max_age_s

    def _read(self, entry: tuple[LatencyEWMA, float] | None, now: float, fallback: float) -> float:
        value = None if entry is None or not self._fresh(entry, now) else entry[0].value
        return fallback if value is None else value


def _pair(a: str, b: str) -> tuple[str, str]:
    if a == b:
        raise ValueError(f"an RTT needs two distinct GPUs, got {a!r} twice")
    return (a, b) if a < b else (b, a)


class ChainRouter:
    """Hands out chains per request: a request keeps its chain for its lifetime (its KV cache lives on
    those GPUs); new requests get the best chain under the latest snapshot, avoiding excluded GPUs."""

    def __init__(self, dag: LayerDag, table: LatencyTable) -> None:
        self.dag, self.table = dag, table
        self.excluded: set[str] = set()
        self._latencies: Latencies | None = None
        self._pinned: dict[str, Chain] = {}

    def refresh(self, now: float) -> None:
        """The caller's 1-2 s loop calls this to take a new snapshot of the table."""
        self._latencies = self.table.snapshot(self.dag.gpus, now)

    def route(self, request_id: str) -> Chain:
        """The request's pinned chain, or a newly selected and pinned one."""
        chain = self._pinned.get(request_id)
        return chain if chain is not None else self.reroute(request_id)

    def reroute(self, request_id: str) -> Chain:
        """A fresh chain for the request (e.g. after a stage died), replacing its pinned one."""
        if self._latencies is None:
            raise RuntimeError("no latency snapshot yet: call refresh(now) first")
        chain = select_chain(self.dag, self._latencies, self.excluded)
        self._pinned[request_id] = chain
        return chain

    def release(self, request_id: str) -> None:
        """The request finished: forget its chain (no-op for an unknown id)."""
        self._pinned.pop(request_id, None)

    def pinned(self, request_id: str) -> Chain | None:
        return self._pinned.get(request_id)

    def exclude(self, gpu: str) -> list[str]:
        """Stops selecting `gpu`; returns the requests pinned through it, in id order, to reroute."""
        if gpu not in self.dag.index:
            raise ValueError(f"GPU {gpu!r} is not in the placement")
        self.excluded.add(gpu)
        return sorted(r for r, chain in self._pinned.items() if gpu in chain.gpus)

    def readmit(self, gpu: str) -> None:
        self.excluded.discard(gpu)
