"""Parallax phase 2 chain selection (seed parallax.txt §3.3): the sweep against brute force, replicas,
exclusions, errors, determinism, the live latency table and pinned chains."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from planetserve.node.pipeline.chains import (
    ALPHA,
    Chain,
    ChainRouter,
    Hop,
    Latencies,
    LatencyTable,
    LayerDag,
    NoChainError,
    chain_latency,
    select_chain,
)

Ranges = dict[str, tuple[int, int]]


def brute_force(ranges: Ranges, layers: int, lat: Latencies, exclude: frozenset[str] = frozenset()) -> float:
    """The paper's DAG by enumeration: every assignment of a hosting GPU to every layer."""
    index = {g: i for i, g in enumerate(lat.gpus)}
    hosts = [[index[g] for g, (s, e) in ranges.items() if s <= layer < e and g not in exclude]
             for layer in range(layers)]
    best = math.inf
    for assignment in itertools.product(*hosts):
        cost = sum(lat.layer_ms[g] for g in assignment)
        cost += sum(lat.link_ms[a, b] for a, b in itertools.pairwise(assignment) if a != b)
        best = min(best, cost)
    return best


def assert_valid(chain: Chain, ranges: Ranges, layers: int, exclude: frozenset[str] = frozenset()) -> None:
    assert chain.hops[0].start == 0 and chain.hops[-1].end == layers
    for hop, after in itertools.pairwise(chain.hops):
        assert hop.end == after.start and hop.gpu != after.gpu
    for gpu, start, end in chain.hops:
        assert gpu not in exclude and ranges[gpu][0] <= start < end <= ranges[gpu][1]


def random_case(rng: random.Random, metric: bool = True) -> tuple[Ranges, int, Latencies]:
    """Up to 6 GPUs over up to 8 layers, small enough to enumerate: a pipeline of one to three GPUs
    (mostly; sometimes with a gap) plus GPUs on random ranges. Links are distances between points of
    two far-apart regions (a metric) unless `metric` is false."""
    while True:
        layers, n = rng.randint(1, 8), rng.randint(1, 6)
        cuts = [0, *sorted(rng.sample(range(1, layers), min(layers - 1, rng.randint(0, 2)))), layers]
        spans = list(itertools.pairwise(cuts))
        if rng.random() < 0.1:
            spans.pop(rng.randrange(len(spans)))
        while len(spans) < n:
            start = rng.randrange(layers)
            spans.append((start, rng.randint(start + 1, layers)))
        ranges: Ranges = {f"g{i}": span for i, span in enumerate(rng.sample(spans, len(spans)))}
        if math.prod(sum(s <= x < e for s, e in ranges.values()) or 1 for x in range(layers)) <= 3000:
            break
    points = {g: (rng.choice((0.0, 50.0)) + rng.uniform(0, 5), rng.uniform(0, 5)) for g in ranges}
    links = {(a, b): rng.uniform(0, 30) for a in ranges for b in ranges}

    def link(a: str, b: str) -> float:
        return math.dist(points[a], points[b]) if metric else links[a, b]

    return ranges, layers, Latencies.build({g: rng.uniform(0.1, 5) for g in ranges}, link)


