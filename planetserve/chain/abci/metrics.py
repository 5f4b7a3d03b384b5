"""The ABCI application's Prometheus metrics (docs/operators.md, "Monitoring"). They observe the
app and never feed its state: durations use the process clock, counts are of what it executed."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from planetserve.chain import layout
from planetserve.chain.abci.store import StateStore
from planetserve.registry.epochs import Schedule
from planetserve.registry.params import Params

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

ENTITIES = {
    "users": layout.key("user", ""),
    "model_nodes": layout.NODE_PREFIX,
    "members": layout.MEMBER_PREFIX,
    "organisations": layout.ORG_PREFIX,
    "deployments": layout.DEPLOYMENT_PREFIX,
}
"""What `planetserve_app_entities` counts, by its `kind` label."""

PHASES = ("results", "attest", "vrf", "plan", "finalize")


def phase(schedule: Schedule, height: int) -> str:
    """The epoch phase a block belongs to (registry/epochs.py): its last block finalizes; the VRF and
    plan windows end it; its first blocks take the leader's results."""
    if schedule.offset(height) == schedule.epoch_blocks - 1:
        return "finalize"
    if schedule.in_plan_window(height):
        return "plan"
    if schedule.in_vrf_window(height):
        return "vrf"
    return "results" if schedule.in_results(height) else "attest"


class _Entities(Collector):
    """The registry's sizes, counted in the committed state when Prometheus scrapes (one indexed
    range count per kind, on a read snapshot of its own)."""

    def __init__(self, store: StateStore) -> None:
        self._store = store

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("planetserve_app_entities", "Entities in the committed state, by kind",
                                   labels=["kind"])
        if self._store.height:
            with self._store.snapshot() as view:
                for kind, prefix in ENTITIES.items():
                    family.add_metric([kind], view.count(prefix))
        yield family


class AppMetrics:
    def __init__(self, store: StateStore, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.transactions = Counter(
            "planetserve_app_transactions",
            "Transactions executed in blocks, by type and result code (0: ok)",
            ["type", "code"], registry=r)
        self.checked = Counter(
            "planetserve_app_checked_transactions",
            "New transactions checked for the mempool (CheckTx), by type and result code", ["type", "code"],
            registry=r)
        self.finalize_seconds = Histogram(
            "planetserve_app_finalize_block_seconds", "FinalizeBlock's duration", buckets=_SECONDS,
            registry=r)
        self.commit_seconds = Histogram(
            "planetserve_app_commit_seconds", "Commit's duration (the state written to the database)",
            buckets=_SECONDS, registry=r)
        self.epoch_finalize_seconds = Histogram(
            "planetserve_app_epoch_finalization_seconds",
            "FinalizeBlock's duration at an epoch's last block, which finalizes it", buckets=_SECONDS,
            registry=r)
        self.height = Gauge("planetserve_app_height", "The last committed height", registry=r)
        self.epoch = Gauge("planetserve_app_epoch", "The epoch of the last finalized block", registry=r)
        self.phase = Gauge("planetserve_app_epoch_phase", "1 for the epoch phase of the last finalized block",
                           ["phase"], registry=r)
        self.snapshot_height = Gauge(
            "planetserve_app_snapshot_height", "The height of the newest state sync snapshot kept (0: none)",
            registry=r)
        self.retain_height = Gauge(
            "planetserve_app_retain_height", "The lowest block CometBFT is asked to keep (0: all)",
            registry=r)
        r.register(_Entities(store))

    def block(self, params: Params, height: int, started: float) -> None:
        """After FinalizeBlock of `height`, begun at `started` (time.perf_counter)."""
        took = time.perf_counter() - started
        self.finalize_seconds.observe(took)
        schedule = Schedule.from_params(params)
        now = phase(schedule, height)
        if now == "finalize":
            self.epoch_finalize_seconds.observe(took)
        self.epoch.set(schedule.epoch_of(height))
        for name in PHASES:
            self.phase.labels(name).set(1 if name == now else 0)

    def committed(self, height: int, started: float, retain: int, snapshot: int | None) -> None:
        self.commit_seconds.observe(time.perf_counter() - started)
        self.height.set(height)
        self.retain_height.set(retain)
        self.snapshot_height.set(snapshot or 0)
