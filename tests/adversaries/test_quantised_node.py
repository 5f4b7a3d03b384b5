"""A node serving a quantised copy of its model: its answers are nearly the model's, scoring close to 1
each epoch, but a token here and there is not the honest choice under its seed (bench/detection.py
measures 1-2 % of gt-int4's tokens). One epoch's C(T) cannot tell it from an honest node; the ledger's
evidence across epochs (registry/evidence.py) does, and flags it while an honest node is never touched."""

from __future__ import annotations

import pytest
from committee import EPOCH_PARAMS, HONEST, Script, honest_epoch, listed
from harness import AppHarness, sqlite_url

from planetserve.registry import evidence
from planetserve.registry.params import Params

CLOSE = 950_000
"""A quantised copy's answer with one deviating token just beyond the tolerance: C(T) far above τ."""
TOKENS = 3
"""Tokens of every scripted answer (committee.Script.answer)."""


def test_a_node_deviating_on_a_few_tokens_is_flagged_by_its_evidence_and_an_honest_one_never(tmp_path):
    s = Script(AppHarness(sqlite_url(tmp_path), members=4, params=EPOCH_PARAMS))
    quantised, honest = list(s.nodes)
    rule = evidence.EvidenceRule.from_params(EPOCH_PARAMS)
    s.run_election_and_plan(1)
    cusum, flagged_at = 0, None
    for number in range(1, 8):
        honest_epoch(s, number, {quantised: CLOSE, honest: HONEST}, deviations={quantised: 1})
        cusum = evidence.accumulate(rule, cusum, TOKENS, 1)
        record = s.state.reputation(quantised)
        assert (record.checked, record.deviations, record.cusum) == (TOKENS * number, number, cusum)
        if evidence.flagged(rule, cusum):
            flagged_at = flagged_at or number
            assert record.window[-1] == 0  # flagged: C(T) 0 whatever the epoch's answers scored
        else:
            assert record.window[-1] == CLOSE and record.trusted
        clean = s.state.reputation(honest)
        assert (clean.checked, clean.deviations, clean.cusum) == (TOKENS * number, 0, 0) and clean.trusted
        assert clean.window[-1] == HONEST
    # four deviations close together reach the default threshold; two flagged epochs take it untrusted
    assert flagged_at == 5
    assert not s.state.reputation(quantised).trusted and listed(s) == [honest]
    assert all(s.faults(m) == [] for m in s.members)


def test_the_evidence_statistic_in_integers():
    rule = evidence.EvidenceRule.from_params(Params())
    assert (rule.deviation_weight, rule.token_weight, rule.threshold) == (2_303, 9, 9_210)
    assert evidence.accumulate(rule, 0, 100, 0) == 0  # never below 0
    assert evidence.accumulate(rule, 5_000, 100, 0) == 5_000 - 900
    assert evidence.accumulate(rule, 0, 30, 2) == 2 * 2_303 - 28 * 9
    assert not evidence.flagged(rule, 9_209) and evidence.flagged(rule, 9_210)
    # an honest engine's rare deviation (0.1 % of tokens) drains away; a 1 % rate accumulates
    honest = 0
    for _ in range(40):
        honest = evidence.accumulate(rule, honest, 1_000, 1)
    assert honest == 0
    quantised, rounds = 0, 0
    while not evidence.flagged(rule, quantised):
        quantised, rounds = evidence.accumulate(rule, quantised, 100, 1), rounds + 1
    assert rounds == 7
    for checked, deviations in ((3, 4), (3, -1)):
        with pytest.raises(ValueError, match="deviations among"):
            evidence.accumulate(rule, 0, checked, deviations)
