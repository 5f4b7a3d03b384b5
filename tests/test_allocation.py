"""Parallax phase 1 (registry/allocation.py): s*(k), the choice of k, water-filling, membership, errors."""

from __future__ import annotations

import dataclasses
import random
from fractions import Fraction

import pytest

from planetserve.registry.allocation import (
    Allocation,
    AllocationError,
    AllocationParams,
    Gpu,
    Pipeline,
    Stage,
    allocate,
    join,
    layer_loads,
    leave,
    min_stages,
    needs_reallocation,
    water_fill,
    water_level,
)

# (layer capacity, GFLOP/s, weight): an L = 80 model on a mix of data-centre and consumer GPUs.
MIX = ((40, 990, 10), (40, 312, 5), (24, 362, 8), (24, 155, 7), (20, 312, 10), (16, 210, 20), (12, 165, 15),
       (12, 71, 10), (8, 65, 12), (5, 60, 8))


def cluster(rng: random.Random, per_region: int, regions: int) -> list[Gpu]:
    kinds = rng.choices(MIX, [w for *_, w in MIX], k=per_region * regions)
    return [Gpu(f"g{i:03d}", f"r{i % regions}", c, f) for i, (c, f, _) in enumerate(kinds)]


def brute_min_stages(caps: list[int], num_layers: int) -> tuple[int, ...]:
    """Every assignment of each GPU to no pipeline or to a pipeline (canonically labelled)."""
    best: dict[int, int] = {}

    def walk(i: int, sums: list[int], used: int) -> None:
        if i == len(caps):
            if sums and min(sums) >= num_layers:
                best[len(sums)] = min(best.get(len(sums), used), used)
            return
        walk(i + 1, sums, used)
        for j in range(len(sums)):
            sums[j] += caps[i]
            walk(i + 1, sums, used + 1)
            sums[j] -= caps[i]
        walk(i + 1, [*sums, caps[i]], used + 1)

    walk(0, [], 0)
    return tuple(best[k] for k in range(1, len(best) + 1))


def z_power(k: int, s: int, p: AllocationParams) -> Fraction:
    """Z(k)^q for α = p/q, exactly: the same order as Z."""
    alpha = Fraction(p.alpha)
    return Fraction(k) ** alpha.numerator / (p.t_comp_us + Fraction(s, k) * p.rtt_us) ** alpha.denominator


def direct_k(stages: tuple[int, ...], p: AllocationParams) -> int:
    """argmax_k Z(k) over s*(k), ties to the smaller k."""
    return max(range(1, len(stages) + 1), key=lambda k: (z_power(k, stages[k - 1], p), -k))


def by_region(gpus: list[Gpu]) -> dict[str, list[Gpu]]:
    out: dict[str, list[Gpu]] = {}
    for g in gpus:
        out.setdefault(g.region, []).append(g)
    return out


def check_pipelines(a: Allocation, gpus: list[Gpu]) -> None:
    known = {g.id: g for g in gpus}
    seen: set[str] = set()
    for p in a.pipelines:
        assert p.stages[0].start == 0 and p.stages[-1].end == a.num_layers
        for st, nxt in zip(p.stages, p.stages[1:], strict=False):
            assert st.end == nxt.start
        for st in p.stages:
            g = known[st.gpu]
            assert g.region == p.region
            assert 1 <= st.end - st.start <= g.layers
            assert st.gpu not in seen
            seen.add(st.gpu)


def no_floats(value: object) -> bool:
    if isinstance(value, float):
        return False
    if dataclasses.is_dataclass(value):
        return all(no_floats(getattr(value, f.name)) for f in dataclasses.fields(value))
    if isinstance(value, tuple | list):
        return all(no_floats(v) for v in value)
    return True


# -- s*(k) -----------------------------------------------------------------------------------------


def test_min_stages_matches_brute_force() -> None:
    rng = random.Random(7)
    for _ in range(200):
        caps = [rng.randint(1, 15) for _ in range(rng.randint(1, 8))]
        num_layers = rng.randint(1, 24)
        if sum(caps) < num_layers:
            assert min_stages(caps, num_layers) == ()
        else:
            assert min_stages(caps, num_layers) == brute_min_stages(caps, num_layers), (caps, num_layers)