@pytest.mark.parametrize("seed", range(100))
def test_sweep_matches_brute_force_on_random_placements(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(3):
        ranges, layers, lat = random_case(rng)
        exclude = frozenset(g for g in ranges if rng.random() < 0.2)
        optimum = brute_force(ranges, layers, lat, exclude)
        chains = []
        for vectorized in (False, True):
            dag = LayerDag(ranges, layers, vectorized=vectorized)
            if optimum == math.inf:
                with pytest.raises(NoChainError):
                    select_chain(dag, lat, exclude)
                continue
            chain = select_chain(dag, lat, exclude)
            assert_valid(chain, ranges, layers, exclude)
            assert chain.latency_ms == pytest.approx(optimum, rel=1e-12, abs=1e-12)
            assert chain_latency(chain, lat) == pytest.approx(chain.latency_ms, rel=1e-12)
            chains.append(chain)
        assert len(chains) in (0, 2) and (not chains or chains[0] == chains[1])  # bit-identical engines


def layer_by_layer(ranges: Ranges, layers: int, lat: Latencies) -> float:
    """The paper's sweep itself: dp over (layer, GPU), every switch tried at every layer."""
    index = {g: i for i, g in enumerate(lat.gpus)}
    hosts = [[index[g] for g, (s, e) in ranges.items() if s <= layer < e] for layer in range(layers)]
    dp = {g: lat.layer_ms[g] for g in hosts[0]}
    for layer in range(1, layers):
        dp = {h: lat.layer_ms[h] + min(c + lat.link_ms[g, h] for g, c in dp.items()) for h in hosts[layer]}
    return min(dp.values())


@pytest.mark.parametrize("seed", range(4))
def test_sweep_matches_the_layer_by_layer_dp_at_scale(seed: int) -> None:
    rng = random.Random(seed)
    ranges: Ranges = {}
    for p in range(8):
        cuts = sorted(rng.sample(range(1, 80), 3))
        ranges |= {f"p{p}-{i}": span for i, span in enumerate(itertools.pairwise([0, *cuts, 80]))}
    for i in range(8):
        start = rng.randrange(80)
        ranges[f"x{i}"] = (start, min(80, start + rng.randint(5, 40)))
    points = {g: (rng.choice((0.0, 100.0, 200.0)) + rng.uniform(0, 10), rng.uniform(0, 10)) for g in ranges}
    lat = Latencies.build({g: rng.uniform(0.3, 2) for g in ranges}, lambda a, b: math.dist(points[a], points[b]))
    arrays, lists = (select_chain(LayerDag(ranges, 80, vectorized=v), lat) for v in (True, False))
    assert LayerDag(ranges, 80).vectorized and arrays == lists
    assert_valid(arrays, ranges, 80)
    assert arrays.latency_ms == pytest.approx(layer_by_layer(ranges, 80, lat), rel=1e-12)


def test_without_the_triangle_inequality_the_chain_is_valid_but_may_miss_a_relay() -> None:
    rng = random.Random(7)
    for _ in range(150):
        ranges, layers, lat = random_case(rng, metric=False)
        optimum = brute_force(ranges, layers, lat)
        if optimum == math.inf:
            continue
        chain = select_chain(LayerDag(ranges, layers), lat)
        assert_valid(chain, ranges, layers)
        assert chain.latency_ms == pytest.approx(chain_latency(chain, lat), rel=1e-12)
        assert chain.latency_ms >= optimum - 1e-9
    # The documented miss: the link p -> h is slow, so the best chain runs one layer on the slow g only to
    # use the links p -> g -> h: p[0,1) g[1,2) h[2,4) = 0 + 1 + 3 + 1 + 2 = 7. The sweep, which switches
    # only where a range starts or ends, finds g[0,2) h[2,4) = 6 + 1 + 2.
    ranges = {"g": (0, 2), "h": (2, 4), "p": (0, 2)}
    slow = {("p", "h"), ("h", "p")}
    lat = Latencies.build({"g": 3.0, "h": 1.0, "p": 0.0}, lambda a, b: 100.0 if (a, b) in slow else 1.0)
    assert brute_force(ranges, 4, lat) == 7.0
    assert select_chain(LayerDag(ranges, 4), lat) == Chain((Hop("g", 0, 2), Hop("h", 2, 4)), 9.0)


def test_chain_enters_a_gpu_mid_range_leaves_early_and_comes_back() -> None:
    ranges = {"big": (0, 8), "fast": (2, 6), "tail": (6, 8)}
    lat = Latencies.build({"big": 2.0, "fast": 0.5, "tail": 3.0}, lambda a, b: 1.0)
    chain = select_chain(LayerDag(ranges, 8), lat)
    assert chain == Chain((Hop("big", 0, 2), Hop("fast", 2, 6), Hop("big", 6, 8)), 4 + 1 + 2 + 1 + 4)


def test_replicas_tie_break_on_gpu_id_and_staying_beats_switching() -> None:
    ranges = {"b1": (0, 4), "b2": (4, 8), "a1": (0, 4), "a2": (4, 8), "c": (0, 8)}
    lat = Latencies.build({g: 1.0 for g in ranges}, lambda a, b: 0.0 if a[0] == b[0] else 5.0)
    chain = select_chain(LayerDag(ranges, 8), lat)
    assert chain.hops == (Hop("a1", 0, 4), Hop("a2", 4, 8)) and chain.latency_ms == 8.0
    lat = Latencies.build({g: 1.0 for g in ranges}, lambda a, b: 0.0)
    assert select_chain(LayerDag(ranges, 8), lat).hops == (Hop("a1", 0, 4), Hop("a2", 4, 8))
    assert select_chain(LayerDag(ranges, 8), lat, exclude={"a1"}).hops == (Hop("b1", 0, 4), Hop("a2", 4, 8))
    # Equal chains c[0,8) and c[0,4) a2[4,8): the last GPU's id decides, as everywhere else.
    assert select_chain(LayerDag(ranges, 8), lat, exclude={"a1", "b1"}).hops == (Hop("c", 0, 4), Hop("a2", 4, 8))
    # Staying on b ties with arriving from a (the lower id) at layer 4: staying wins.
    lat = Latencies.build({"a": 1.0, "b": 1.0}, lambda a, b: 0.0)
    assert select_chain(LayerDag({"b": (0, 8), "a": (0, 4)}, 8), lat).hops == (Hop("b", 0, 8),)


def test_excluded_gpus_are_avoided() -> None:
    ranges = {"a1": (0, 4), "a2": (4, 8), "b1": (0, 4), "b2": (4, 8)}
    lat = Latencies.build({"a1": 1.0, "a2": 1.0, "b1": 2.0, "b2": 2.0}, lambda a, b: 1.0)
    dag = LayerDag(ranges, 8)
    assert select_chain(dag, lat).hops == (Hop("a1", 0, 4), Hop("a2", 4, 8))
    assert select_chain(dag, lat, exclude=["a2"]).hops == (Hop("a1", 0, 4), Hop("b2", 4, 8))


def test_no_covering_chain_is_a_clear_error() -> None:
    lat = Latencies.build({"a": 1.0, "b": 1.0}, lambda a, b: 1.0)
    with pytest.raises(NoChainError, match=r"no GPU hosts layers \[3, 5\)"):
        select_chain(LayerDag({"a": (0, 3), "b": (5, 8)}, 8), lat)
    dag = LayerDag({"a": (0, 4), "b": (4, 8)}, 8)
    with pytest.raises(NoChainError, match=r"layers \[4, 8\): its hosts \(b\) are all excluded"):
        select_chain(dag, lat, exclude={"b"})
    cut = Latencies(lat.gpus, lat.layer_ms, np.array([[0.0, math.inf], [math.inf, 0.0]]))
    with pytest.raises(NoChainError, match="unusable"):
        select_chain(dag, cut)
    with pytest.raises(ValueError, match="outside the placement"):
        select_chain(dag, lat, exclude={"zz"})
    with pytest.raises(ValueError, match="exactly the placement's GPUs"):
        select_chain(LayerDag({"a": (0, 8)}, 8), lat)


def test_invalid_inputs_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"'a' hosts \[3, 3\)"):
        LayerDag({"a": (3, 3)}, 8)
    with pytest.raises(ValueError, match=r"hosts \[0, 9\)"):
        LayerDag({"a": (0, 9)}, 8)
    with pytest.raises(ValueError, match="not a non-empty range"):
        LayerDag({"a": (0.0, 8)}, 8)
    with pytest.raises(ValueError, match="num_layers"):
        LayerDag({}, 0)
    with pytest.raises(ValueError, match="layer latencies"):
        Latencies(("a",), np.array([-1.0]), np.zeros((1, 1)))
    with pytest.raises(ValueError, match="zero diagonal"):
        Latencies(("a",), np.array([1.0]), np.ones((1, 1)))
    with pytest.raises(ValueError, match="sorted"):
        Latencies(("b", "a"), np.ones(2), np.zeros((2, 2)))


