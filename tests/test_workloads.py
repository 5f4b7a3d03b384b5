"""The synthetic workloads: determinism, the paper's statistics, and prompts that read like questions."""

from __future__ import annotations

import math
import re
from collections import Counter

import numpy as np
import pytest

from planetserve import workloads as w

TARGET_MEANS = {"tooluse": 7206, "coding": 1802, "longdoc": 10985,
                "mixed": 0.3 * 7206 + 0.6 * 1802 + 0.1 * 10985}
CAPS = {"tooluse": 100, "coding": 1000, "longdoc": 100}


@pytest.fixture(scope="module")
def big() -> dict[str, list[w.Request]]:
    return {name: w.generate(name, rate=10.0, count=4000, seed=11) for name in w.WORKLOADS}


def _key(r: w.Request) -> tuple:
    return (r.id, r.arrival, r.workload, r.prefix_id, r.prompt_ids, r.max_tokens, r.output_len, r.session,
            r.temperature, r.chat)


def test_same_seed_same_requests_other_seed_others() -> None:
    a = w.generate("mixed", rate=5.0, count=150, seed=3, followup=0.2)
    b = w.generate("mixed", rate=5.0, count=150, seed=3, followup=0.2)
    c = w.generate("mixed", rate=5.0, count=150, seed=4, followup=0.2)
    assert [_key(r) for r in a] == [_key(r) for r in b]
    assert [r.prompt_ids for r in a] != [r.prompt_ids for r in c]
    assert [r.arrival for r in a] != [r.arrival for r in c]


@pytest.mark.parametrize("name", w.WORKLOADS)
def test_mean_prompt_length_matches_the_paper(big: dict[str, list[w.Request]], name: str) -> None:
    mean = np.mean([r.prompt_len for r in big[name]])
    assert mean == pytest.approx(TARGET_MEANS[name], rel=0.05)


@pytest.mark.parametrize("name", ["tooluse", "coding", "longdoc"])
def test_zipf_exponent_recovered_from_prefix_popularity(big: dict[str, list[w.Request]], name: str) -> None:
    counts = Counter(int(r.prefix_id.split("/")[1]) for r in big[name])
    ranks = np.arange(1, 31)
    freq = np.array([counts[r - 1] for r in ranks], dtype=float)
    slope = np.polyfit(np.log(ranks), np.log(np.maximum(freq, 0.5)), 1)[0]
    assert -slope == pytest.approx(w.SPECS[name].zipf, abs=0.2)


def test_same_prefix_id_same_prefix_and_suffixes_unique(big: dict[str, list[w.Request]]) -> None:
    by_prefix: dict[str, tuple[int, ...]] = {}
    for r in big["mixed"]:
        assert by_prefix.setdefault(r.prefix_id, r.prefix_ids) == r.prefix_ids
    suffixes = [r.suffix_ids for r in big["mixed"]]
    assert len(set(suffixes)) >= 0.99 * len(suffixes)
    assert len({r.prefix_id for r in big["tooluse"]}) < 0.3 * len(big["tooluse"])


def test_poisson_arrivals() -> None:
    requests = w.generate("coding", rate=4.0, count=6000, seed=5)
    gaps = np.diff([0.0] + [r.arrival for r in requests])
    assert gaps.min() > 0
    assert gaps.mean() == pytest.approx(0.25, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.06)
    timed = w.generate("coding", rate=4.0, duration=50.0, seed=5)
    assert all(r.arrival < 50.0 for r in timed)
    assert len(timed) == pytest.approx(200, abs=45)


@pytest.mark.parametrize("name", ["tooluse", "coding", "longdoc"])
def test_output_caps(big: dict[str, list[w.Request]], name: str) -> None:
    requests = big[name]
    assert {r.max_tokens for r in requests} == {CAPS[name]}
    lengths = [r.output_len for r in requests]
    assert min(lengths) >= 1 and max(lengths) <= CAPS[name]
    assert np.mean(lengths) == pytest.approx(CAPS[name] * (1 + w.OUTPUT_RANGE_RATIO) / 2, rel=0.05)


def test_scale_shrinks_every_length(big: dict[str, list[w.Request]]) -> None:
    small = w.generate("mixed", rate=10.0, count=1000, seed=11, scale=0.05)
    assert np.mean([r.prompt_len for r in small]) < 0.1 * np.mean([r.prompt_len for r in big["mixed"]])
    assert max(r.prompt_len for r in small) < 3000
    assert {r.max_tokens for r in small} == {5, 50}
    assert all(r.output_len <= r.max_tokens for r in small)


def test_texts_read_like_questions() -> None:
    question = re.compile(r"(^|\n\n| )[A-Z][a-z]+( [^ ]+)* [a-z][^?]*\?$")
    for r in w.generate("mixed", rate=1.0, count=200, seed=2, scale=0.05):
        text = r.text
        assert text.endswith("?")
        assert question.search(text.rsplit("\n\n", 1)[-1])
        assert "{" not in text and "  " not in text and not text.startswith(" ")
        assert all(p[:1].isupper() for p in text.split("\n\n") if p)
        assert w.tokenize(text) == r.prompt_ids
    assert w.detokenize(w.tokenize("How can I return the number of items?")) == (
        "How can I return the number of items?")


