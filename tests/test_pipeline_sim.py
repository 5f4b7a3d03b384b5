"""bench/pipeline_sim.py (issue 7, benchmark 2): the discrete-event simulator's invariants and the
cases whose answer is known in closed form."""

from __future__ import annotations

import math

import pytest

from bench import pipeline_sim as ps

BF16 = ps.QWEN3_32B["bf16"]
SHORT = ps.Trace("short", prompt_mean=80.0, output_mean=24.0)
"""Short outputs keep every run here to a fraction of a second."""
CLUSTERS = {
    "paper": ps.paper_cluster(BF16),
    "16x2": ps.drawn_cluster(16, 2, BF16, seed=0),
}


def run(cluster: ps.Cluster, scheme: str, arrivals: list[ps.Arrival]) -> ps.Simulation:
    return ps.simulate(cluster, scheme, arrivals)


def alone(cluster: ps.Cluster, req: ps.Request) -> tuple[float, float]:
    """TTFT and latency of the request's route with nothing else running: each hop's compute for the
    pass's tokens, plus the links around the cycle (hop to hop, then last back to first), every pass."""
    hops = req.route
    cycle = sum(cluster.link_s(a.node, b.node) for a, b in zip(hops, hops[1:] + hops[:1], strict=True))

    def compute(tokens: int) -> float:
        return sum((h.end - h.start) * (cluster.nodes[h.node].weight_s + tokens * cluster.nodes[h.node].token_s)
                   for h in hops)

    ttft = compute(req.prompt) + cycle
    return ttft, ttft + (req.output - 1) * (compute(1) + cycle)


@pytest.fixture(scope="module", params=sorted(CLUSTERS))
def runs(request: pytest.FixtureRequest) -> dict[str, ps.Simulation]:
    cluster = CLUSTERS[request.param]
    arrivals = ps.workload(SHORT, rate=6.0, count=90, seed=1)
    return {scheme: run(cluster, scheme, arrivals) for scheme in ps.SCHEMES}


@pytest.mark.parametrize("scheme", sorted(ps.SCHEMES))
def test_every_request_finishes_and_frees_its_kv(runs: dict[str, ps.Simulation], scheme: str) -> None:
    sim = runs[scheme]
    assert sim.open == 0
    for req in sim.requests:
        assert req.generated == req.output
        assert math.isfinite(req.finish) and req.arrival < req.first_token <= req.finish
    assert all(g.kv_free == g.kv_slots and not g.queue and not g.waiting and not g.busy for g in sim.gpus)
    board = getattr(sim.router, "board", None)
    assert board is None or not any(board.demand)


@pytest.mark.parametrize("scheme", sorted(ps.SCHEMES))
def test_every_token_crosses_every_layer_once(runs: dict[str, ps.Simulation], scheme: str) -> None:
    sim = runs[scheme]
    layers = sim.cluster.model.layers
    for req in sim.requests:
        assert req.layer_visits == layers * req.output
        assert req.route[0].start == 0 and req.route[-1].end == layers
        assert all(a.end == b.start for a, b in zip(req.route, req.route[1:], strict=False))
        for hop in req.route:
            start, end = sim.router.ranges[hop.node]
            assert start <= hop.start < hop.end <= end


@pytest.mark.parametrize("scheme", sorted(ps.SCHEMES))
def test_latency_is_at_least_the_uncontended_service_time(runs: dict[str, ps.Simulation], scheme: str) -> None:
    sim = runs[scheme]
    slack = []
    for req in sim.requests:
        ttft, latency = alone(sim.cluster, req)
        assert req.first_token - req.arrival >= ttft - 1e-9
        assert req.finish - req.arrival >= latency - 1e-9
        slack.append(req.finish - req.arrival - latency)
    assert max(slack) > 0  # 90 requests in 15 s do share GPUs


def test_a_lone_request_takes_exactly_its_service_time() -> None:
    cluster = CLUSTERS["16x2"]
    arrivals = [ps.Arrival(0.5, 300, 40)]
    for scheme in ps.SCHEMES:
        (req,) = run(cluster, scheme, arrivals).requests
        ttft, latency = alone(cluster, req)
        assert req.first_token - req.arrival == pytest.approx(ttft, rel=1e-12)
        assert req.finish - req.arrival == pytest.approx(latency, rel=1e-12)


def one_gpu(kind: ps.GpuKind, model: ps.Model = BF16) -> ps.Cluster:
    return ps.Cluster("one GPU", model, (ps.make_node(0, 0, kind, model),), ps.CROSS_MS[1])


