"""Sentry (seed planetserve.md, appendix A3): the chunk-length array L that cuts prompts into HR-tree chunks.

HR-tree paths only compare when every node of a group cuts prompts at the same token positions, so the
cut is a value, `ChunkPlan`, that is versioned and shared: L puts a chunk boundary at the end of each
common prefix (system prompt) that the Sentry detects, s_1 < ... < s_n, and one δ tokens after it:

    l_1 = s_1,   l_2k = δ,   l_2k+1 = s_k+1 - s_k - δ

so that each system prompt is its own path segment; after s_n + δ the prompt is cut every
`default_chunk` tokens. With a KV block size set, every boundary is a multiple of it, because an engine
caches whole blocks only and a chunk it cannot hold whole could never be advertised.

A chunk is only ever taken whole: `ChunkPlan.spans(n)` lists the complete chunks of an n-token prompt,
since the hash of a partial chunk could never equal the hash of the complete chunk at that position.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PlanId = tuple[int, str]
"""(version, origin node id): the total order by which a group converges on one plan."""

MAX_PLAN_CHUNKS = 512
MAX_CHUNK_TOKENS = 1 << 20
MAX_ORIGIN_LEN = 128
MAX_VERSION = (1 << 63) - 1
MAX_VERSION_STEP = 1 << 10
"""The most a peer's plan may be ahead of ours: plans go up one version a change, so a group's nodes are
never far apart, where a plan at the largest version could never be followed."""


@dataclass(frozen=True)
class ChunkPlan:
    """L plus the default chunking after it; the whole plan travels in sync snapshots."""

    lengths: tuple[int, ...] = ()
    default_chunk: int = 64
    block_size: int = 1
    version: int = 0
    origin: str = ""
    _bounds: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("default_chunk", "block_size"):
            value = getattr(self, name)
            if not _is_int(value) or not 1 <= value <= MAX_CHUNK_TOKENS:
                raise ValueError(f"{name} must be an integer in [1, {MAX_CHUNK_TOKENS}], got {value!r}")
        if self.default_chunk % self.block_size:
            raise ValueError(f"default_chunk {self.default_chunk} is not a multiple of block_size "
                             f"{self.block_size}")
        if not _is_int(self.version) or not 0 <= self.version <= MAX_VERSION:
            raise ValueError(f"version must be an integer in [0, 2^63), got {self.version!r}")
        if not isinstance(self.origin, str) or len(self.origin) > MAX_ORIGIN_LEN:
            raise ValueError(f"origin must be a string of at most {MAX_ORIGIN_LEN} characters")
        if not isinstance(self.lengths, tuple) or len(self.lengths) > MAX_PLAN_CHUNKS:
            raise ValueError(f"lengths must be a tuple of at most {MAX_PLAN_CHUNKS} chunk lengths")
        bounds = []
        end = 0
        for length in self.lengths:
            if not _is_int(length) or not 1 <= length <= MAX_CHUNK_TOKENS:
                raise ValueError(f"chunk lengths must be integers in [1, {MAX_CHUNK_TOKENS}], got {length!r}")
            end += length
            if end % self.block_size:
                raise ValueError(f"chunk boundary {end} is not a multiple of block_size {self.block_size}")
            bounds.append(end)
        object.__setattr__(self, "_bounds", tuple(bounds))

    @property
    def id(self) -> PlanId:
        return (self.version, self.origin)

    def spans(self, n: int) -> list[tuple[int, int]]:
        """The complete chunks of an n-token prompt, as (start, end) token offsets."""
        out: list[tuple[int, int]] = []
        start = 0
        for end in self._bounds:
            if end > n:
                return out
            out.append((start, end))
            start = end
        step = self.default_chunk
        out.extend((s, s + step) for s in range(start, n - step + 1, step))
        return out

    def span_at(self, pos: int) -> tuple[int, int]:
        """The chunk that holds token position `pos`."""
        if pos < 0:
            raise ValueError(f"token position must be non-negative, got {pos}")
        bounds = self._bounds
        if bounds and pos < bounds[-1]:
            i = bisect.bisect_right(bounds, pos)
            return (bounds[i - 1] if i else 0, bounds[i])
        last = bounds[-1] if bounds else 0
        start = last + (pos - last) // self.default_chunk * self.default_chunk
        return (start, start + self.default_chunk)

    def to_wire(self) -> list[Any]:
        return [self.version, self.origin, list(self.lengths), self.default_chunk, self.block_size]

    @classmethod
    def from_wire(cls, obj: object) -> ChunkPlan:
        """Rebuild a peer's plan; ValueError for anything that is not a valid plan."""
        if not isinstance(obj, list) or len(obj) != 5 or not isinstance(obj[2], list):
            raise ValueError("a chunk plan is [version, origin, [lengths], default_chunk, block_size]")
        version, origin, lengths, default_chunk, block_size = obj
        if len(lengths) > MAX_PLAN_CHUNKS:
            raise ValueError(f"a chunk plan has at most {MAX_PLAN_CHUNKS} lengths, got {len(lengths)}")
        return cls(lengths=tuple(lengths), default_chunk=default_chunk, block_size=block_size,
                   version=version, origin=origin)