def test_followups_extend_their_session() -> None:
    requests = w.generate("tooluse", rate=2.0, count=300, seed=9, followup=0.3, scale=0.05)
    by_id = {r.id: r for r in requests}
    sessions: dict[str, list[w.Request]] = {}
    for r in requests:
        if r.session is not None:
            sessions.setdefault(r.session, []).append(r)
    assert sessions and all(len(turns) >= 2 for turns in sessions.values())
    for turns in sessions.values():
        for earlier, later in zip(turns, turns[1:], strict=False):
            assert later.prompt_ids[: earlier.prompt_len] == earlier.prompt_ids
            assert later.arrival > earlier.arrival
        assert by_id[int(turns[0].session[1:])] is turns[0]


def test_requests_say_how_they_are_sent_and_sampled(big: dict[str, list[w.Request]]) -> None:
    """Half greedy, a quarter each at 0.7 and 1.0; a quarter with top_p 0.9; half sent as chats; a tenth
    asking for log-probabilities with 0-5 alternatives, and a tenth ending at stop strings; drawn apart
    from everything else, so adding them left every other field of a seed's requests as it was."""
    requests = big["mixed"]
    for drawn, weights in ((Counter(r.temperature for r in requests), w.TEMPERATURES),
                           (Counter(r.top_p for r in requests), w.TOP_PS)):
        assert set(drawn) == set(weights)
        for value, weight in weights.items():
            assert drawn[value] / len(requests) == pytest.approx(weight / sum(weights.values()), abs=0.03)
    assert sum(r.chat for r in requests) / len(requests) == pytest.approx(w.CHAT_SHARE, abs=0.03)
    asking = [r.logprobs for r in requests if r.logprobs is not None]
    assert len(asking) / len(requests) == pytest.approx(w.LOGPROBS_SHARE, abs=0.03)
    assert set(asking) == set(range(w.MAX_TOP_LOGPROBS + 1))
    stopping = Counter(r.stop for r in requests if r.stop)
    assert sum(stopping.values()) / len(requests) == pytest.approx(w.STOP_SHARE, abs=0.03)
    for stop, weight in w.STOPS.items():
        assert stopping[stop] / sum(stopping.values()) == pytest.approx(weight / sum(w.STOPS.values()), abs=0.08)
    as_ids = [r.stop_as_ids for r in requests if r.stop]
    assert sum(as_ids) / len(as_ids) == pytest.approx(w.STOP_AS_IDS_SHARE, abs=0.08)
    assert not any(r.stop_as_ids for r in requests if not r.stop)
    first = requests[0]
    assert (first.prefix_id, first.output_len, len(first.suffix_ids)) == ("coding/7075", 628, 120)


def test_a_follow_up_is_sent_and_sampled_like_its_session() -> None:
    requests = w.generate("coding", rate=2.0, count=300, seed=4, followup=0.4, scale=0.05)
    by_session: dict[str, set[tuple]] = {}
    for r in requests:
        if r.session is not None:
            by_session.setdefault(r.session, set()).add((r.temperature, r.chat, r.top_p, r.logprobs, r.stop,
                                                          r.stop_as_ids))
    assert by_session and all(len(forms) == 1 for forms in by_session.values())
    assert len({form for forms in by_session.values() for form in forms}) > 1


def test_stop_strings_go_as_token_ids_where_the_model_has_one_token_for_them() -> None:
    encode = {"\n": [203], ".": [18], "\n\n": [203, 203], "Question:": [53, 89]}.__getitem__
    assert w.stop_fields((".",), False, encode) == ((".",), ())
    assert w.stop_fields((".",), True, encode) == ((), (18,))
    assert w.stop_fields(("\n\n", "Question:"), True, encode) == (("\n\n", "Question:"), ())
    assert w.stop_fields(("\n", "\n\n", "."), True, encode) == (("\n\n",), (203, 18))


def test_generated_shared_prefix_matches_sglang_defaults() -> None:
    requests = w.generated_shared_prefix(seed=1)
    assert len(requests) == 64 * 16
    groups = Counter(r.prefix_id for r in requests)
    assert len(groups) == 64 and set(groups.values()) == {16}
    assert np.mean([len(r.prefix_ids) for r in requests]) == pytest.approx(2048, rel=0.05)
    assert np.mean([len(r.suffix_ids) for r in requests]) == pytest.approx(128, rel=0.1)
    assert {r.max_tokens for r in requests} == {256} and all(r.arrival == 0 for r in requests)
    assert [r.prefix_id for r in requests[:16]] != sorted(r.prefix_id for r in requests[:16])
    timed = w.generated_shared_prefix(num_groups=4, prompts_per_group=50, rate=10.0, scale=0.1)
    assert all(a.arrival < b.arrival for a, b in zip(timed, timed[1:], strict=False))
    assert not math.isinf(timed[-1].arrival)


def test_rejects_unknown_workload() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        w.generate("chat", rate=1.0, count=1)
