"""A model node: continuous batching over a bounded prefix KV cache, advanced by discrete events.

Each iteration admits waiting jobs (FCFS, up to C running and as KV room allows), gives every decoding
job one token and the prefilling jobs a chunk of their uncached prompt within the token budget. While
no job is prefilling and nothing can be admitted, consecutive decode iterations are identical up to
the next finish, so they run as one event (a "jump"); an arrival that could be admitted cuts the jump
at the iteration in progress, so it waits no longer than it would on a real engine.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from planetserve.node.routing.balance import LatencyEWMA, LoadReport
from planetserve.workloads import Request

from .cache import PrefixCache
from .costs import CostModel, chunk_pairs

Schedule = Callable[[float, Callable[[float], None]], None]
QueueMetric = Literal["outstanding", "waiting"]
"""What a node reports as Q in F_LB = L·(Q/C): its running plus waiting requests (GenTorrent's "active
requests", SGLang's load), or only those waiting for a slot (the PlanetServe paper's wording, which
makes F_LB 0 on every node that is not full, so the tie-break on L alone decides)."""


@dataclass(eq=False)
class Job:
    request: Request
    hashes: list[int] = field(repr=False)
    """Block hashes of the prompt's full blocks."""
    entry: int
    arrival: float
    """At the entry node: latencies count from here."""
    relay: float = 0.0
    """Extra delay of the response on its way back (the forwarding hop)."""
    node: int = -1
    at_node: float = 0.0
    matched: int = 0
    """Prompt blocks found in the cache at admission."""
    cached: int = 0
    """Prompt tokens not computed."""
    done: int = 0
    """Prompt tokens whose KV exists (cached, then computed)."""
    generated: int = 0
    reserved: int = 0
    first_token: float = math.nan
    finish: float = math.nan

    @property
    def prompt_len(self) -> int:
        return self.request.prompt_len

    @property
    def remaining(self) -> int:
        return self.request.output_len - self.generated

    @property
    def context(self) -> int:
        return self.prompt_len + self.generated


@dataclass
class _Jump:
    start: float
    steps: int
    step: float


class Node:
    def __init__(self, index: int, costs: CostModel, schedule: Schedule,
                 on_prefilled: Callable[[Job, float], None], on_done: Callable[[Job, float], None],
                 latency_prior: float | None = None, queue: QueueMetric = "outstanding") -> None:
        """`latency_prior` seeds L: without it a node reports L = 0 until its first request completes,
        which makes its F_LB 0 however long its queue (balance.py's choice for new nodes)."""
        self.index = index
        self.queue = queue
        self.costs = costs
        self.cache = PrefixCache(costs.capacity_blocks, costs.block_size)
        self.schedule = schedule
        self.on_prefilled = on_prefilled
        self.on_done = on_done
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self.latency = LatencyEWMA(value=latency_prior)
        self.busy = False
        self._ticket = 0
        self._jump: _Jump | None = None
        self.prefill_tokens = 0

    def load(self) -> LoadReport:
        queued = self.outstanding if self.queue == "outstanding" else len(self.waiting)
        return LoadReport(self.latency.value or 0.0, queued, self.costs.max_seqs)

    @property
    def outstanding(self) -> int:
        return len(self.waiting) + len(self.running)

    def submit(self, job: Job, now: float) -> None:
        job.node, job.at_node = self.index, now
        queued_before = bool(self.waiting)
        self.waiting.append(job)
        if not self.busy:
            self._begin(now)
        elif self._jump is not None and not queued_before and len(self.running) < self.costs.max_seqs:
            self._cut(now)

    def _arm(self, at: float, fire: Callable[[float], None]) -> None:
        self._ticket += 1
        ticket = self._ticket
        self.busy = True

        def guarded(now: float) -> None:
            if ticket == self._ticket:
                fire(now)

        self.schedule(at, guarded)

    def _admit(self) -> None:
        bs = self.costs.block_size
        while self.waiting and len(self.running) < self.costs.max_seqs:
            job = self.waiting[0]
            matched = self.cache.match(job.hashes)
            needed = -(-(job.prompt_len + job.request.output_len) // bs) - matched
            if not self.cache.admit(job.hashes, matched, needed):
                break
            self.waiting.popleft()
            job.matched, job.reserved = matched, needed
            job.cached = job.done = min(matched * bs, job.prompt_len - 1)
            self.running.append(job)

    def _begin(self, now: float) -> None:
        self._jump = None
        self._admit()
        if not self.running:
            if self.waiting:
                raise RuntimeError(f"node {self.index}: a prompt needs more KV blocks than the node has")
            self.busy = False
            return
        decoding = [j for j in self.running if j.done == j.prompt_len]
        context = sum(j.context for j in decoding)
        if len(decoding) == len(self.running):
            steps = min(j.remaining for j in decoding)
            d = len(decoding)
            step = self.costs.iteration(d, context + d * (steps - 1) / 2, 0, 0)
            self._jump = _Jump(now, steps, step)
            self._arm(now + steps * step, self._end_jump)
            return
        budget = self.costs.token_budget - len(decoding)
        chunks: list[tuple[Job, int]] = []
        tokens, pairs = 0, 0.0
        for job in self.running:
            if job.done < job.prompt_len and budget > 0:
                n = min(job.prompt_len - job.done, budget)
                chunks.append((job, n))
                tokens += n
                pairs += chunk_pairs(job.done, n)
                budget -= n
        took = self.costs.iteration(len(decoding), context, tokens, pairs)
        self.prefill_tokens += tokens
        self._arm(now + took, lambda t: self._end_iteration(t, decoding, chunks))

    def _cut(self, now: float) -> None:
        """End the running jump with the iteration in progress at `now`."""
        jump = self._jump
        assert jump is not None
        steps = min(jump.steps, math.ceil((now - jump.start) / jump.step - 1e-9))
        if steps <= 0:
            self._begin(now)
            return
        jump.steps = steps
        self._arm(jump.start + steps * jump.step, self._end_jump)

    def _end_jump(self, now: float) -> None:
        assert self._jump is not None
        steps = self._jump.steps
        for job in self.running:
            job.generated += steps
        self._finish(now)

    def _end_iteration(self, now: float, decoding: list[Job], chunks: list[tuple[Job, int]]) -> None:
        for job in decoding:
            job.generated += 1
        for job, n in chunks:
            job.done += n
            if job.done == job.prompt_len:
                job.generated = 1
                job.first_token = now
                self.cache.store(job.request, job.hashes, job.matched)
                self.on_prefilled(job, now)
        self._finish(now)

    def _finish(self, now: float) -> None:
        still = []
        for job in self.running:
            if job.done == job.prompt_len and job.remaining <= 0:
                job.finish = now
                self.cache.release(job.hashes, job.reserved - (len(job.hashes) - job.matched))
                self.latency.observe(now - job.at_node)
                self.on_done(job, now)
            else:
                still.append(job)
        self.running = still
        self._begin(now)