def test_min_stages_beyond_the_capacity_bound() -> None:
    # Top-3 capacity (21) reaches 2 x 10, but 7 + 7 and a lone 7 are not two pipelines: 7+3 twice is.
    assert min_stages([7, 7, 7, 3, 3], 10) == (2, 4)
    assert min_stages([80, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8], 80) == (1, 11)


def test_min_stages_on_a_realistic_region() -> None:
    gpus = cluster(random.Random(3), 64, 1)
    stages = min_stages([g.layers for g in gpus], 80)
    assert len(stages) <= sum(g.layers for g in gpus) // 80
    for k in range(1, len(stages)):
        assert stages[k] >= stages[k - 1] + stages[0]


# -- choosing k ------------------------------------------------------------------------------------


def test_allocate_picks_argmax_z_of_min_stages() -> None:
    rng = random.Random(11)
    for alpha in (Fraction(1), Fraction(1, 2), Fraction(3, 2), Fraction(1, 10)):
        p = AllocationParams(80, 40_000, 10_000, alpha)
        gpus = cluster(rng, 24, 3)
        a = allocate(gpus, p)
        check_pipelines(a, gpus)
        for region, members in by_region(gpus).items():
            stages = min_stages([g.layers for g in members], 80)
            mine = [q for q in a.pipelines if q.region == region]
            assert len(mine) == direct_k(stages, p)
            assert sum(len(q.stages) for q in mine) == stages[len(mine) - 1]


def test_z_choice_on_clear_examples() -> None:
    one_big = [Gpu("big", "eu", 80, 1000)] + [Gpu(f"s{i}", "eu", 8, 100) for i in range(10)]
    # s*(1) = 1, s*(2) = 11: at alpha 1 one replica wins (Z 1/2000 vs 2/6500), at alpha 2 two do.
    assert len(allocate(one_big, AllocationParams(80, 1000, 1000, 1)).pipelines) == 1
    assert len(allocate(one_big, AllocationParams(80, 1000, 1000, 2)).pipelines) == 2
    z1, z2 = 1 / (1000 + 1000), 2 / (1000 + 5.5 * 1000)
    assert z1 > z2 and z1 < 2 * z2
    # T = 7, r = 2: Z(1) = 1/9 = 2/18 = Z(2): the tie goes to fewer replicas.
    assert len(allocate(one_big, AllocationParams(80, 7, 2, 1)).pipelines) == 1
    assert len(allocate(one_big, AllocationParams(80, 7, 3, 1)).pipelines) == 1
    assert len(allocate(one_big, AllocationParams(80, 7, 1, 1)).pipelines) == 2
    # Without hop latency Z = k^alpha / T grows with k: as many replicas as fit.
    halves = [Gpu(f"h{i}", "us", 40, 300) for i in range(8)]
    assert len(allocate(halves, AllocationParams(80, 1000, 0, Fraction(1, 3))).pipelines) == 4
    assert len(allocate(halves, AllocationParams(80, 0, 1000, 1)).pipelines) == 4


def test_search_budget_falls_back_to_known_splits() -> None:
    # 6+6 is one pipeline; two need 6+4 twice, which only the search finds (4+4 after 6+6 is short).
    gpus = [Gpu("a", "eu", 6, 1), Gpu("b", "eu", 6, 1), Gpu("c", "eu", 4, 1), Gpu("d", "eu", 4, 1)]
    assert min_stages([6, 6, 4, 4], 10) == (2, 4)
    exact = allocate(gpus, AllocationParams(10, 1000, 1))
    assert [[st.gpu for st in p.stages] for p in exact.pipelines] == [["a", "c"], ["b", "d"]]
    spent = allocate(gpus, AllocationParams(10, 1000, 1, search_budget=0))
    assert [[st.gpu for st in p.stages] for p in spent.pipelines] == [["a", "b"]]
    check_pipelines(spent, gpus)


def test_determinism_and_no_floats() -> None:
    gpus = cluster(random.Random(5), 40, 3)
    p = AllocationParams(80, 50_000, 10_000, Fraction(3, 4))
    a = allocate(gpus, p)
    for seed in range(5):
        shuffled = gpus[:]
        random.Random(seed).shuffle(shuffled)
        assert allocate(shuffled, p) == a
    assert no_floats(a)
    assert no_floats(join(a, Gpu("new", "r0", 30, 500)))


