"""Per-run summaries: latency and TTFT as the user sees them from the entry node, and cache hits."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .cluster import RunResult


@dataclass(frozen=True)
class Summary:
    policy: str
    requests: int
    mean_latency: float
    p99_latency: float
    mean_ttft: float
    p99_ttft: float
    hit_rate: float
    """Prompt tokens served from cache / prompt tokens."""
    forwarded: float
    """Fraction of requests served by another node than the one they reached."""
    imbalance: float
    """Most requests served by one node over the mean per node."""
    makespan: float
    wall_s: float
    extra: dict[str, float]


def summarize(result: RunResult) -> Summary:
    jobs = result.jobs
    latency = np.array([j.finish + j.relay - j.arrival for j in jobs])
    ttft = np.array([j.first_token + j.relay - j.arrival for j in jobs])
    prompt = sum(j.prompt_len for j in jobs)
    cached = sum(j.cached for j in jobs)
    served = np.bincount([j.node for j in jobs], minlength=len(result.nodes))
    return Summary(
        policy=result.policy,
        requests=len(jobs),
        mean_latency=float(latency.mean()),
        p99_latency=float(np.percentile(latency, 99)),
        mean_ttft=float(ttft.mean()),
        p99_ttft=float(np.percentile(ttft, 99)),
        hit_rate=cached / prompt if prompt else 0.0,
        forwarded=result.forwarded / len(jobs),
        imbalance=float(served.max() / served.mean()),
        makespan=max(j.finish for j in jobs),
        wall_s=result.wall_s,
        extra=result.extra,
    )
