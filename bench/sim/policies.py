"""Routing policies: where the request that reached an entry node is served.

- `NoForwarding`: every node serves what reaches it (round robin over the group, no cache sharing);
- `Overlay(balance=False)`: the HR-tree alone, forwarding a hit to any holder and serving a miss
  locally (the paper's ablation step "HR-tree" without load balancing);
- `Overlay(balance=True)`: PlanetServe, Algorithm 2 with F_LB = L·(Q/C) (`planetserve.node.routing.balance`);
- `Centralized`: one router with perfect, instant knowledge of every cache and every queue (the
  SGLang router's cache-aware policy).

Both overlay policies run the real protocol (`planetserve.node.routing`: `cachesync`, `hrtree`,
`sentry`): each node routes from its own HR-tree, which learns its peers' caches only from their
messages (deltas every 100 ms, snapshots every 5 s, one network delay later) and from its own
speculative insertions; load reports ride on those messages.
"""

from __future__ import annotations

import random
from collections.abc import Container, Sequence
from dataclasses import dataclass, field

from planetserve.node.routing.balance import BalancePolicy, route
from planetserve.node.routing.cachesync import CacheSync, SyncConfig
from planetserve.node.routing.sentry import Sentry, SentryConfig
from planetserve.workloads import Request

from .cluster import Cluster
from .node import Job

GROUP_KEY = b"planetserve-simulated-group"


class NoForwarding:
    name = "no-forwarding"
    affinity = False

    def bind(self, cluster: Cluster) -> None:
        pass

    def route(self, job: Job, entry: int, now: float) -> int:
        return entry

    def prefilled(self, job: Job, now: float) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {}


@dataclass
class Centralized:
    """Longest cached prefix (requests routed but not yet prefilled count as cached, so a burst of a
    new prefix follows its first request), least outstanding requests among the longest; below
    `cache_threshold` of the prompt matched, or when the loads drift apart by more than
    `balance_abs` and the factor `balance_rel`, simply the least loaded node (sgl-router's defaults)."""

    cache_threshold: float = 0.5
    balance_abs: int = 32
    balance_rel: float = 1.0001
    name: str = "centralized"
    affinity: bool = False
    _cluster: Cluster | None = field(default=None, repr=False)
    _pending: list[dict[int, int]] = field(default_factory=list, repr=False)

    def bind(self, cluster: Cluster) -> None:
        self._cluster = cluster
        self.start(len(cluster.nodes))

    def start(self, nodes: int) -> None:
        """Route among `nodes` nodes, none of them holding a routed prompt yet."""
        self._pending = [{} for _ in range(nodes)]

    def route(self, job: Job, entry: int, now: float) -> int:
        assert self._cluster is not None
        nodes = self._cluster.nodes
        return self.choose([n.outstanding for n in nodes], [n.cache.refs for n in nodes], job.hashes,
                           [len(n.cache) for n in nodes])

    def choose(self, loads: Sequence[int], cached: Sequence[Container[int]], hashes: Sequence[int],
               sizes: Sequence[int] | None = None) -> int:
        """The node for a prompt of block `hashes`, from each node's outstanding requests and cached
        blocks (ties in load go to the smaller cache when `sizes` are given); the prompt counts as
        cached there until `release`. Any nodes: bench/forwarding_real.py routes real engines by it."""
        order = sizes if sizes is not None else [0] * len(loads)
        least = min(range(len(loads)), key=lambda i: (loads[i], order[i], i))
        if max(loads) - loads[least] > self.balance_abs and max(loads) > self.balance_rel * loads[least]:
            return self._place(hashes, least)
        matches = [self._match(cached[i], self._pending[i], hashes) for i in range(len(loads))]
        best = max(matches)
        if not best or best < self.cache_threshold * len(hashes):
            return self._place(hashes, least)
        return self._place(hashes, min((i for i in range(len(loads)) if matches[i] == best),
                                       key=lambda i: (loads[i], i)))

    def prefilled(self, job: Job, now: float) -> None:
        self.release(job.node, job.hashes)

    def release(self, node: int, hashes: Sequence[int]) -> None:
        """The prompt routed to `node` is prefilled: its cache now says whether it holds it."""
        pending = self._pending[node]
        for h in hashes:
            left = pending[h] - 1
            if left:
                pending[h] = left
            else:
                del pending[h]

    def stats(self) -> dict[str, float]:
        return {}

    @staticmethod
    def _match(cached: Container[int], pending: dict[int, int], hashes: Sequence[int]) -> int:
        n = 0
        for h in hashes:
            if h not in cached and h not in pending:
                break
            n += 1
        return n

    def _place(self, hashes: Sequence[int], node: int) -> int:
        pending = self._pending[node]
        for h in hashes:
            pending[h] = pending.get(h, 0) + 1
        return node