@pytest.mark.parametrize("scheme", sorted(ps.SCHEMES))
def test_single_gpu_holding_every_layer_matches_the_analytic_time(scheme: str) -> None:
    cluster = one_gpu(ps.A100)
    node, layers = cluster.nodes[0], BF16.layers
    assert node.capacity >= layers
    prompt, output = 500, 30
    (req,) = run(cluster, scheme, [ps.Arrival(0.0, prompt, output)]).requests
    prefill = layers * (node.weight_s + prompt * node.token_s)
    decode = layers * (node.weight_s + node.token_s)
    assert req.route == [ps.Hop(0, 0, layers)]
    assert req.first_token == pytest.approx(prefill, rel=1e-12)
    assert req.finish == pytest.approx(prefill + (output - 1) * decode, rel=1e-12)


def test_a_batch_reads_the_weights_once_for_all_its_tokens() -> None:
    """B arrives during A's prefill; A's first decode joins B's prefill, then both decode in lockstep,
    each iteration reading the weights once for two tokens, until B's last token runs alone."""
    cluster = one_gpu(ps.A100)
    node, layers = cluster.nodes[0], BF16.layers
    prompt, output = 200, 12
    a, b = run(cluster, "even", [ps.Arrival(0.0, prompt, output), ps.Arrival(1e-3, prompt, output)]).requests

    def iteration(tokens: int) -> float:
        return layers * (node.weight_s + tokens * node.token_s)

    alone_prefill = iteration(prompt)
    joint = alone_prefill + iteration(prompt + 1)
    assert a.first_token == pytest.approx(alone_prefill, rel=1e-12)
    assert b.first_token == pytest.approx(joint, rel=1e-12)
    assert a.finish == pytest.approx(joint + (output - 2) * iteration(2), rel=1e-12)
    assert b.finish == pytest.approx(joint + (output - 2) * iteration(2) + iteration(1), rel=1e-12)


def test_a_request_whose_kv_does_not_fit_waits_for_the_one_holding_it() -> None:
    model = ps.Model("huge KV", 64, BF16.layer_params, 2, fp8=False, kv_bytes_per_token_layer=4096 * 60)
    cluster = one_gpu(ps.A100, model)
    need = 1000 * 64 * model.kv_bytes_per_token_layer
    room = cluster.kv_room_bytes(0, 64)
    assert need <= room < 2 * need
    first, second = run(cluster, "parallax", [ps.Arrival(0.0, 500, 500)] * 2).requests
    assert second.first_token > first.finish


def test_same_seed_same_result_other_seed_other_workload() -> None:
    cluster = CLUSTERS["paper"]
    arrivals = ps.workload(SHORT, rate=6.0, count=60, seed=3)
    assert arrivals == ps.workload(SHORT, rate=6.0, count=60, seed=3)
    assert arrivals != ps.workload(SHORT, rate=6.0, count=60, seed=4)
    for scheme in ps.SCHEMES:
        a, b = run(cluster, scheme, arrivals), run(cluster, scheme, arrivals)
        assert [(r.route, r.first_token, r.finish) for r in a.requests] == \
            [(r.route, r.first_token, r.finish) for r in b.requests]
        assert ps.summarize(a) == ps.summarize(b)


def test_workload_lengths_are_clipped_and_near_the_trace_means() -> None:
    arrivals = ps.workload(ps.TRACES["sharegpt"], rate=2.0, count=4000, seed=0)
    prompts = [a.prompt for a in arrivals]
    outputs = [a.output for a in arrivals]
    assert min(prompts) >= 4 and max(prompts + outputs) <= ps.MAX_TOKENS
    assert sum(prompts) / len(prompts) == pytest.approx(161.3, rel=0.1)
    assert sum(outputs) / len(outputs) == pytest.approx(338.0, rel=0.1)
    assert (arrivals[-1].time - arrivals[0].time) == pytest.approx(2000, rel=0.1)


def test_even_split_pipelines_fit_memory_and_stay_in_their_region() -> None:
    cluster = ps.drawn_cluster(64, 4, BF16, seed=0)
    pipelines = ps.even_pipelines(cluster)
    for hops in pipelines:
        assert hops[0].start == 0 and hops[-1].end == BF16.layers
        assert len({cluster.nodes[h.node].region for h in hops}) == 1
        sizes = [h.end - h.start for h in hops]
        assert max(sizes) - min(sizes) <= 1
        assert all(h.end - h.start <= cluster.nodes[h.node].capacity for h in hops)


def test_petals_serves_the_worst_covered_layers_first() -> None:
    ranges = ps.petals_ranges(CLUSTERS["paper"])
    assert [ranges[i] for i in range(3)] == [(0, 26), (26, 52), (38, 64)]
    assert all(any(s <= layer < e for s, e in ranges.values()) for layer in range(BF16.layers))


def test_parallax_follows_the_allocation_and_spreads_load_over_its_pipelines(
        runs: dict[str, ps.Simulation]) -> None:
    sim = runs["parallax"]
    plan = sim.router.plan
    assert sim.router.ranges == {int(st.gpu[1:]): (st.start, st.end) for st in plan.stages}
    assert len({req.route[0].node for req in sim.requests}) >= 2
