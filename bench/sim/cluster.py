"""The event loop: requests arrive at entry nodes, a routing policy places them, nodes serve them.

Users spread their requests over the group's nodes (round robin by arrival), as proxies of many users
would; the entry node then serves or forwards. A forwarded request pays the one-way network delay on
the way in and again on its response's way back through the entry node.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from planetserve.node.engine.kvcache import block_hashes
from planetserve.workloads import Request

from .costs import CostModel
from .node import Job, Node, QueueMetric


@dataclass(frozen=True)
class Prepared:
    """A request list with each prompt's block hashes, computed once for every policy's run."""

    requests: tuple[Request, ...]
    hashes: tuple[list[int], ...]
    block_size: int

    @classmethod
    def of(cls, requests: Sequence[Request], block_size: int) -> Prepared:
        hashes = tuple(block_hashes(r.prompt_ids, block_size) for r in requests)
        return cls(tuple(requests), hashes, block_size)


class Policy(Protocol):
    name: str

    affinity: bool
    """Users send a session's follow-ups to the node that served its previous turn."""

    def bind(self, cluster: Cluster) -> None:
        """Called once, nodes built, before the first arrival: may attach cache listeners and schedule
        its own events."""
        ...

    def route(self, job: Job, entry: int, now: float) -> int:
        """The node that serves the job that arrived at `entry`."""
        ...

    def prefilled(self, job: Job, now: float) -> None: ...

    def stats(self) -> dict[str, float]: ...


@dataclass
class RunResult:
    policy: str
    jobs: list[Job]
    nodes: list[Node]
    wall_s: float
    forwarded: int
    extra: dict[str, float]


class Cluster:
    def __init__(self, prepared: Prepared, policy: Policy, costs: CostModel, nodes: int,
                 net_delay: float = 0.02, warm: bool = True, queue: QueueMetric = "outstanding") -> None:
        """`warm`: nodes start with L at the workload's unloaded mean service time, as in a group that
        has been serving for a while, rather than with no sample at all."""
        if costs.block_size != prepared.block_size:
            raise ValueError("the requests were hashed with another block size")
        self.prepared = prepared
        self.policy = policy
        self.costs = costs
        self.net_delay = net_delay
        self._heap: list[tuple[float, int, Callable[[float], None]]] = []
        self._order = itertools.count()
        self.unfinished = len(prepared.requests)
        self.forwarded = 0
        prior = unloaded_latency(prepared.requests, costs) if warm else None
        self.nodes = [Node(i, costs, self.schedule, policy.prefilled, self._done, prior, queue)
                      for i in range(nodes)]
        self.jobs: list[Job] = []
        self._sessions: dict[str, int] = {}
        policy.bind(self)

    def schedule(self, at: float, fire: Callable[[float], None]) -> None:
        heapq.heappush(self._heap, (at, next(self._order), fire))

    def run(self) -> RunResult:
        started = time.perf_counter()
        n = len(self.nodes)
        for i, (request, hashes) in enumerate(zip(self.prepared.requests, self.prepared.hashes, strict=True)):
            self.schedule(request.arrival, lambda t, r=request, h=hashes, e=i % n: self._arrive(r, h, e, t))
        heap = self._heap
        while heap:
            at, _, fire = heapq.heappop(heap)
            fire(at)
        if self.unfinished:
            raise RuntimeError(f"{self.unfinished} requests never finished")
        return RunResult(self.policy.name, self.jobs, self.nodes, time.perf_counter() - started,
                         self.forwarded, self.policy.stats())

    def _arrive(self, request: Request, hashes: list[int], entry: int, now: float) -> None:
        if self.policy.affinity and request.session is not None:
            entry = self._sessions.get(request.session, entry)
        job = Job(request, hashes, entry, now)
        self.jobs.append(job)
        target = self.policy.route(job, entry, now)
        if target == entry:
            self.nodes[target].submit(job, now)
            return
        self.forwarded += 1
        job.relay = self.net_delay
        self.schedule(now + self.net_delay, lambda t: self.nodes[target].submit(job, t))

    def _done(self, job: Job, now: float) -> None:
        self.unfinished -= 1
        if job.request.session is not None:
            self._sessions[job.request.session] = job.node


def unloaded_latency(requests: Sequence[Request], costs: CostModel) -> float:
    """Mean service time of the requests alone on an idle node, nothing cached."""
    total = 0.0
    for r in requests:
        decode = costs.step_s + costs.decode_seq_s + costs.kv_token_s * (r.prompt_len + r.output_len / 2)
        total += costs.step_s + costs.prefill_seconds(0, r.prompt_len) + (r.output_len - 1) * decode
    return total / max(1, len(requests))
