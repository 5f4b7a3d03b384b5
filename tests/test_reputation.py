"""Reputation rule (seed planetserve.md 3.4): fixed point against the paper's formula in floats."""

from __future__ import annotations

import random
from dataclasses import replace
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from planetserve.registry.params import Params
from planetserve.registry.reputation import (
    PPM,
    ReputationRule,
    is_trusted,
    median,
    organisation_reputation,
    probation_left,
    starting,
    update,
)

RULE = ReputationRule.from_params(Params())
GOOD = 1_000_000
BAD = 100_000


def reference(rule: ReputationRule, previous: float, credibility: float,
              window: list[float]) -> tuple[float, list[float], bool]:
    """The paper's formula in floats: (R(T), window including C(T), whether the punishment applied)."""
    alpha, beta, gamma, tau = (x / 1e6 for x in (rule.alpha, rule.beta, rule.gamma, rule.abnormal))
    w = rule.window
    window = [*window, credibility][-w:]
    c = sum(1 for value in window if value < tau)
    punished = c / w > gamma
    factor = (w + 1) / (w + c / gamma + 2) if punished else beta
    return alpha * previous + factor * credibility, window, punished


def credibility_stream(rng: random.Random, epochs: int) -> list[int]:
    """Good, bad and mixed phases, so windows fill with abnormal values and empty again."""
    phases = {"good": (400_000, PPM), "bad": (0, 399_999), "mixed": (0, PPM)}
    phase = rng.choice(list(phases))
    out = []
    for _ in range(epochs):
        if rng.random() < 0.2:
            phase = rng.choice(list(phases))
        out.append(rng.randint(*phases[phase]))
    return out


@pytest.mark.parametrize("rule", [
    RULE,
    replace(RULE, window=3, gamma=300_000),
    replace(RULE, window=10, gamma=150_000, abnormal=500_000),
    replace(RULE, alpha=300_000, beta=700_000, window=7, gamma=100_000),
])
def test_fixed_point_follows_the_float_formula_within_one_ppm(rule):
    rng = random.Random(20240531)
    punished_steps = steps = 0
    for _ in range(2_000):
        exact, window = rng.choice([rule.initial, rng.randint(0, PPM)]), ()
        ref, ref_window = exact / 1e6, []
        for c in credibility_stream(rng, 30):
            exact, window = update(rule, exact, c, window)
            ref, ref_window, punished = reference(rule, ref, c / 1e6, ref_window)
            assert abs(exact - ref * 1e6) <= 1, (exact, ref, window)
            assert window == tuple(round(v * 1e6) for v in ref_window)
            punished_steps += punished
            steps += 1
    assert steps == 60_000
    assert punished_steps > steps // 3, punished_steps  # the punished branch is exercised, not skipped


def test_unpunished_epoch_is_alpha_r_plus_beta_c():
    assert update(RULE, 500_000, 1_000_000, ()) == (800_000, (1_000_000,))


def test_single_rounding_is_half_up():
    halves = replace(RULE, alpha=500_000, beta=500_000)
    assert update(halves, 1, 0, ())[0] == 1  # 0.5 ppm rounds up
    assert update(halves, 3, 0, ())[0] == 2  # 1.5 ppm rounds up


def test_one_abnormal_value_alone_is_not_punished():
    # c = 1: 1/5 is not > 1/5, so β applies: 0.4·0.5 + 0.6·0.1 = 0.26.
    assert update(RULE, 500_000, BAD, (GOOD,) * 4) == (260_000, (GOOD, GOOD, GOOD, GOOD, BAD))
    # The window includes C(T): a lone abnormal value among four good ones stays unpunished.
    assert update(RULE, 500_000, GOOD, (GOOD, GOOD, BAD, GOOD))[0] == 800_000


def test_two_abnormal_values_are_punished_with_factor_six_seventeenths():
    # W = 5, γ = 1/5, c = 2: (W+1)/(W + c/γ + 2) = 6/17.
    reputation, window = update(RULE, 500_000, BAD, (GOOD, GOOD, GOOD, BAD))
    assert window == (GOOD, GOOD, GOOD, BAD, BAD)
    assert reputation == round((Fraction(2, 5) * Fraction(1, 2) + Fraction(6, 17) * Fraction(1, 10)) * PPM)
    assert reputation == 235_294
    # The current C is good but two abnormal values are still in the window: 0.2 + 6/17 = 0.552941...
    assert update(RULE, 500_000, GOOD, (GOOD, BAD, BAD, GOOD))[0] == 552_941


def test_oldest_value_leaves_the_window():
    _, window = update(RULE, 500_000, 7, (1, 2, 3, 4, 5))
    assert window == (2, 3, 4, 5, 7)


def dishonest_steady_state() -> tuple[int, tuple[int, ...]]:
    reputation, window = RULE.initial, ()
    for _ in range(40):
        reputation, window = update(RULE, reputation, BAD, window)
    return reputation, window


def test_dishonest_node_converges_to_a_low_fixed_point():
    # c = 5: factor 6/32, so R* = (6/32·0.1)/(1 - 0.4) = 0.03125 exactly.
    assert dishonest_steady_state() == (31_250, (BAD,) * 5)


