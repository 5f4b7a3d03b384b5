"""Load balancing and the forwarding decision (seed planetserve.md 3.3 and Algorithm 2).

F_LB = L·(Q/C): L the moving average of a node's per-request latency, Q the requests it holds
(running or waiting: Algorithm 2's "relative requests" are Q/C), C how many requests it serves
concurrently. Counting only waiting requests would make every node below its capacity tie at F_LB = 0
and send the whole group's traffic to the one with the lowest L. Candidates are ranked by the key
(F_LB, L, not-self, node id):

- an idle node has F_LB = 0 whatever its latency, so L breaks the tie and the faster idle node wins;
- a node without a latency sample yet is ranked with the mean L of the nodes that have one, so a new
  node gets its share of requests (it needs them to earn a reputation) but not all of them;
- on a full tie the receiving node keeps the request (no needless hop), then the node id decides, so
  every node ranks the same candidates the same way.

Loads are what peers report about themselves, so a node could understate its own to draw requests.
`checked` raises each peer's report to what the deciding node sees for itself: at least the requests it
has in flight there, at least the latency its forwards there took, and at most the capacity the peer
registered on the ledger.

Everything here is pure: the caller passes the candidates (its node table) and gets a `Decision` that
says why, for logs and tests.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

ALPHA = 1 / 8


@dataclass
class LatencyEWMA:
    """SRTT-style smoothing (α = 1/8, as TCP's RTT estimator): one slow request barely moves L."""

    alpha: float = ALPHA
    value: float | None = None

    def observe(self, sample: float) -> float:
        if not math.isfinite(sample) or sample < 0:
            raise ValueError(f"latency sample must be a finite non-negative number, got {sample}")
        self.value = sample if self.value is None else (1 - self.alpha) * self.value + self.alpha * sample
        return self.value


@dataclass(frozen=True)
class LoadReport:
    """What a node broadcasts about its load."""

    latency: float
    """L, seconds per request (EWMA); 0 before the first sample."""
    queued: int
    """Q: requests the node holds, running or waiting."""
    capacity: int

    def __post_init__(self) -> None:
        if not math.isfinite(self.latency) or self.latency < 0:
            raise ValueError(f"latency must be a finite non-negative number, got {self.latency}")
        if self.queued < 0 or self.capacity < 1:
            raise ValueError(f"need queued >= 0 and capacity >= 1, got {self.queued}, {self.capacity}")

    @property
    def lb_factor(self) -> float:
        return self.latency * self.queued / self.capacity


class Candidate(Protocol):
    """A model node as the node table knows it (hrtree.NodeEntry is one)."""

    @property
    def node_id(self) -> str: ...

    @property
    def trusted(self) -> bool: ...

    @property
    def load(self) -> LoadReport | None: ...


@dataclass(frozen=True)
class Seen:
    """A candidate with the load the deciding node can vouch for."""

    node_id: str
    trusted: bool
    load: LoadReport | None


def checked(candidates: Iterable[Candidate], self_id: str, *, inflight: Mapping[str, int],
            latency: Mapping[str, float], capacity: Mapping[str, int]) -> list[Seen]:
    """Each peer's reported load made no lighter than what this node sees: Q at least its requests in
    flight there, L at least the moving average of its forwards' durations there, C at most the
    registered capacity. Our own entry is what we measure, so it is taken as is."""
    seen = []
    for c in candidates:
        load = c.load
        if load is not None and c.node_id != self_id:
            load = LoadReport(max(load.latency, latency.get(c.node_id, 0.0)),
                              max(load.queued, inflight.get(c.node_id, 0)),
                              max(1, min(load.capacity, capacity.get(c.node_id, load.capacity))))
        seen.append(Seen(c.node_id, c.trusted, load))
    return seen


@dataclass(frozen=True)
class BalancePolicy:
    max_queue_ratio: float = 2.0
    """A node is overloaded once Q >= max_queue_ratio · C: a full round of service waits behind the one
    running. At 1.0 (overloaded as soon as every slot is busy) heavy load throws most cache hits away
    (bench/forwarding.py: hit rate 0.21 instead of 0.36 under Mixed at 2 requests/s per node)."""

    def overloaded(self, load: LoadReport) -> bool:
        return load.queued >= self.max_queue_ratio * load.capacity


class Reason(StrEnum):
    ALREADY_FORWARDED = "already-forwarded"
    AFFINITY = "affinity"
    HIT = "hit"
    HIT_OVERLOADED = "hit-overloaded"
    MISS = "miss"
    NEW_NODE = "new-node"
    NO_CANDIDATES = "no-candidates"


@dataclass(frozen=True)
class Decision:
    target: str
    reason: Reason
    forward: bool
    detail: str = ""


def rank_key(load: LoadReport, node_id: str, self_id: str) -> tuple[float, float, bool, str]:
    return (load.lb_factor, load.latency, node_id != self_id, node_id)


def route(self_id: str, candidates: Iterable[Candidate], *, holders: Collection[str] = (),
          forwarded: bool = False, affinity: str | None = None,
          policy: BalancePolicy | None = None) -> Decision:
    """Algorithm 2 for one request at node `self_id`.

    `holders` are the nodes the HR-tree matched (empty on a miss); `forwarded` says the request already
    took its one forwarding hop; `affinity` is the node a session's follow-up asks for. Only trusted
    candidates with a known load are ever chosen (the receiving node included); with none, it serves
    the request itself. A node that has not served a request yet (no latency sample of its own) serves
    what it receives itself, hits included: ranked at the group's mean it would forward every miss, a
    prefix every request shares (a chat template) would send it every hit, and it would never earn a
    reputation of its own (nor be caught serving another model).
    """
    policy = policy or BalancePolicy()
    if forwarded:
        return Decision(self_id, Reason.ALREADY_FORWARDED, False, "a request is forwarded at most once")
    reported = {c.node_id: c.load for c in candidates if c.trusted and c.load is not None}
    eligible = effective_loads(reported)
    notes: list[str] = []
    if affinity is not None:
        load = eligible.get(affinity)
        if load is not None and not policy.overloaded(load):
            return _decide(self_id, affinity, Reason.AFFINITY, "session affinity")
        notes.append(f"affinity {affinity} " + ("overloaded" if load else "not a trusted candidate"))
    if not eligible:
        return Decision(self_id, Reason.NO_CANDIDATES, False, "; ".join([*notes, "no trusted candidate"]))

    if self_id in reported and reported[self_id].latency == 0:
        return Decision(self_id, Reason.NEW_NODE, False,
                        "; ".join([*notes, "no latency sample of its own yet"]))

    def best(ids: Iterable[str]) -> str:
        return min(ids, key=lambda n: rank_key(eligible[n], n, self_id))

    if holders:
        trusted_holders = [h for h in holders if h in eligible]
        if trusted_holders:
            holder = best(trusted_holders)
            if not policy.overloaded(eligible[holder]):
                return _decide(self_id, holder, Reason.HIT, "; ".join([*notes, "least-loaded holder"]))
            notes.append(f"holder {holder} overloaded")
            return _decide(self_id, best(eligible), Reason.HIT_OVERLOADED,
                           "; ".join([*notes, "least-loaded overall"]))
        notes.append("no trusted holder")
    return _decide(self_id, best(eligible), Reason.MISS, "; ".join([*notes, "least-loaded overall"]))


def effective_loads(loads: dict[str, LoadReport]) -> dict[str, LoadReport]:
    """The loads ranking uses: a node's missing latency sample replaced by the mean of the others'."""
    known = [load.latency for load in loads.values() if load.latency > 0]
    if not known or len(known) == len(loads):
        return loads
    mean = sum(known) / len(known)
    return {n: load if load.latency > 0 else LoadReport(mean, load.queued, load.capacity)
            for n, load in loads.items()}


def _decide(self_id: str, target: str, reason: Reason, detail: str) -> Decision:
    return Decision(target, reason, target != self_id, detail)
