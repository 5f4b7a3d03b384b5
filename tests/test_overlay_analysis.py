"""The overlay analyses of bench/anonymity.py and bench/churn.py: A4's formula against its closed
forms and a simulation, A5's entropy at its limits and as f grows, confidentiality without attackers,
and the churn simulation against its exact survival curve. Small sizes, fixed seeds."""

from __future__ import annotations

import math

import pytest

from bench.anonymity import (
    CONFIDENTIALITY_SYSTEMS,
    ENTROPY_SYSTEMS,
    a5_entropy,
    binomial_tail,
    chain_predecessors,
    recovery_closed_form,
    simulate,
)
from bench.churn import (
    a4_simulated,
    a4_success,
    crossover_minutes,
    rate_for,
    simulate_churn,
    survival_closed_form,
)


@pytest.mark.parametrize("f", [0.0, 0.01, 0.03, 0.1, 0.5])
def test_a4_equals_closed_forms(f: float) -> None:
    s = (1 - f) ** 3
    assert a4_success(f, 1, 1) == pytest.approx(s)
    assert a4_success(f, 4, 4) == pytest.approx((1 - f) ** 12)
    assert a4_success(f, 4, 3) == pytest.approx(4 * s**3 * (1 - s) + s**4)
    assert a4_success(f, 4, 1) == pytest.approx(1 - (1 - s) ** 4)
    assert a4_success(f, 4, 0) == pytest.approx(1.0)


def test_a4_paper_claim_at_three_percent() -> None:
    assert a4_success(0.03, 4, 3) > 0.95


@pytest.mark.parametrize(("f", "n", "k"), [(0.03, 4, 3), (0.1, 4, 3), (0.05, 1, 1)])
def test_a4_simulation_agrees(f: float, n: int, k: int) -> None:
    simulated = a4_simulated(f, n, k, nodes=400, sources=100, draws=100, seed=1)
    assert simulated == pytest.approx(a4_success(f, n, k), abs=0.02)


def test_chain_predecessors() -> None:
    flags = bytearray(10)
    assert chain_predecessors(0, (1, 2, 3), flags) == set()
    flags[1] = flags[3] = 1
    assert chain_predecessors(0, (1, 2, 3), flags) == {0, 2}
    flags[2] = 1
    assert chain_predecessors(0, (1, 2, 3), flags) == {0}
    flags[1] = 0
    assert chain_predecessors(0, (1, 2, 3), flags) == {1}


def test_a5_entropy_formula() -> None:
    users = 1000
    assert a5_entropy(0, 3, 0.0, users, users) == pytest.approx(1.0)
    assert a5_entropy(0, 3, 0.1, users, 900) == pytest.approx(math.log2(900) / math.log2(users))
    weight = 1 / (3 + 1 - 0.1 * 3)
    rest = 1 - weight
    bits = -weight * math.log2(weight) - rest * math.log2(rest / 899)
    assert a5_entropy(1, 3, 0.1, users, 900) == pytest.approx(bits / math.log2(users))
    assert a5_entropy(5, 3, 0.5, users, 500) == pytest.approx(math.log2(5) / math.log2(users))


def test_no_attackers_means_full_anonymity_and_confidentiality() -> None:
    result = simulate(0.0, users=300, trials=30, seed=2)
    assert all(result.entropy[name] == pytest.approx(1.0) for name in ENTROPY_SYSTEMS)
    assert all(result.confidentiality[name] == 1.0 for name in CONFIDENTIALITY_SYSTEMS)


def test_entropy_decreases_as_attackers_grow() -> None:
    results = [simulate(f, users=2000, trials=300, seed=3) for f in (0.01, 0.1, 0.3)]
    for name in ENTROPY_SYSTEMS:
        values = [r.entropy[name] for r in results]
        assert values[0] < 1.0
        assert values == sorted(values, reverse=True), name
    assert results[1].entropy["gc"] < results[1].entropy["planetserve"]


def test_confidentiality_matches_closed_form() -> None:
    result = simulate(0.2, users=2000, trials=1000, seed=4)
    exact = 1 - recovery_closed_form(0.2, 4, 3, 3)
    assert result.confidentiality["planetserve brute force"] == pytest.approx(exact, abs=0.06)
    assert result.confidentiality["planetserve no brute force"] == 1.0
    assert result.confidentiality["gc"] <= result.confidentiality["gc lone relay"]


def test_binomial_tail_sums_to_one() -> None:
    assert binomial_tail(4, 0, 0.3) == pytest.approx(1.0)
    assert binomial_tail(4, 3, 0.3) + binomial_tail(4, 2, 0.7) == pytest.approx(1.0)


def test_churn_survival_follows_closed_form() -> None:
    nodes, rate = 300, 20.0
    result = simulate_churn(nodes=nodes, rate=rate, minutes=5, sources=100, networks=3, interval_s=30, seed=5)
    for name, (n, k) in {"planetserve": (4, 3), "onion": (1, 1)}.items():
        curve = result.survival[name]
        assert curve[0] == 1.0
        assert curve == sorted(curve, reverse=True)
        assert curve[2] == pytest.approx(survival_closed_form(2, n, k, 3, rate, nodes), abs=0.08)
    for name, delivery in result.delivery.items():
        assert delivery["rebuilt"] >= delivery["built once"], name


def test_crossover_and_required_rate() -> None:
    s = (1 + math.sqrt(13)) / 6
    assert crossover_minutes(4, 3, 200, 3119) == pytest.approx(-math.log(s) / 3 * 3119 / 200, rel=1e-6)
    assert crossover_minutes(4, 1, 200, 3119) == math.inf
    rate = rate_for(0.8, 15, 4, 3, 3119)
    assert survival_closed_form(15, 4, 3, 3, rate, 3119) == pytest.approx(0.8, abs=1e-6)