def test_regions_are_planned_apart() -> None:
    gpus = [Gpu(f"a{i}", "asia", 40, 300) for i in range(4)] + [Gpu(f"e{i}", "eu", 40, 300) for i in range(3)]
    gpus.append(Gpu("lone", "us", 60, 900))
    a = allocate(gpus, AllocationParams(80, 1000, 100))
    assert [p.region for p in a.pipelines] == ["asia", "asia", "eu"]
    check_pipelines(a, gpus)
    assert a.idle == ("e2", "lone")


# -- water-filling ---------------------------------------------------------------------------------


def test_water_fill_examples() -> None:
    assert water_fill([Gpu("a", "r", 60, 300), Gpu("b", "r", 60, 100)], 80) == (60, 20)
    assert water_level([Gpu("a", "r", 40, 300), Gpu("b", "r", 60, 100)], 80) == Fraction(2, 5)
    assert water_fill([Gpu("a", "r", 40, 300), Gpu("b", "r", 60, 100)], 80) == (40, 40)
    # Every member keeps one layer, however slow.
    assert water_fill([Gpu("a", "r", 79, 1000), Gpu("b", "r", 10, 1)], 80) == (79, 1)
    # 10/3 each: the spare layer goes to the smallest id, wherever it sits.
    assert water_fill([Gpu(i, "r", 9, 7) for i in "cab"], 10) == (3, 4, 3)
    assert water_fill([Gpu("x", "r", 80, 5)], 80) == (80,)


def test_water_fill_properties() -> None:
    rng = random.Random(13)
    for _ in range(500):
        n = rng.randint(1, 8)
        num_layers = rng.randint(n, 80)
        members = [Gpu(f"g{i}", "r", rng.randint(1, 40), rng.randint(1, 1000)) for i in range(n)]
        if sum(g.layers for g in members) < num_layers:
            continue
        layers = water_fill(members, num_layers)
        lam = water_level(members, num_layers)
        ideal = [min(max(lam * g.flops, 1), g.layers) for g in members]
        assert sum(ideal) == num_layers
        assert sum(layers) == num_layers
        for g, x, y in zip(members, layers, ideal, strict=True):
            assert isinstance(x, int) and 1 <= x <= g.layers
            assert abs(x - y) < 1


# -- membership ------------------------------------------------------------------------------------


def two_stage() -> Allocation:
    """One pipeline: a (60 layers, 990 GFLOP/s) is capped at 60, b (40, 100) takes the other 20."""
    gpus = [Gpu("a", "eu", 60, 990), Gpu("b", "eu", 40, 100)]
    a = allocate(gpus, AllocationParams(80, 1000, 100))
    assert a.pipelines == (Pipeline("eu", (Stage("a", 0, 60), Stage("b", 60, 80))),)
    return a


def test_join_takes_the_bottleneck_layers() -> None:
    a = two_stage()
    # Per layer a gives 990/60 and b 100/20 GFLOP/s: layer 60 is the first of the least loaded.
    assert join(a, Gpu("c", "eu", 10, 100)).loose == (Stage("c", 60, 70),)
    # 30 layers from layer 60 would pass L: the slice moves left and still covers the bottleneck.
    assert join(a, Gpu("c", "eu", 30, 100)).loose == (Stage("c", 50, 80),)
    assert join(a, Gpu("c", "eu", 200, 100)).loose == (Stage("c", 0, 80),)
    # Another region has no layers yet: every load is 0 and the lowest layer is the bottleneck.
    joined = join(a, Gpu("c", "us", 30, 100))
    assert joined.loose == (Stage("c", 0, 30),)
    assert [g.id for g in joined.gpus] == ["a", "b", "c"]
    with pytest.raises(AllocationError, match="already hosts"):
        join(joined, Gpu("c", "us", 30, 100))


def test_join_places_an_idle_gpu() -> None:
    gpus = [Gpu("a", "eu", 80, 100), Gpu("b", "eu", 10, 100)]
    a = allocate(gpus, AllocationParams(80, 1000, 100))
    assert a.idle == ("b",)
    joined = join(a, gpus[1])
    assert joined.idle == () and joined.loose == (Stage("b", 0, 10),)


def test_leave_releases_layers_and_breaks_the_pipeline() -> None:
    a = two_stage()
    left = leave(a, "b")
    assert left.pipelines == () and left.loose == (Stage("a", 0, 60),)
    assert [g.id for g in left.gpus] == ["a"]
    assert needs_reallocation(left)
    joined = join(a, Gpu("c", "eu", 30, 100))
    assert leave(joined, "c").loose == () and leave(joined, "c").pipelines == a.pipelines
    with pytest.raises(AllocationError, match="unknown GPU"):
        leave(a, "zz")


