"""Challenge prompts: drawn like users' prompts, never repeated, even across restarts."""

from __future__ import annotations

import statistics

import pytest

from planetserve import workloads
from planetserve.chain import challenge
from planetserve.node.api.openai import ApiLimits
from planetserve.node.engine.wire import MAX_TOKEN_ID
from planetserve.verifier.challenges import ChallengeError, ChallengeSource, prompt_digest

SCALE = 0.05


def test_challenges_have_the_form_and_length_of_user_prompts():
    challenges = ChallengeSource("coding", scale=SCALE).draw(40)
    users = workloads.generate("coding", rate=1.0, count=40, seed=3, scale=SCALE)
    assert {c.workload for c in challenges} == {"coding"}
    assert all(c.text.rstrip().endswith("?") for c in challenges)
    assert all(u.text.rstrip().endswith("?") for u in users)
    challenge_len = statistics.mean(len(workloads.tokenize(c.text)) for c in challenges)
    user_len = statistics.mean(u.prompt_len for u in users)
    assert 0.5 < challenge_len / user_len < 2.0
    assert {c.max_tokens for c in challenges} == {u.max_tokens for u in users}


def test_challenges_are_never_repeated_within_a_source_or_across_restarts(tmp_path):
    used = tmp_path / "verifier" / "used_challenges"
    first = ChallengeSource("tooluse", scale=SCALE, used_file=used)
    drawn = [c.text for c in first.draw(15) + first.draw(15)]
    assert len(set(drawn)) == 30
    assert len(used.read_text().split()) == 30
    restarted = ChallengeSource("tooluse", scale=SCALE, used_file=used)
    again = restarted.draw(15)
    assert not {prompt_digest(c.text) for c in again} & {prompt_digest(t) for t in drawn}
    assert len(used.read_text().split()) == 45


def test_prompt_length_limits_are_kept_and_impossible_ones_refused():
    short = ChallengeSource("mixed", scale=SCALE, max_prompt_len=200).draw(10)
    assert all(len(workloads.tokenize(c.text)) <= 200 for c in short)
    with pytest.raises(ChallengeError, match="fresh challenges"):
        ChallengeSource("longdoc", scale=1.0, max_prompt_len=5).draw(1)
    # lengths as the served model's tokenizer counts them (here: characters) when it is given
    by_chars = ChallengeSource("mixed", scale=SCALE, max_prompt_len=400, length=len).draw(10)
    assert all(len(c.text) <= 400 for c in by_chars)
    with pytest.raises(ValueError, match="unknown workload"):
        ChallengeSource("poetry")


def test_challenges_are_sent_and_sampled_like_user_requests():
    """By default in the workload's own mix; a network whose users differ sets its own shares."""
    drawn = ChallengeSource("mixed", scale=SCALE).draw(200)
    assert {c.temperature for c in drawn} == set(workloads.TEMPERATURES)
    assert 0.3 < sum(c.temperature == 0 for c in drawn) / len(drawn) < 0.7
    assert 0.3 < sum(c.chat for c in drawn) / len(drawn) < 0.7
    greedy_completions = ChallengeSource("mixed", scale=SCALE, greedy_share=1, chat_share=0).draw(20)
    assert {(c.temperature, c.chat) for c in greedy_completions} == {(0.0, False)}
    sampled_chats = ChallengeSource("mixed", scale=SCALE, greedy_share=0, chat_share=1).draw(40)
    assert {c.temperature for c in sampled_chats} == {t for t in workloads.TEMPERATURES if t > 0}
    assert all(c.chat for c in sampled_chats)
    # stop strings: a tenth by default, from the workload's pool; a network's own share replaces it
    assert 0.03 < sum(bool(c.stop) for c in drawn) / len(drawn) < 0.2
    assert {c.stop for c in drawn if c.stop} <= set(workloads.STOPS)
    stopping = ChallengeSource("mixed", scale=SCALE, stop_share=1).draw(80)
    assert all(c.stop for c in stopping) and {c.stop for c in stopping} == set(workloads.STOPS)
    assert 0 < sum(c.stop_as_ids for c in stopping) < len(stopping)
    assert not any(c.stop or c.stop_as_ids for c in ChallengeSource("mixed", scale=SCALE, stop_share=0).draw(40))
    for bad in ({"greedy_share": 1.5}, {"chat_share": -0.1}, {"stop_share": 2}):
        with pytest.raises(ValueError, match="must lie in"):
            ChallengeSource("mixed", **bad)


def test_challenges_continue_sessions_as_often_as_users_do():
    """A follow-up challenge carries its session's earlier turns (sent first, unscored) as prefixes of
    its text. Without follow-ups, none carries any."""
    drawn = ChallengeSource("mixed", scale=SCALE).draw(400)
    followups = [c for c in drawn if c.earlier]
    users = workloads.generate("mixed", rate=1.0, count=400, seed=5, scale=SCALE, followup=workloads.FOLLOWUP_SHARE)
    continued = sum(1 for i, u in enumerate(users) if u.session is not None
                    and any(p.session == u.session for p in users[:i]))
    assert abs(len(followups) / len(drawn) - continued / len(users)) < 0.1
    assert all(list(c.earlier) == sorted(set(c.earlier)) and c.earlier[-1] < len(c.text) for c in followups)
    assert not any(c.earlier for c in ChallengeSource("mixed", scale=SCALE, followup_share=0).draw(100))
    with pytest.raises(ValueError, match="followup_share must lie in"):
        ChallengeSource("mixed", followup_share=2)


def test_a_sealed_challenges_stops_are_bounded_as_a_nodes_api_bounds_a_requests():
    """A planner must not be able to seal stop strings or ids that the challenged node's API refuses:
    the challenge would then look like a node that does not answer."""
    api = ApiLimits()
    sealed = (challenge.MAX_CHALLENGE_STOPS, challenge.MAX_STOP_CHARS, challenge.MAX_STOP_TOKEN_IDS,
              challenge.TOKEN_ID_LIMIT)
    assert sealed == (api.max_stop, api.max_stop_chars, api.max_stop_token_ids, MAX_TOKEN_ID + 1)