class _Publisher:
    """Feeds one node's cache changes to its CacheSync, as token prefixes (what the engine holds)."""

    def __init__(self, sync: CacheSync, block_size: int) -> None:
        self.sync = sync
        self.block_size = block_size

    def stored(self, request: Request, blocks: int) -> None:
        self.sync.stored(request.prompt_ids[: blocks * self.block_size])

    def evicted(self, request: Request, block: int) -> None:
        self.sync.removed(request.prompt_ids[: (block + 1) * self.block_size])


class Overlay:
    """Every node routes with its own CacheSync: its HR-tree view and its node table of load reports.

    The chunk plan is the Sentry's initial one (64-token chunks on 16-token block boundaries): the
    paper refreshes L every 10,000 requests, more than a node sees in these runs."""

    def __init__(self, *, balance: bool, min_depth: int = 1, hash_bits: int = 8,
                 config: SyncConfig | None = None, policy: BalancePolicy | None = None,
                 seed: int = 0) -> None:
        """Defaults: load reports on every 100 ms delta (not cachesync's 1 s), and a holder counts as
        overloaded at Q >= 2C, a full batch running and another waiting (at C, every node of a busy
        group is "overloaded" and Algorithm 2's fallback throws the cache hits away)."""
        self.balance = balance
        self.policy = policy or BalancePolicy(max_queue_ratio=2.0)
        self.name = "planetserve" if balance else "hr-tree"
        self.affinity = balance
        self.min_depth = min_depth
        self.hash_bits = hash_bits
        self.config = config or SyncConfig(load_interval=0.1)
        self.rng = random.Random(seed)
        self.syncs: list[CacheSync] = []
        self.ids: list[str] = []
        self.hits = 0
        self.searches = 0

    def bind(self, cluster: Cluster) -> None:
        self._cluster = cluster
        self.ids = [f"node{i}" for i in range(len(cluster.nodes))]
        self._index = {node_id: i for i, node_id in enumerate(self.ids)}
        sentry_config = SentryConfig(block_size=cluster.costs.block_size)
        for i, node_id in enumerate(self.ids):
            sync = CacheSync(node_id, GROUP_KEY, sentry=Sentry(node_id, sentry_config),
                             hash_bits=self.hash_bits, config=self.config, min_depth=self.min_depth,
                             incarnation=i + 1)
            sync.tree.table.upsert(node_id, trusted=True)
            for peer in self.ids:
                if peer != node_id:
                    sync.add_peer(peer, now=0.0, trusted=True)
            self.syncs.append(sync)
            cluster.nodes[i].cache.listener = _Publisher(sync, cluster.costs.block_size)
        cluster.schedule(0.0, self._tick)

    def route(self, job: Job, entry: int, now: float) -> int:
        sync = self.syncs[entry]
        me = self.ids[entry]
        sync.tree.table.upsert(me, load=self._cluster.nodes[entry].load())
        prompt = job.request.prompt_ids
        found = sync.search(prompt)
        holders = found.holders if found.matched else frozenset()
        self.searches += 1
        self.hits += bool(holders)
        if self.balance:
            affinity = me if self.affinity and job.request.session is not None else None
            target = self._index[route(me, sync.tree.table, holders=holders, affinity=affinity,
                                              policy=self.policy).target]
        else:
            target = self._index[self.rng.choice(sorted(holders))] if holders else entry
        if target != entry:
            sync.forwarded(self.ids[target], prompt, now)
        return target

    def prefilled(self, job: Job, now: float) -> None:
        pass

    def stats(self) -> dict[str, float]:
        sent = sum(s.stats.sent_bytes for s in self.syncs)
        return {
            "hr_hit": self.hits / max(1, self.searches),
            "sync_kib": sent / 1024,
            "snapshots": sum(s.stats.sent_snapshots for s in self.syncs),
            "deltas": sum(s.stats.sent_deltas for s in self.syncs),
            "gaps": sum(s.stats.gaps for s in self.syncs),
        }

    def _tick(self, now: float) -> None:
        for i, sync in enumerate(self.syncs):
            sync.load = self._cluster.nodes[i].load()
            for data in sync.poll(now):
                self._send(i, None, data, now)
        if self._cluster.unfinished:
            self._cluster.schedule(now + self.config.batch_interval, self._tick)

    def _send(self, sender: int, to: int | None, data: bytes, now: float) -> None:
        """Broadcast (to None) or unicast, arriving one network delay later."""
        self._cluster.schedule(now + self._cluster.net_delay, lambda t: self._deliver(sender, to, data, t))

    def _deliver(self, sender: int, to: int | None, data: bytes, now: float) -> None:
        receivers = range(len(self.syncs)) if to is None else (to,)
        for j in receivers:
            if j != sender:
                reply = self.syncs[j].receive(self.ids[sender], data, now).reply
                if reply is not None:
                    self._send(j, sender, reply, now)