def test_equal_inputs_in_any_order_give_the_same_chain() -> None:
    rng = random.Random(3)
    names = [f"gpu-{i}" for i in range(12)]
    ranges = {g: (s, s + 20) for g, s in zip(names, [0, 0, 0, 20, 20, 20, 40, 40, 60, 60, 10, 50], strict=True)}
    for tau in ({g: 1.0 for g in names}, {g: rng.choice((1.0, 1.5)) for g in names}):
        results = set()
        for _ in range(8):
            order = rng.sample(names, len(names))
            lat = Latencies.build({g: tau[g] for g in order}, lambda a, b: 2.0 if a[-1] < b[-1] else 2.5)
            for vectorized in (False, True):
                results.add(select_chain(LayerDag({g: ranges[g] for g in order}, 80, vectorized=vectorized), lat))
        assert len(results) == 1


def test_table_smooths_with_ewma_and_stale_values_fall_back() -> None:
    table = LatencyTable(default_layer_ms=9.0, default_rtt_ms=40.0, max_age_s=5.0,
                         profiled_layer_ms={"a": 2.0})
    assert table.alpha == ALPHA == 0.3
    assert table.observe_layer("a", 10.0, now=0.0) == 10.0
    assert table.observe_layer("a", 20.0, now=1.0) == pytest.approx(0.7 * 10 + 0.3 * 20)
    assert table.layer_ms("a", now=6.0) == pytest.approx(13.0)  # 5 s after the last sample: still fresh
    assert table.layer_ms("a", now=6.5) == 2.0  # stale: the profiled value
    assert table.layer_ms("b", now=0.0) == 9.0  # never measured, not profiled: the default
    assert table.observe_layer("a", 4.0, now=7.0) == 4.0  # a stale value starts afresh
    assert table.observe_rtt("a", "b", 10.0, now=7.0) == 10.0
    assert table.observe_rtt("b", "a", 30.0, now=8.0) == pytest.approx(16.0)
    assert table.rtt_ms("a", "b", now=13.0) == pytest.approx(16.0)
    assert table.rtt_ms("a", "b", now=13.5) == 40.0
    with pytest.raises(ValueError, match="non-negative"):
        table.observe_layer("a", -1.0, now=9.0)
    with pytest.raises(ValueError, match="two distinct GPUs"):
        table.observe_rtt("a", "a", 1.0, now=9.0)