@pytest.mark.parametrize(("good", "epochs", "abnormal_left"), [
    (700_000, 4, 1),    # trusted only once the punishment stops (c = 1 is no longer > γ·W)
    (1_000_000, 3, 2),  # a perfect C outweighs the 6/17 punishment one epoch earlier
])
def test_untrusted_node_recovers_under_consistent_good_credibility(good, epochs, abnormal_left):
    reputation, window = dishonest_steady_state()
    trusted_after = None
    for epoch in range(1, 10):
        reputation, window = update(RULE, reputation, good, window)
        if is_trusted(RULE, reputation):
            trusted_after = epoch
            break
    assert trusted_after == epochs
    assert sum(1 for value in window if value < RULE.abnormal) == abnormal_left


def test_dishonest_node_becomes_untrusted_and_stays_so():
    rng = random.Random(7)
    reputation, window = RULE.initial, ()
    history = []
    for _ in range(50):
        reputation, window = update(RULE, reputation, rng.randint(50_000, 150_000), window)
        history.append(reputation)
    assert not is_trusted(RULE, history[0])  # 0.4·0.5 + 0.6·~0.1 ≈ 0.26 after the first epoch
    assert all(not is_trusted(RULE, r) for r in history)
    assert max(history[5:]) < 100_000


def test_honest_node_stays_trusted():
    rng = random.Random(8)
    reputation, window = RULE.initial, ()
    for _ in range(200):
        reputation, window = update(RULE, reputation, rng.randint(750_000, 850_000), window)
        assert is_trusted(RULE, reputation)
    assert 700_000 <= reputation <= 900_000


def test_threshold_is_inclusive():
    assert is_trusted(RULE, 400_000)
    assert not is_trusted(RULE, 399_999)


ppm = st.integers(min_value=0, max_value=PPM)
windows = st.lists(ppm, max_size=RULE.window).map(tuple)


@given(previous=ppm, credibility=ppm, window=windows)
def test_result_is_in_range_and_window_is_the_last_w(previous, credibility, window):
    reputation, new_window = update(RULE, previous, credibility, window)
    assert 0 <= reputation <= PPM
    assert new_window == (*window, credibility)[-RULE.window:]


@given(previous=ppm, credibility=ppm, window=windows, more=st.integers(min_value=0, max_value=PPM))
def test_reputation_is_monotone_in_previous_and_credibility(previous, credibility, window, more):
    base = update(RULE, previous, credibility, window)[0]
    assert update(RULE, min(PPM, previous + more), credibility, window)[0] >= base
    assert update(RULE, previous, min(PPM, credibility + more), window)[0] >= base


def test_clamped_when_alpha_plus_beta_exceeds_one():
    generous = replace(RULE, alpha=PPM, beta=PPM)
    assert update(generous, PPM, PPM, ())[0] == PPM


@pytest.mark.parametrize(("previous", "credibility", "window", "message"), [
    (500_000, -1, (), "credibility"),
    (500_000, PPM + 1, (), "credibility"),
    (500_000, True, (), "credibility"),
    (500_000, 0.5, (), "credibility"),
    (-1, 500_000, (), "previous reputation"),
    (PPM + 1, 500_000, (), "previous reputation"),
    (500_000, 500_000, (PPM + 1,), "window credibility"),
])
def test_invalid_update_inputs_are_refused(previous, credibility, window, message):
    with pytest.raises(ValueError, match=message):
        update(RULE, previous, credibility, window)


@pytest.mark.parametrize(("change", "message"), [
    ({"window": 0}, "window"),
    ({"gamma": 0}, "gamma"),
    ({"alpha": PPM + 1}, "alpha"),
    ({"abnormal": -1}, "abnormal"),
    ({"probation": -1}, "probation"),
])
def test_invalid_rules_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        replace(RULE, **change)


def test_rule_from_params():
    rule = ReputationRule.from_params(Params())
    assert rule == ReputationRule(alpha=400_000, beta=600_000, window=5, gamma=200_000, abnormal=400_000,
                                  untrusted=400_000, initial=500_000, probation=3)


def test_median():
    assert median([3, 1, 2]) == 2
    assert median([4, 1, 2, 3]) == 2  # floor of (2 + 3) / 2
    assert median([10, 20]) == 15
    assert median([7]) == 7
    with pytest.raises(ValueError, match="no values"):
        median([])


def test_organisation_reputation_is_the_minimum_of_its_nodes():
    assert organisation_reputation([800_000, 150_000, 900_000]) == 150_000
    assert organisation_reputation(iter([600_000])) == 600_000
    assert organisation_reputation([]) == 0


def test_a_new_key_starts_at_most_at_its_organisations_reputation():
    assert starting(RULE, []) == RULE.initial  # an organisation's first key
    assert starting(RULE, [900_000, 700_000]) == RULE.initial  # a good record does not raise it
    assert starting(RULE, [900_000, 120_000]) == 120_000  # one punished node marks every new key


def test_probation_passes_only_on_consecutive_trusted_epochs():
    left = RULE.probation
    assert left == 3
    left = probation_left(RULE, left, trusted=True)
    left = probation_left(RULE, left, trusted=True)
    assert left == 1
    assert probation_left(RULE, left, trusted=False) == 3  # an untrusted epoch starts it over
    assert probation_left(RULE, left, trusted=True) == 0
    assert probation_left(RULE, 0, trusted=False) == 0  # once passed, reputation alone decides
