"""The share at which members re-challenge nodes, raised until a node silent on all but the leader's
challenge is reported by members holding more than a third of the power (verifier/coverage.py)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planetserve.verifier.config import RECHALLENGE_SHARE
from planetserve.verifier.coverage import SILENT_ESCAPE, counted_on, rechallenge_share, reported


def exact(powers: list[int], share: float) -> float:
    """The same probability by enumerating who re-challenges, with the powers as they are."""
    total, counted = sum(powers), counted_on(powers)
    chance = 0.0
    for drawn in itertools.product((False, True), repeat=len(counted)):
        held = sum(p for p, d in zip(counted, drawn, strict=True) if d)
        if 3 * held > total:
            chance += share ** sum(drawn) * (1 - share) ** (len(drawn) - sum(drawn))
    return chance


def test_four_members_re_challenge_every_node_where_two_thirds_left_a_silent_node_unreported():
    four = [10] * 4
    # the leader and a colluding member cannot be counted on: the other two must both report
    assert counted_on(four) == [10, 10]
    assert reported(four, RECHALLENGE_SHARE) == pytest.approx(RECHALLENGE_SHARE ** 2)  # 55% escaped
    assert rechallenge_share(four, RECHALLENGE_SHARE, SILENT_ESCAPE) == 1.0
    assert reported(four, 1.0) == 1.0


def test_a_large_committee_keeps_the_configured_share():
    assert rechallenge_share([10] * 100, RECHALLENGE_SHARE, SILENT_ESCAPE) == RECHALLENGE_SHARE
    assert rechallenge_share([10] * 100, 0.9, SILENT_ESCAPE) == 0.9  # never lowered


@pytest.mark.parametrize("members", [2, 3, 5, 7, 10, 13, 20, 30, 50])
def test_the_share_is_the_least_that_meets_the_escape(members):
    powers = [10] * members
    share = rechallenge_share(powers, RECHALLENGE_SHARE, SILENT_ESCAPE)
    assert RECHALLENGE_SHARE <= share <= 1.0
    assert share == 1.0 or reported(powers, share) >= 1 - SILENT_ESCAPE
    if share > RECHALLENGE_SHARE:
        assert reported(powers, round(share - 0.01, 2)) < 1 - SILENT_ESCAPE


def test_escape_one_keeps_the_configured_share():
    assert rechallenge_share([10] * 4, RECHALLENGE_SHARE, escape=1.0) == RECHALLENGE_SHARE


def test_unequal_powers_count_on_what_a_leader_and_a_colluding_third_leave():
    # the largest may lead; the next, 30 of 100, may collude; 20 and 20 must both report (40 > 33)
    assert counted_on([30, 20, 30, 20]) == [20, 20]
    assert rechallenge_share([30, 20, 30, 20], RECHALLENGE_SHARE, SILENT_ESCAPE) == 1.0
    # a member holding more than two thirds leaves a third at most, which may all collude
    assert counted_on([70, 10, 10, 10]) == [] and reported([70, 10, 10, 10], 1.0) == 0.0
    assert rechallenge_share([70, 10, 10, 10], RECHALLENGE_SHARE, SILENT_ESCAPE) == 1.0
    assert rechallenge_share([], RECHALLENGE_SHARE, SILENT_ESCAPE) == 1.0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 10**6), min_size=1, max_size=9), st.floats(0.0, 1.0))
def test_the_reckoning_never_overstates_the_chance_of_a_report(powers, share):
    assert reported(powers, share) <= exact(powers, share) + 1e-9


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 12), st.floats(0.0, 1.0))
def test_the_reckoning_is_exact_for_equal_powers(members, share):
    powers = [7] * members
    assert reported(powers, share) == pytest.approx(exact(powers, share))