def test_snapshot_halves_round_trips_and_fills_defaults() -> None:
    table = LatencyTable(default_layer_ms=1.0, default_rtt_ms=40.0)
    table.observe_rtt("c", "a", 10.0, now=0.0)
    table.observe_rtt("a", "zz", 2.0, now=0.0)  # not in the snapshot's GPUs
    table.observe_layer("b", 3.0, now=0.0)
    lat = table.snapshot(["c", "b", "a"], now=1.0)
    assert lat.gpus == ("a", "b", "c")
    assert lat.layer_ms.tolist() == [1.0, 3.0, 1.0]
    assert lat.link_ms.tolist() == [[0.0, 20.0, 5.0], [20.0, 0.0, 20.0], [5.0, 20.0, 0.0]]
    assert table.snapshot(["a", "c"], now=100.0).link_ms.tolist() == [[0.0, 20.0], [20.0, 0.0]]


def two_pipelines() -> tuple[LayerDag, LatencyTable]:
    """Pipelines a and b of two stages each; links inside a pipeline measured, across them default."""
    dag = LayerDag({"a1": (0, 4), "a2": (4, 8), "b1": (0, 4), "b2": (4, 8)}, 8)
    table = LatencyTable(default_layer_ms=1.0, default_rtt_ms=100.0,
                         profiled_layer_ms={"a1": 1.0, "a2": 1.0, "b1": 1.5, "b2": 1.5})
    table.observe_rtt("a1", "a2", 4.0, now=0.0)
    table.observe_rtt("b1", "b2", 4.0, now=0.0)
    return dag, table


def test_pinned_chains_stay_while_new_requests_follow_the_latencies() -> None:
    dag, table = two_pipelines()
    router = ChainRouter(dag, table)
    with pytest.raises(RuntimeError, match="refresh"):
        router.route("r1")
    router.refresh(now=0.0)
    first = router.route("r1")
    assert first.hops == (Hop("a1", 0, 4), Hop("a2", 4, 8)) and first.latency_ms == 10.0
    table.observe_layer("a1", 5.0, now=1.0)  # a1 got busy
    table.observe_rtt("b1", "b2", 4.0, now=1.0)
    router.refresh(now=1.0)
    assert router.route("r1") is first and router.pinned("r1") is first
    second = router.route("r2")
    assert second.hops == (Hop("b1", 0, 4), Hop("b2", 4, 8)) and second.latency_ms == 14.0
    router.release("r1")
    router.release("r1")
    assert router.pinned("r1") is None and router.route("r1") == second
    router.refresh(now=7.0)  # every measurement is stale now: profiled tau, default links
    assert router.route("r3").hops == (Hop("a1", 0, 4), Hop("a2", 4, 8))


def test_excluding_a_dead_stage_reroutes_around_it() -> None:
    dag, table = two_pipelines()
    router = ChainRouter(dag, table)
    router.refresh(now=0.0)
    router.route("r1")
    router.route("r2")
    router.exclude("b1")
    assert router.exclude("a2") == ["r1", "r2"]
    rerouted = router.reroute("r1")
    assert rerouted.hops == (Hop("a1", 0, 4), Hop("b2", 4, 8)) and router.route("r1") is rerouted
    router.exclude("b2")
    with pytest.raises(NoChainError, match=r"layers \[4, 8\)"):
        router.reroute("r2")
    assert router.pinned("r2").gpus == {"a1", "a2"}  # a failed reroute keeps the old pin
    router.readmit("a2")
    assert router.reroute("r2").hops == (Hop("a1", 0, 4), Hop("a2", 4, 8))
    with pytest.raises(ValueError, match="not in the placement"):
        router.exclude("zz")
