"""The detection experiment's pure parts (bench/detection.py) and a three-prompt run on the quick family."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench import detection
from planetserve.registry.evidence import EvidenceRule, accumulate, flagged
from planetserve.registry.finalization import product
from planetserve.registry.params import PPM, Params
from planetserve.registry.reputation import ReputationRule, update
from planetserve.verifier import to_ppm


def test_auc_matches_a_hand_count() -> None:
    assert detection.auc([3, 4], [1, 2]) == 1.0
    assert detection.auc([1, 2], [3, 4]) == 0.0
    assert detection.auc([0.2, 0.5, 0.9], [0.2, 0.5, 0.9]) == 0.5
    # 0.9 beats 3; 0.8 beats 2 and ties 1; 0.7 beats 2; 0.4 beats 1: 8.5 of 12 pairs.
    assert detection.auc([0.9, 0.8, 0.7, 0.4], [0.5, 0.3, 0.8]) == pytest.approx(8.5 / 12)
    with pytest.raises(ValueError, match="AUC needs scores on both sides"):
        detection.auc([], [1.0])


def test_clickbait_rewrite_is_deterministic_and_keeps_the_question() -> None:
    questions = detection.challenge_prompts(8)
    assert len(set(questions)) == 8 and all(q.endswith("?") for q in questions)
    rewrites = [detection.clickbait(q) for q in questions]
    assert rewrites == [detection.clickbait(q) for q in questions]
    for question, rewrite in zip(questions, rewrites, strict=True):
        assert question in rewrite and rewrite != question and "!!!" in rewrite
    assert detection.challenge_prompts(8) == questions


def test_injection_goes_before_the_stop_token() -> None:
    answer, continuation, stops = [10, 11, 4], [7, 8, 9], (1, 4)
    assert detection.inject(answer, continuation, stops) == [10, 11, 7, 8, 9, 4]
    assert detection.inject([10, 11], continuation, stops) == [10, 11, 7, 8, 9]
    assert answer == [10, 11, 4]
    assert detection.inject(answer, continuation, stops) == detection.inject(answer, continuation, stops)


def test_trajectory_is_the_ledgers_update_step_by_step() -> None:
    rule = ReputationRule.from_params(Params(reputation_gamma_ppm=PPM // 5))
    credibilities = [950_000, 100_000, 390_000, 400_000, 0, 1_000_000, 50_000, 700_000, 10_000]
    reputation, window, expected = rule.initial, (), [rule.initial]
    for c in credibilities:
        reputation, window = update(rule, reputation, c, window)
        expected.append(reputation)
    assert detection.trajectory(rule, credibilities) == expected
    assert detection.first_untrusted(rule, expected) == next(
        t for t, r in enumerate(expected) if r < rule.untrusted)
    assert detection.first_untrusted(rule, detection.trajectory(rule, [PPM] * 5)) is None


def test_epoch_credibility_is_the_ledgers_product_of_seeded_draws_and_the_evidence_flags() -> None:
    picks = detection.draws(10, 35, 3, seed=4, label="small/sampled")
    assert picks.shape == (35, 3)
    assert np.array_equal(picks, detection.draws(10, 35, 3, seed=4, label="small/sampled"))
    assert not np.array_equal(picks, detection.draws(10, 35, 3, seed=5, label="small/sampled"))
    ppm = [PPM - i * 9_000 for i in range(10)]
    answers = detection.Answers(ppm, [30] * 10, [1 if i == 9 else 0 for i in range(10)])
    assert detection.epoch_credibilities(answers, picks) == [product([ppm[i] for i in row]) for row in picks]
    rule = EvidenceRule.from_params(Params())
    cusum, expected = 0, []
    for row in picks:
        cusum = accumulate(rule, cusum, 90, sum(answers.deviations[i] for i in row))
        expected.append(0 if flagged(rule, cusum) else product([ppm[i] for i in row]))
    assert detection.epoch_credibilities(answers, picks, rule) == expected and 0 in expected


def test_simulation_replays_each_seed_through_the_ledger_rule() -> None:
    pool = detection.Pool((0.2, 0.3, 0.9), (0.5, 1.0, 0.1), (5, 6, 7), (0, 0, 0))
    outcome = detection.simulate({("x", "sampled"): pool}, "calibrated", PPM // 3, seeds=3, challenges=3,
                                 epochs=6)[("x", "sampled")]
    rule = ReputationRule.from_params(Params(reputation_gamma_ppm=PPM // 3))
    answers = detection.Answers([500_000, PPM, 100_000], (5, 6, 7), (0, 0, 0))
    for seed in range(3):
        picks = detection.draws(3, 6, 3, seed, "x/sampled")
        expected = detection.trajectory(rule, detection.epoch_credibilities(answers, picks,
                                                                            EvidenceRule.from_params(Params())))
        assert outcome.trajectories[seed].tolist() == [r / PPM for r in expected]
        assert outcome.flagged_at[seed] == detection.first_untrusted(rule, expected)


def test_mix_draws_follow_the_workloads_temperatures_and_nuclei() -> None:
    assert {detection.SAMPLING[d][0] for d in detection.DECODINGS} == set(detection.TEMPERATURES)
    assert {detection.SAMPLING[d][1] for d in detection.DECODINGS} == set(detection.TOP_PS)
    assert detection.MIX_WEIGHTS == {"greedy": 8, "warm": 3, "warm-p0.9": 1, "sampled": 3, "sampled-p0.9": 1}
    decodings, picks = detection.mix_draws(10, 35, 300, seed=2, label="small/mix")
    assert decodings.shape == picks.shape == (35, 300) and picks.max() < 10
    again = detection.mix_draws(10, 35, 300, seed=2, label="small/mix")
    assert np.array_equal(decodings, again[0]) and np.array_equal(picks, again[1])
    assert not np.array_equal(decodings, detection.mix_draws(10, 35, 300, seed=3, label="small/mix")[0])
    weights = np.array([detection.MIX_WEIGHTS[d] for d in detection.DECODINGS]) / sum(
        detection.MIX_WEIGHTS.values())
    shares = np.bincount(decodings.ravel(), minlength=len(detection.DECODINGS)) / decodings.size
    assert np.allclose(shares, weights, atol=0.02)


def test_a_mix_node_answers_each_challenge_from_its_decodings_pool() -> None:
    pools = {("x", d): detection.Pool((0.1,) * 4, tuple(k / 10 + i / 100 for i in range(4)), (5,) * 4, (0,) * 4)
             for k, d in enumerate(detection.DECODINGS)}
    outcomes = detection.simulate(pools, "calibrated", PPM // 5, seeds=2, challenges=3, epochs=6)
    assert list(outcomes) == [("x", detection.MIX), *pools]
    rule = ReputationRule.from_params(Params(reputation_gamma_ppm=PPM // 5))
    for seed in range(2):
        decodings, picks = detection.mix_draws(4, 6, 3, seed, "x/mix")
        credibilities = [product([to_ppm(pools["x", detection.DECODINGS[d]].calibrated[i])
                                  for d, i in zip(row_d, row_i, strict=True)])
                         for row_d, row_i in zip(decodings, picks, strict=True)]
        expected = detection.trajectory(rule, credibilities)
        assert outcomes["x", detection.MIX].trajectories[seed].tolist() == [r / PPM for r in expected]
    assert ("y", detection.MIX) not in detection.simulate({("y", "sampled"): pools["x", "sampled"]},
                                                         "calibrated", PPM // 5, seeds=1, challenges=1)


def test_three_prompts_score_every_variant(quick_family: Path) -> None:
    questions, pools = detection.build_pools(str(quick_family), 3)
    assert len(questions) == 3
    variants = (*detection.VARIANTS, detection.NONGREEDY)
    assert set(pools) == {(v, d) for v in variants for d in detection.DECODINGS}
    for pool in pools.values():
        for definition in detection.DEFINITIONS:
            values = pool.values(definition)
            assert len(values) == 3 and all(0 <= v <= 1 for v in values)
    for decoding in detection.DECODINGS:
        honest, injected = pools["gt", decoding].tokens, pools["gt_ic", decoding].tokens
        assert all(i > h for h, i in zip(honest, injected, strict=True))
        # honest answers, from transformers or from the batched serving engine, are the honest choice
        for source in ("gt", detection.ENGINE):
            assert pools[source, decoding].calibrated == (1.0,) * 3 and pools[source, decoding].deviations == (0,) * 3
        assert sum(pools["gt_ic", decoding].deviations) > 0
