"""The serving simulator (bench/sim): conservation, prefix-cache accounting, routing, determinism."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.sim import (
    A100_LLAMA3_8B,
    Centralized,
    Cluster,
    NoForwarding,
    Overlay,
    Prepared,
    summarize,
)
from bench.sim.cache import PrefixCache
from planetserve import workloads as w
from planetserve.node.engine.kvcache import block_hashes

COSTS = A100_LLAMA3_8B


@pytest.fixture(scope="module")
def small() -> Prepared:
    return Prepared.of(w.generate("mixed", rate=6.0, count=120, seed=1, scale=0.1), COSTS.block_size)


@pytest.fixture(scope="module")
def tooluse() -> Prepared:
    return Prepared.of(w.generate("tooluse", rate=8.0, count=200, seed=2, scale=0.1), COSTS.block_size)


def policies() -> list:
    return [NoForwarding(), Overlay(balance=False), Overlay(balance=True), Centralized()]


@pytest.mark.parametrize("policy", policies(), ids=lambda p: p.name)
def test_every_request_completes_once(small: Prepared, policy) -> None:
    cluster = Cluster(small, policy, COSTS, 4)
    result = cluster.run()
    assert sorted(j.request.id for j in result.jobs) == [r.id for r in small.requests]
    for job in result.jobs:
        assert job.arrival <= job.first_token <= job.finish
        assert job.generated == job.request.output_len
        assert job.done == job.request.prompt_len
        assert 0 <= job.cached < job.request.prompt_len
    for node in cluster.nodes:
        assert not node.running and not node.waiting and not node.busy
        assert node.cache.reserved == 0 and all(v == 0 for v in node.cache.refs.values())
        assert len(node.cache) <= node.cache.capacity


def _request(rid: int, arrival: float, prefix: tuple[int, ...], suffix: tuple[int, ...], out: int) -> w.Request:
    return w.Request(rid, arrival, "test", "p", prefix, suffix, out, out)


def test_cached_prefix_cuts_prefill_and_ttft() -> None:
    prefix = tuple(range(1000, 5000))
    first = _request(0, 0.0, prefix, (1, 2, 3), 10)
    second = _request(1, 5.0, prefix, (4, 5, 6), 10)
    cluster = Cluster(Prepared.of([first, second], COSTS.block_size), NoForwarding(), COSTS, 1)
    jobs = sorted(cluster.run().jobs, key=lambda j: j.request.id)
    assert jobs[0].cached == 0
    assert jobs[1].cached == len(prefix)
    assert cluster.nodes[0].prefill_tokens == first.prompt_len + 3
    ttft = [j.first_token - j.arrival for j in jobs]
    assert ttft[1] < ttft[0] / 10


def test_an_arrival_joins_a_running_decode_at_the_next_iteration() -> None:
    long = _request(0, 0.0, tuple(range(100)), (1,), 1000)
    short = _request(1, 3.0, tuple(range(200, 300)), (2,), 5)
    jobs = sorted(Cluster(Prepared.of([long, short], COSTS.block_size), NoForwarding(), COSTS, 1).run().jobs,
                  key=lambda j: j.request.id)
    assert jobs[1].first_token - jobs[1].arrival < 0.1
    assert jobs[1].finish < jobs[0].finish


def test_eviction_keeps_prefixes_whole_and_within_capacity() -> None:
    cache = PrefixCache(capacity_blocks=10, block_size=4)
    a, b = block_hashes(range(24), 4), block_hashes(range(100, 124), 4)
    req = _request(0, 0.0, tuple(range(24)), (), 1)
    assert cache.admit(a, 0, 7)
    cache.store(req, a, 0)
    cache.release(a, 1)
    assert len(cache) == 6 and cache.match(a) == 6
    assert cache.admit(b, 0, 7)
    assert len(cache) + cache.reserved <= cache.capacity
    assert cache.match(a) == 3  # the leaves went first: what is left is a prefix
    assert not cache.admit(a, cache.match(a), 11)


def test_centralized_hits_at_least_round_robin(tooluse: Prepared) -> None:
    rr = summarize(Cluster(tooluse, NoForwarding(), COSTS, 4).run())
    central = summarize(Cluster(tooluse, Centralized(), COSTS, 4).run())
    assert central.hit_rate >= rr.hit_rate
    assert central.hit_rate > 0.3


def test_overlay_forwards_from_its_stale_view(tooluse: Prepared) -> None:
    rr = summarize(Cluster(tooluse, NoForwarding(), COSTS, 4).run())
    policy = Overlay(balance=True)
    ps = summarize(Cluster(tooluse, policy, COSTS, 4).run())
    assert ps.forwarded > 0.2
    assert ps.hit_rate > rr.hit_rate
    assert ps.extra["deltas"] > 0 and ps.extra["snapshots"] > 0


@pytest.mark.parametrize("make", [lambda: Overlay(balance=True, seed=3), Centralized], ids=["overlay", "central"])
def test_deterministic_per_seed(small: Prepared, make) -> None:
    runs = [replace(summarize(Cluster(small, make(), COSTS, 3).run()), wall_s=0.0) for _ in range(2)]
    assert runs[0] == runs[1]