@dataclass(frozen=True)
class SentryConfig:
    delta: int = 8
    """δ, the separator chunk after each detected prefix: it tells apart what follows a system prompt."""
    default_chunk: int = 64
    block_size: int | None = None
    """Align every chunk boundary to this engine KV block size (None: no alignment)."""
    refresh_every: int = 10_000
    sample_size: int = 2_048
    """How many recent prompts the detection looks at (a bound on its memory and time)."""
    min_count: int = 8
    min_fraction: float = 0.05
    """A prefix is common when at least max(min_count, min_fraction of the sample) prompts share it and
    then diverge."""
    min_prefix: int = 16
    max_prefix: int = 8_192
    """Prompts are kept truncated to this many tokens: no system prompt is longer."""
    max_prefixes: int = 8

    def __post_init__(self) -> None:
        if self.delta < 1 or self.default_chunk < 1 or self.refresh_every < 1 or self.min_prefix < 1:
            raise ValueError("delta, default_chunk, refresh_every and min_prefix must be positive")
        if self.block_size is not None and not 1 <= self.block_size <= MAX_CHUNK_TOKENS:
            raise ValueError(f"block_size must be in [1, {MAX_CHUNK_TOKENS}], got {self.block_size}")
        if self.min_count < 2:
            raise ValueError("min_count must be at least 2: one prompt shares a prefix with nothing")
        if not 0.0 <= self.min_fraction <= 1.0:
            raise ValueError(f"min_fraction must be in [0, 1], got {self.min_fraction}")
        if self.sample_size < self.min_count or self.max_prefix < self.min_prefix:
            raise ValueError("sample_size must be >= min_count and max_prefix >= min_prefix")
        if not 1 <= self.max_prefixes <= MAX_PLAN_CHUNKS // 2:
            raise ValueError(f"max_prefixes must be in [1, {MAX_PLAN_CHUNKS // 2}]")

    def initial_plan(self) -> ChunkPlan:
        """Version 0, which every node with the same configuration starts from: the group agrees at once."""
        return self.plan_for((), version=0, origin="")

    def plan_for(self, prefixes: Sequence[int], *, version: int, origin: str) -> ChunkPlan:
        """L for the detected common prefix lengths (ascending; appendix A3)."""
        block = self.block_size or 1
        bounds: list[int] = []
        for s in prefixes:
            bounds += [s, s + self.delta]
        aligned = sorted({b // block * block for b in bounds} - {0})
        lengths = tuple(b - a for a, b in zip([0, *aligned], aligned, strict=False))
        default_chunk = math.ceil(self.default_chunk / block) * block
        return ChunkPlan(lengths=lengths, default_chunk=default_chunk, block_size=block,
                         version=version, origin=origin)


class Sentry:
    """Watches a node's prompts and proposes a new plan every `refresh_every` of them when L changes."""

    def __init__(self, node_id: str, config: SentryConfig | None = None) -> None:
        self.node_id = node_id
        self.config = config or SentryConfig()
        self.plan = self.config.initial_plan()
        self._sample: deque[tuple[int, ...]] = deque(maxlen=self.config.sample_size)
        self._seen = 0

    def chunk(self, token_ids: Sequence[int]) -> list[tuple[int, int]]:
        return self.plan.spans(len(token_ids))

    def observe(self, token_ids: Sequence[int]) -> ChunkPlan | None:
        """Record one prompt; the new plan when this observation triggered a refresh that changed L."""
        self._sample.append(tuple(token_ids[: self.config.max_prefix]))
        self._seen += 1
        if self._seen % self.config.refresh_every:
            return None
        return self.refresh()

    def refresh(self) -> ChunkPlan | None:
        """Recompute L from the sample; a new plan (next version, this node as origin) only if L changed,
        so a group whose prompts are stable does not churn through plans (each one invalidates paths)."""
        if self.plan.version >= MAX_VERSION:
            return None
        candidate = self.config.plan_for(self.detect(), version=self.plan.version + 1, origin=self.node_id)
        if candidate.lengths == self.plan.lengths and candidate.default_chunk == self.plan.default_chunk \
                and candidate.block_size == self.plan.block_size:
            return None
        self.plan = candidate
        return candidate

    def adopt(self, plan: ChunkPlan) -> bool:
        """Take a peer's plan if it is newer by (version, origin), by at most MAX_VERSION_STEP versions,
        and cuts as this group does (its block size and default chunk; only L, what the Sentry detects,
        may differ); the group ends on the greatest one. One snapshot with chunks of 2^20 tokens at the
        largest version turned a group's cache-aware routing off for good."""
        initial = self.config.initial_plan()
        if (plan.id <= self.plan.id or plan.version > self.plan.version + MAX_VERSION_STEP
                or plan.block_size != initial.block_size or plan.default_chunk != initial.default_chunk):
            return False
        self.plan = plan
        return True

    def detect(self) -> list[int]:
        """Lengths of the common prefixes in the sample, ascending, at least δ + 1 apart."""
        cfg = self.config
        threshold = max(cfg.min_count, math.ceil(cfg.min_fraction * len(self._sample)))
        found = common_prefixes(list(self._sample), threshold, cfg.min_prefix)
        strongest = sorted(found, key=lambda f: (-f[1], f[0]))[: cfg.max_prefixes]
        kept: list[int] = []
        for length in sorted(length for length, _ in strongest):
            if not kept or length > kept[-1] + cfg.delta:
                kept.append(length)
        return kept


def common_prefixes(samples: Sequence[Sequence[int]], threshold: int, min_len: int) -> list[tuple[int, int]]:
    """(length, count) of each prefix at which at least `threshold` samples end or branch off into
    continuations that fewer than `threshold` samples share.

    The samples are sorted, so every prefix shared by several of them is a contiguous run whose adjacent
    longest common prefixes are all at least its length (an lcp interval); one stack pass over the
    adjacent lcps visits each interval once, with its count and the counts of its child intervals.
    """
    seqs = sorted(tuple(s) for s in samples)
    n = len(seqs)
    if n < threshold:
        return []
    lcps = [_lcp(seqs[i - 1], seqs[i]) for i in range(1, n)]
    found: list[tuple[int, int]] = []
    stack: list[list[int]] = [[0, 0, 0]]  # [depth, first index, samples in common child intervals]
    for i in range(1, n + 1):
        h = lcps[i - 1] if i < n else -1
        start = i - 1
        orphan = 0
        while stack and h < stack[-1][0]:
            depth, start, shared = stack.pop()
            count = i - start
            common = count if count >= threshold else 0
            if common and depth >= min_len and count - shared >= threshold:
                found.append((depth, count - shared))
            if stack and h <= stack[-1][0]:
                stack[-1][2] += common
                orphan = 0
            else:
                orphan = common
        if stack and h > stack[-1][0]:
            stack.append([h, start, orphan])
    return found


def _lcp(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the common prefix, by galloping on slice comparisons (done in C, unlike a Python loop)."""
    n = min(len(a), len(b))
    hi = 64
    lo = 0
    while hi < n and a[:hi] == b[:hi]:
        lo, hi = hi, hi * 2
    hi = min(hi, n)
    if a[:hi] == b[:hi]:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
