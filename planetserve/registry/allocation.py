"""Parallax phase 1 (model allocation, seed parallax.txt 3.2 and 3.4) as a pure, deterministic rule.

The ledger runs it, so every validator must get the same bytes: Python ints and Fractions only, GPUs
taken in an explicit order (layer capacity, then compute, then id, all descending but the id), every
tie broken by a stated rule. No I/O, no clock.

**Plan.** Per region (pipelines never span regions): pick the replication count k that maximises
Z(k) = k^α / (T_comp + (s*(k)/k)·r_RTT), where s*(k) is the minimum total number of GPUs (stages) in k
disjoint pipelines that each hold L layers; then balance every pipeline by water-filling.

**s*(k), exactly, without the paper's residual-multiset explosion.** The paper's dp_1(i, r, f) walks
the GPUs in non-increasing capacity with skip / extend / start transitions. We compute the same s*(k)
from four facts:
1. Exchange: swapping a used GPU for a larger unused one never breaks a pipeline, so some optimum
   uses exactly the s largest capacities; s*(k) is the least s whose top-s capacities split into k
   pipelines (groups summing to >= L).
2. At s = s*(k) every such split uses all s GPUs and every group is minimal (dropping its smallest
   GPU leaves < L layers): otherwise fewer GPUs would do. A split of the top-s GPUs that uses all of
   them into minimal groups therefore exists at s = s*(k) and at no smaller s.
3. Bounds bracket s*(k): below by the least s with top-s capacity >= kL and by s*(k-1) + s*(1) (drop
   one pipeline of a k-split); above by extending a known (k-1)-split with the next GPUs in order.
4. Inside the bracket, lb is tested by the paper's DP restricted by 1-2: the state is the multiset
   of GPUs left, as a count vector over the distinct capacities (the canonical sorted residual), and
   the number of pipelines still to build; the only transition builds the pipeline of the largest
   GPU left with a minimal completion that is undominated (no GPU in it can be swapped for a smaller
   one left over without the pipeline dropping below L). A failed state is memoised for the region,
   across every k and s. Success proves s*(k) = lb; failure raises lb by one.
Only the k that can still beat the best Z found are tightened (branch and bound on Z with exact
comparisons), so the chosen k is exact and its s*(k) is exact. `min_stages` tightens every k.
Bin covering is NP-hard, so a region's search examines at most `search_budget` candidate pipelines, a
count that is the same on every validator; past it the region keeps the best splits it knows (still a
valid plan, possibly with more stages or another k). Realistic GPU mixes stay far below it; capacities
that are nearly all distinct can reach it.

**Water-filling.** x_i = clamp(λ·F_i, 1, c_i) with Σx_i = L: every GPU the plan put in a pipeline keeps
at least one layer (the plan counted it as a stage, and a GPU with no layers is no stage). The paper's
binary search on λ, made exact: Σx_i is piecewise linear in λ with breakpoints 1/F_i and c_i/F_i,
integers once scaled by lcm(F); walking them in sorted order (the sort costs O(n log n) either way, and
the walk keeps the segment's linear form) finds the segment where the sum reaches L, solved there as a
rational. Largest-remainder (Hamilton) rounding follows (ties: smaller GPU id), then contiguous layer
intervals in pipeline order.

**Membership** (3.4, footnote 2). Layer load = w·M(ℓ)/M + (1-w)·F(ℓ)/F, where M(ℓ) and F(ℓ) sum the KV
memory and FLOP/s that each host spends on ℓ (its total divided by the layers it hosts: a GPU serving
40 layers gives each a fortieth), M and F are the totals of the GPUs in scope and w is the memory
weight (1/2 in the paper); a term whose total is zero counts 0. The bottleneck is the layer of least
load (ties: the lowest index); a joining GPU takes min(c, L) contiguous layers starting there, moved
left if they would pass L. A leaving GPU's layers are released and the rest of its pipeline becomes
loose stages. Re-allocation is due when a layer has no host or the layers' load coefficient of
variation (population) exceeds a threshold.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from math import lcm

HALF = Fraction(1, 2)
SEARCH_BUDGET = 20_000
"""Candidate pipelines the exact search may examine per region (realistic mixes: median 30, max ~5,500)."""
REBALANCE_THRESHOLD = Fraction(1, 4)
"""Coefficient of variation of layer load above which global re-allocation is due (Parallax's 0.25)."""


class AllocationError(ValueError):
    """Inputs no allocation can satisfy, or a membership change that does not fit the allocation."""


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise AllocationError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _exact(name: str, value: object) -> Fraction:
    """A non-negative int or Fraction as a Fraction; floats are refused (they differ across platforms)."""
    if isinstance(value, bool) or not isinstance(value, int | Fraction) or value < 0:
        raise AllocationError(f"{name} must be a non-negative int or Fraction, got {value!r}")
    return Fraction(value)


@dataclass(frozen=True, slots=True)
class Gpu:
    """One GPU: layer capacity c_i (layers that fit its VRAM), compute F_i in GFLOP/s, KV memory in MiB."""

    id: str
    region: str
    layers: int
    flops: int
    kv_memory: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise AllocationError(f"GPU id must be a non-empty string, got {self.id!r}")
        if not isinstance(self.region, str):
            raise AllocationError(f"GPU {self.id}: region must be a string, got {self.region!r}")
        _check_int(f"GPU {self.id} layer capacity", self.layers, 1)
        _check_int(f"GPU {self.id} compute capacity", self.flops, 1)
        _check_int(f"GPU {self.id} KV memory", self.kv_memory, 0)


@dataclass(frozen=True)
class AllocationParams:
    """L; Z's constants: α > 0, T_comp and r_RTT in microseconds (ints or Fractions, not both 0); the
    search budget per region (candidate pipelines examined, see `SEARCH_BUDGET`)."""

    num_layers: int
    t_comp_us: int | Fraction
    rtt_us: int | Fraction
    alpha: int | Fraction = 1
    search_budget: int = SEARCH_BUDGET

    def __post_init__(self) -> None:
        _check_int("number of layers", self.num_layers, 1)
        _check_int("search budget", self.search_budget, 0)
        if _exact("alpha", self.alpha) == 0:
            raise AllocationError("alpha must be positive")
        if _exact("T_comp", self.t_comp_us) + _exact("r_RTT", self.rtt_us) == 0:
            raise AllocationError("T_comp and r_RTT cannot both be zero: Z would divide by zero")


@dataclass(frozen=True, slots=True)
class Stage:
    """GPU `gpu` serves layers [start, end)."""

    gpu: str
    start: int
    end: int


@dataclass(frozen=True)
class Pipeline:
    """One replica: stages in order, covering [0, L) contiguously, all in `region`."""

    region: str
    stages: tuple[Stage, ...]


@dataclass(frozen=True)
class Allocation:
    """Full pipelines, loose stages (joined GPUs, survivors of broken pipelines) and every known GPU.

    `gpus` is sorted by id; `pipelines` by region, then in plan order; `loose` by GPU id.
    """

    num_layers: int
    gpus: tuple[Gpu, ...]
    pipelines: tuple[Pipeline, ...]
    loose: tuple[Stage, ...] = ()

    @property
    def stages(self) -> tuple[Stage, ...]:
        return tuple(st for p in self.pipelines for st in p.stages) + self.loose

    @property
    def idle(self) -> tuple[str, ...]:
        """Ids of known GPUs that host no layer (left over by the plan; `join` can place them)."""
        busy = {st.gpu for st in self.stages}
        return tuple(g.id for g in self.gpus if g.id not in busy)


# -- s*(k) -----------------------------------------------------------------------------------------


class _OutOfBudget(Exception):
    """The search examined more candidate pipelines than its budget allows."""


class _Packer:
    """Splits a multiset of capacities (counts per type) into minimal pipelines using every GPU.

    Depth first over states (GPUs left, pipelines left) on an explicit stack, remembering the states
    that failed. `budget` caps the candidate pipelines examined over the packer's life (None: no cap).
    """

    def __init__(self, types: tuple[int, ...], num_layers: int, budget: int | None) -> None:
        self.types = types
        self.num_layers = num_layers
        self.budget = budget
        self.examined = 0
        self.failed: set[tuple[tuple[int, ...], int]] = set()

    def split(self, counts: tuple[int, ...], pipelines: int, waste: int) -> list[tuple[int, ...]] | None:
        """Groups (counts per type) for `pipelines` pipelines, or None; waste = Σcapacity - pipelines·L."""
        if pipelines == 1:
            return [counts] if self._minimal(counts, waste) else None
        groups: list[tuple[int, ...]] = []
        stack = [(counts, pipelines, self._pipelines(counts, waste))]
        while stack:
            state, left, options = stack[-1]
            for group, rest, spare in options:
                if left == 2:
                    if self._minimal(rest, spare):
                        return [*groups, group, rest]
                elif (rest, left - 1) not in self.failed:
                    groups.append(group)
                    stack.append((rest, left - 1, self._pipelines(rest, spare)))
                    break
            else:
                self.failed.add((state, left))
                stack.pop()
                if groups:
                    groups.pop()
        return None

    def _minimal(self, counts: tuple[int, ...], waste: int) -> bool:
        """All of `counts` as one pipeline: without its smallest GPU it must hold fewer than L layers."""
        return waste < self.types[max(i for i, n in enumerate(counts) if n)]

    def _pipelines(
        self, counts: tuple[int, ...], waste: int
    ) -> Iterator[tuple[tuple[int, ...], tuple[int, ...], int]]:
        """Undominated minimal pipelines holding the largest GPU left: (group, GPUs left, waste left)."""
        first = next(i for i, n in enumerate(counts) if n)
        rest = list(counts)
        rest[first] -= 1
        picks = [0] * len(self.types)
        if self.types[first] >= self.num_layers:  # alone it holds L: anything more would be spare
            self._examine()
            picks[first] = 1
            if self.types[first] - self.num_layers <= waste:
                yield tuple(picks), tuple(rest), waste - self.types[first] + self.num_layers
            return
        suffix = [0] * (len(self.types) + 1)
        for i in range(len(self.types) - 1, first - 1, -1):
            suffix[i] = suffix[i + 1] + rest[i] * self.types[i]
        for over in self._fill(rest, suffix, picks, first, self.types[first], waste):
            group = picks[:]
            group[first] += 1
            yield tuple(group), tuple([n - p for n, p in zip(rest, picks, strict=True)]), waste - over

    def _fill(
        self, rest: list[int], suffix: list[int], picks: list[int], start: int, held: int, waste: int
    ) -> Iterator[int]:
        """Set picks[start:] (most and largest first) until the pipeline holds L; yield the spare layers.

        Each level adds one more capacity type, so the depth is the number of types in one pipeline.
        """
        for i in range(start, len(self.types)):
            if held + suffix[i] < self.num_layers:
                return
            t = self.types[i]
            need = self.num_layers - held
            reach = -(-need // t)  # this many type-i GPUs bring the pipeline to L
            if reach <= rest[i]:
                self._examine()
                picks[i] = reach
                if reach * t - need <= waste and self._undominated(rest, picks, reach * t - need, i):
                    yield reach * t - need
                picks[i] = 0
            for m in range(min(rest[i], reach - 1), 0, -1):
                if held + m * t + suffix[i + 1] < self.num_layers:
                    break
                picks[i] = m
                yield from self._fill(rest, suffix, picks, i + 1, held + m * t, waste)
            picks[i] = 0

    def _examine(self) -> None:
        self.examined += 1
        if self.budget is not None and self.examined > self.budget:
            raise _OutOfBudget

    def _undominated(self, rest: list[int], picks: list[int], over: int, last: int) -> bool:
        """No picked GPU can be dropped, or swapped for the largest smaller one left over, keeping >= L."""
        if over >= self.types[last]:
            return False
        smaller = 0
        for i in range(len(self.types) - 1, -1, -1):
            if picks[i] and over >= self.types[i] - smaller:
                return False
            if rest[i] > picks[i]:
                smaller = self.types[i]
        return True


class _Region:
    """Bounds lb[k] <= s*(k) <= ub[k] for one region's capacities, tightened on demand by exact search.

    ub[k] = n + 1 means no k-split is known yet; lb[k] > n means k pipelines are impossible.
    """

    def __init__(self, caps: Sequence[int], num_layers: int, budget: int | None) -> None:
        n = len(caps)
        self.n, self.num_layers = n, num_layers
        self.prefix = [0]
        for c in caps:
            self.prefix.append(self.prefix[-1] + c)
        self.type_end = [i + 1 for i in range(n) if i + 1 == n or caps[i + 1] != caps[i]]
        self.types = tuple(caps[i - 1] for i in self.type_end)
        self.jump = self._jumps(caps)
        self.packer = _Packer(self.types, num_layers, budget)
        self.exhausted = False
        self.kmax = min(n, self.prefix[n] // num_layers)
        self.lb = [0] * (self.kmax + 1)
        s = 0
        for k in range(1, self.kmax + 1):
            while s <= n and self.prefix[s] < k * num_layers:
                s += 1
            self.lb[k] = max(s, self.lb[k - 1] + self.jump[0])
        self.ub = [0] + [n + 1] * self.kmax
        self.base = [0] * (self.kmax + 1)
        self.splits: dict[int, list[tuple[int, ...]]] = {0: []}
        self._extend_from(0)

    def _jumps(self, caps: Sequence[int]) -> list[int]:
        """jump[i]: end of the shortest run caps[i:end] holding L layers (n + 1 if none), two pointers."""
        n, end, held = len(caps), 0, 0
        jump = [n + 1] * (n + 2)
        for i in range(n):
            while end < n and held < self.num_layers:
                held += caps[end]
                end += 1
            if held >= self.num_layers:
                jump[i] = end
            held -= caps[i]
        return jump

    def _extend_from(self, k: int) -> None:
        """Upper bounds for larger k: the exact k-split plus runs of the next GPUs in order."""
        s = self.ub[k]
        for j in range(k + 1, self.kmax + 1):
            s = self.jump[s]
            if s > self.n:
                return
            if s < self.ub[j]:
                self.ub[j], self.base[j] = s, k

    def counts(self, start: int, end: int) -> tuple[int, ...]:
        """GPUs of each type among the sorted positions [start, end)."""
        out, begin = [], 0
        for stop in self.type_end:
            out.append(max(0, min(end, stop) - max(start, begin)))
            begin = stop
        return tuple(out)

    def open(self, k: int) -> bool:
        return not self.exhausted and self.lb[k] < self.ub[k] and self.lb[k] <= self.n

    def refine(self, k: int) -> None:
        """One exact test at s = lb[k]: it is s*(k) (keep the split) or lb[k] rises by one.

        When the budget runs out the region stops tightening and keeps the splits it knows.
        """
        s = self.lb[k]
        try:
            split = self.packer.split(self.counts(0, s), k, self.prefix[s] - k * self.num_layers)
        except _OutOfBudget:
            self.exhausted = True
            return
        if split is not None:
            self.ub[k], self.base[k], self.splits[k] = s, k, split
            self._extend_from(k)
            return
        self.lb[k] = s + 1
        for j in range(k + 1, self.kmax + 1):
            if self.lb[j] >= self.lb[j - 1] + self.jump[0]:
                break
            self.lb[j] = self.lb[j - 1] + self.jump[0]

    def resolve(self, k: int) -> bool:
        """Tighten k until s*(k) is known; False if k pipelines are impossible."""
        while self.open(k):
            self.refine(k)
        return self.lb[k] == self.ub[k] <= self.n

    def groups(self, k: int) -> list[tuple[int, ...]]:
        """The k pipelines of ub[k] GPUs as counts per type: a searched split plus runs in order."""
        base = self.base[k]
        groups, s = list(self.splits[base]), self.ub[base]
        for _ in range(k - base):
            groups.append(self.counts(s, self.jump[s]))
            s = self.jump[s]
        return groups


def min_stages(capacities: Iterable[int], num_layers: int) -> tuple[int, ...]:
    """s*(1), s*(2), ...: the least total stages for k pipelines, for every feasible k (exact)."""
    _check_int("number of layers", num_layers, 1)
    caps = list(capacities)
    for c in caps:
        _check_int("layer capacity", c, 1)
    caps.sort(reverse=True)
    if not caps:
        raise AllocationError("no GPUs")
    region = _Region(caps, num_layers, None)
    out = []
    for k in range(1, region.kmax + 1):
        if not region.resolve(k):
            break
        out.append(region.ub[k])
    return tuple(out)


# -- choosing k ------------------------------------------------------------------------------------


class _Score:
    """Exact comparison of Z(k, s) = k^α / (T + (s/k)·r) for α = p/q.

    Z(k1,s1) > Z(k2,s2)  ⇔  k1^(p+q)·E(k2,s2)^q > k2^(p+q)·E(k1,s1)^q with E(k,s) = k·T' + s·r', where
    T', r' are T and r scaled to integers by a common positive factor.
    """

    def __init__(self, params: AllocationParams) -> None:
        alpha, t, r = Fraction(params.alpha), Fraction(params.t_comp_us), Fraction(params.rtt_us)
        scale = lcm(t.denominator, r.denominator)
        self.t, self.r = t.numerator * (scale // t.denominator), r.numerator * (scale // r.denominator)
        self.p_q, self.q = alpha.numerator + alpha.denominator, alpha.denominator

    def beats(self, k1: int, s1: int, k2: int, s2: int) -> bool:
        """Z(k1, s1) > Z(k2, s2), or equal with k1 < k2 (fewer replicas: lower latency for equal Z)."""
        left = k1**self.p_q * (k2 * self.t + s2 * self.r) ** self.q
        right = k2**self.p_q * (k1 * self.t + s1 * self.r) ** self.q
        return left > right or (left == right and k1 < k2)


def _best_k(region: _Region, score: _Score) -> int:
    """argmax_k Z(k, s*(k)) by branch and bound: tighten only the k whose lower bound can still win."""
    kmax, n = region.kmax, region.n

    def leader() -> int:
        best = 1
        for k in range(2, kmax + 1):
            if region.ub[k] <= n and score.beats(k, region.ub[k], best, region.ub[best]):
                best = k
        return best

    best = leader()
    while True:
        pick = None
        for k in range(1, kmax + 1):
            if not region.open(k) or not score.beats(k, region.lb[k], best, region.ub[best]):
                continue
            if pick is None or score.beats(k, region.lb[k], pick, region.lb[pick]):
                pick = k
        if pick is None:
            break
        region.refine(pick)
        best = leader()
    region.resolve(best)
    return best


# -- water-filling ---------------------------------------------------------------------------------


def _water_level(caps: Sequence[int], flops: Sequence[int], num_layers: int) -> tuple[int, int]:
    """λ = p/q with Σ clamp(λ·F_i, 1, c_i) = L: the sum is linear between the sorted breakpoints.

    Scaled by D = lcm(F), the breakpoints are the integers D/F_i (GPU i leaves its floor of one layer)
    and c_i·D/F_i (it reaches its capacity). Walking them in order keeps D·Σ = fixed·D + K·free, with
    `fixed` the layers of GPUs at a bound and `free` the compute of the rest, so the segment where the
    sum reaches L is found with integers and solved there: λ = (L - fixed) / free.
    """
    d = lcm(*flops)
    events = []
    for c, f in zip(caps, flops, strict=True):
        events += [(d // f, f, 1), (d // f * c, -f, -c)]
    events.sort()
    fixed, free = len(caps), 0
    for key, more_free, less_fixed in events:
        if fixed * d + key * free >= num_layers * d:
            break
        free += more_free
        fixed -= less_fixed
    return (num_layers - fixed, free) if free else (key, d)


def water_level(members: Sequence[Gpu], num_layers: int) -> Fraction:
    """The paper's λ for one pipeline (each member keeps at least one layer)."""
    _check_fill(members, num_layers)
    p, q = _water_level([g.layers for g in members], [g.flops for g in members], num_layers)
    return Fraction(p, q)


def _check_fill(members: Sequence[Gpu], num_layers: int) -> None:
    _check_int("number of layers", num_layers, 1)
    if not members or len(members) > num_layers or sum(g.layers for g in members) < num_layers:
        raise AllocationError(
            f"{len(members)} GPUs cannot each hold at least one and together exactly {num_layers} layers"
        )


def water_fill(members: Sequence[Gpu], num_layers: int) -> tuple[int, ...]:
    """Integer layers per member (same order): water-filling, then largest remainders (ties: smaller id)."""
    _check_fill(members, num_layers)
    p, q = _water_level([g.layers for g in members], [g.flops for g in members], num_layers)
    layers, remainders = [], []
    for g in members:
        v = p * g.flops
        if v <= q:
            layers.append(1)
        elif v >= g.layers * q:
            layers.append(g.layers)
        else:
            layers.append(v // q)
            remainders.append((-(v % q), g.id, len(layers) - 1))
    remainders.sort()
    for _, _, i in remainders[: num_layers - sum(layers)]:
        layers[i] += 1
    return tuple(layers)


def _pipeline(region: str, members: Sequence[Gpu], num_layers: int) -> Pipeline:
    stages, cursor = [], 0
    for g, n in zip(members, water_fill(members, num_layers), strict=True):
        stages.append(Stage(g.id, cursor, cursor + n))
        cursor += n
    return Pipeline(region, tuple(stages))


# -- phase 1 ---------------------------------------------------------------------------------------


def _sorted_gpus(gpus: Iterable[Gpu]) -> list[Gpu]:
    """By layer capacity, then compute (descending), then id; refuses duplicate ids and non-GPUs."""
    out = list(gpus)
    ids = set()
    for g in out:
        if not isinstance(g, Gpu):
            raise AllocationError(f"not a GPU: {g!r}")
        if g.id in ids:
            raise AllocationError(f"duplicate GPU id {g.id!r}")
        ids.add(g.id)
    return sorted(out, key=lambda g: (-g.layers, -g.flops, g.id))


def _plan_region(name: str, members: list[Gpu], params: AllocationParams, score: _Score) -> list[Pipeline]:
    """Members sorted as `_sorted_gpus` puts them; within a capacity the first go to the first pipelines."""
    caps = [g.layers for g in members]
    if sum(caps) < params.num_layers:
        return []
    region = _Region(caps, params.num_layers, params.search_budget)
    taken = [0, *region.type_end[:-1]]
    pipelines = []
    for group in region.groups(_best_k(region, score)):
        stage_gpus = []
        for t, n in enumerate(group):
            stage_gpus += members[taken[t] : taken[t] + n]
            taken[t] += n
        pipelines.append(_pipeline(name, stage_gpus, params.num_layers))
    return pipelines


def allocate(gpus: Iterable[Gpu], params: AllocationParams) -> Allocation:
    """Phase 1: per region, the Z-maximising number of pipelines with fewest stages, water-filled."""
    members = _sorted_gpus(gpus)
    if not members:
        raise AllocationError("no GPUs")
    by_region: dict[str, list[Gpu]] = {}
    for g in members:
        by_region.setdefault(g.region, []).append(g)
    score = _Score(params)
    pipelines = []
    for name in sorted(by_region):
        pipelines += _plan_region(name, by_region[name], params, score)
    if not pipelines:
        raise AllocationError(f"no region holds {params.num_layers} layers in total")
    return Allocation(params.num_layers, tuple(sorted(members, key=lambda g: g.id)), tuple(pipelines))


# -- membership ------------------------------------------------------------------------------------


def _share(part: int, total: int) -> Fraction:
    return Fraction(part, total) if total else Fraction(0)


def layer_loads(
    allocation: Allocation, region: str | None = None, memory_weight: Fraction = HALF
) -> tuple[Fraction, ...]:
    """Footnote 2's load of each layer over the GPUs of `region` (all regions when None)."""
    w = _exact("memory weight", memory_weight)
    if w > 1:
        raise AllocationError(f"memory weight must be in [0, 1], got {memory_weight!r}")
    scope = {g.id: g for g in allocation.gpus if region is None or g.region == region}
    memory = sum(g.kv_memory for g in scope.values())
    flops = sum(g.flops for g in scope.values())
    step = [Fraction(0)] * (allocation.num_layers + 1)
    for st in allocation.stages:
        g = scope.get(st.gpu)
        if g is not None:
            n = st.end - st.start
            add = w * _share(g.kv_memory, memory * n) + (1 - w) * _share(g.flops, flops * n)
            step[st.start] += add
            step[st.end] -= add
    loads, running = [], Fraction(0)
    for delta in step[:-1]:
        running += delta
        loads.append(running)
    return tuple(loads)


def _hosted(allocation: Allocation, region: str | None) -> list[bool]:
    regions = {g.id: g.region for g in allocation.gpus}
    hosted = [False] * allocation.num_layers
    for st in allocation.stages:
        if region is None or regions[st.gpu] == region:
            hosted[st.start : st.end] = [True] * (st.end - st.start)
    return hosted


def needs_reallocation(
    allocation: Allocation,
    threshold: Fraction = REBALANCE_THRESHOLD,
    region: str | None = None,
    memory_weight: Fraction = HALF,
) -> bool:
    """Some layer has no host, or CV(load) > threshold, i.e. L·Σx² > (1 + t²)·(Σx)² (exact)."""
    t = _exact("threshold", threshold)
    if not all(_hosted(allocation, region)):
        return True
    loads = layer_loads(allocation, region, memory_weight)
    total = sum(loads)
    squares = sum(x * x for x in loads)
    return total > 0 and len(loads) * squares > (1 + t * t) * total * total


def join(allocation: Allocation, gpu: Gpu, memory_weight: Fraction = HALF) -> Allocation:
    """The GPU takes min(c, L) contiguous layers from its region's bottleneck layer, as a loose stage."""
    if any(st.gpu == gpu.id for st in allocation.stages):
        raise AllocationError(f"GPU {gpu.id!r} already hosts layers")
    loads = layer_loads(allocation, gpu.region, memory_weight)
    bottleneck = min(range(len(loads)), key=lambda i: (loads[i], i))
    width = min(gpu.layers, allocation.num_layers)
    start = min(bottleneck, allocation.num_layers - width)
    gpus = sorted([g for g in allocation.gpus if g.id != gpu.id] + [gpu], key=lambda g: g.id)
    loose = sorted((*allocation.loose, Stage(gpu.id, start, start + width)), key=lambda st: st.gpu)
    return replace(allocation, gpus=tuple(gpus), loose=tuple(loose))


def leave(allocation: Allocation, gpu_id: str) -> Allocation:
    """Release the GPU's layers; the rest of its pipeline (if any) stays as loose stages."""
    if all(g.id != gpu_id for g in allocation.gpus):
        raise AllocationError(f"unknown GPU {gpu_id!r}")
    kept, loose = [], [st for st in allocation.loose if st.gpu != gpu_id]
    for p in allocation.pipelines:
        if any(st.gpu == gpu_id for st in p.stages):
            loose += [st for st in p.stages if st.gpu != gpu_id]
        else:
            kept.append(p)
    return replace(
        allocation,
        gpus=tuple(g for g in allocation.gpus if g.id != gpu_id),
        pipelines=tuple(kept),
        loose=tuple(sorted(loose, key=lambda st: st.gpu)),
    )