def test_layer_loads_and_exact_cv_threshold() -> None:
    gpus = [Gpu("a", "eu", 2, 1, kv_memory=6), Gpu("b", "eu", 2, 1, kv_memory=2)]
    a = allocate(gpus, AllocationParams(4, 10, 1))
    assert [(s.gpu, s.start, s.end) for s in a.stages] == [("a", 0, 2), ("b", 2, 4)]
    # compute: each layer gets 1/2 of 1 GFLOP/s of 2; memory: 3 (or 1) MiB of 8 per layer.
    assert layer_loads(a) == (Fraction(5, 16),) * 2 + (Fraction(3, 16),) * 2
    assert layer_loads(a, memory_weight=Fraction(0)) == (Fraction(1, 4),) * 4
    assert not needs_reallocation(a, Fraction(0), memory_weight=Fraction(0))
    # c joins on layers 0-1; compute loads become 1/3, 1/3, 1/6, 1/6: mean 1/4, CV exactly 1/3.
    joined = join(a, Gpu("c", "eu", 2, 1), memory_weight=Fraction(0))
    assert joined.loose == (Stage("c", 0, 2),)
    assert layer_loads(joined, "eu", Fraction(0)) == (Fraction(1, 3),) * 2 + (Fraction(1, 6),) * 2
    assert not needs_reallocation(joined, Fraction(1, 3), memory_weight=Fraction(0))
    assert needs_reallocation(joined, Fraction(333, 1000), memory_weight=Fraction(0))
    assert layer_loads(joined, "us") == (0, 0, 0, 0)
    assert needs_reallocation(joined, region="us")


# -- errors ----------------------------------------------------------------------------------------


def test_errors() -> None:
    p = AllocationParams(80, 1000, 100)
    with pytest.raises(AllocationError, match="no GPUs"):
        allocate([], p)
    with pytest.raises(AllocationError, match="no GPUs"):
        min_stages([], 80)
    with pytest.raises(AllocationError, match="number of layers"):
        AllocationParams(0, 1000, 100)
    with pytest.raises(AllocationError, match="number of layers"):
        min_stages([10], 0)
    with pytest.raises(AllocationError, match="no region holds 80 layers"):
        allocate([Gpu("a", "eu", 40, 1), Gpu("b", "us", 40, 1), Gpu("c", "us", 39, 1)], p)
    for bad in ({"layers": 0}, {"layers": -3}, {"flops": 0}, {"kv_memory": -1}, {"layers": 2.0}):
        with pytest.raises(AllocationError):
            Gpu(**{"id": "a", "region": "eu", "layers": 10, "flops": 10, **bad})
    with pytest.raises(AllocationError, match="layer capacity"):
        min_stages([10, 0], 5)
    with pytest.raises(AllocationError, match="duplicate GPU id 'a'"):
        allocate([Gpu("a", "eu", 80, 1), Gpu("a", "us", 80, 1)], p)
    with pytest.raises(AllocationError, match="not a GPU"):
        allocate([("a", "eu", 80, 1)], p)  # type: ignore[list-item]
    with pytest.raises(AllocationError, match="alpha"):
        AllocationParams(80, 1000, 100, 0)
    with pytest.raises(AllocationError, match="alpha"):
        AllocationParams(80, 1000, 100, 0.5)  # type: ignore[arg-type]
    with pytest.raises(AllocationError, match="T_comp"):
        AllocationParams(80, 1.5, 100)  # type: ignore[arg-type]
    with pytest.raises(AllocationError, match="search budget"):
        AllocationParams(80, 1000, 100, search_budget=-1)
    with pytest.raises(AllocationError, match="both be zero"):
        AllocationParams(80, 0, Fraction(0))
    with pytest.raises(AllocationError, match="cannot each hold"):
        water_fill([Gpu("a", "eu", 10, 1)], 11)
    with pytest.raises(AllocationError, match="cannot each hold"):
        water_fill([Gpu(str(i), "eu", 10, 1) for i in range(3)], 2)
    a = two_stage()
    with pytest.raises(AllocationError, match="threshold"):
        needs_reallocation(a, 0.25)  # type: ignore[arg-type]
    with pytest.raises(AllocationError, match="memory weight"):
        layer_loads(a, memory_weight=Fraction(3, 2))
