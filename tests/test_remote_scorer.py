"""Scoring through an OpenAI-compatible server's `prompt_logprobs` (here the project's own engine server
over the built-in engine, as `vllm serve` would be run with the reference model) gives the one-pass
scores; the server's side of `prompt_logprobs`, and clear errors."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from planetserve.models import load
from planetserve.node.api.engine_server import EngineServer
from planetserve.node.engine.builtin import BuiltinEngine
from planetserve.verifier import Decoding, OnePassScorer, OpenAIScorer, ScoringError


@pytest.fixture(scope="module")
def served(quick_family):
    """The quick gt behind an engine server on its own event loop thread; yields (url, model)."""
    loaded = load("gt", data_dir=quick_family)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    engine = BuiltinEngine(loaded.model, "gt")
    server = EngineServer(engine, loaded.tokenizer, model_name="gt")
    url = asyncio.run_coroutine_threadsafe(server.start(), loop).result(30)
    yield url, loaded
    asyncio.run_coroutine_threadsafe(server.close(), loop).result(30)
    asyncio.run_coroutine_threadsafe(engine.close(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def pairs(tokenizer) -> list[tuple[list[int], list[int]]]:
    prompt = tokenizer("What does the json module do?")["input_ids"]
    answers = ["It encodes and decodes JSON.", "Returns a string.", "x"]
    return [(prompt, tokenizer(a, add_special_tokens=False)["input_ids"]) for a in answers]


def test_server_scores_equal_the_one_pass_scores(served):
    url, loaded = served
    batch = pairs(loaded.tokenizer)
    remote = OpenAIScorer(url, "gt", vocab_size=len(loaded.tokenizer), concurrency=2)
    local = OnePassScorer(loaded.model)
    for got, want in zip(remote.score(batch), local.score(batch), strict=True):
        assert len(got) == len(want)
        assert got == pytest.approx(want, abs=1e-4)
    greedy = [Decoding(0.0, 0)] * len(batch)
    for got, want in zip(remote.score_choices(batch, greedy), local.score_choices(batch, greedy), strict=True):
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
        # the likeliest token is always among the top ones: a greedy answer's shortfalls are exact
        assert got.shortfalls == pytest.approx(want.shortfalls, abs=1e-4)
    assert remote.score([(batch[0][0], [])]) == [[]]
    # a sampled answer needs the whole distribution at each position, which the server does not return
    with pytest.raises(ScoringError, match="whole distribution"):
        remote.score_choices(batch, [Decoding(0.7, 5)] * len(batch))


def test_the_server_returns_vllm_shaped_prompt_logprobs(served):
    url, loaded = served
    prompt, response = pairs(loaded.tokenizer)[0]
    body = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": "gt", "prompt": prompt + response, "max_tokens": 1, "prompt_logprobs": 3}).json()
    entries = body["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt) + len(response)
    for token, entry in zip((prompt + response)[1:], entries[1:], strict=True):
        own = entry[str(token)]
        assert own["logprob"] <= 0 and own["rank"] >= 1 and isinstance(own["decoded_token"], str)
        ranks = sorted(v["rank"] for v in entry.values())
        assert ranks[:3] == [1, 2, 3] and len(entry) in (3, 4)
    refused = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": "gt", "prompt": prompt, "prompt_logprobs": 99})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"
    streamed = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": "gt", "prompt": prompt, "prompt_logprobs": 0, "stream": True})
    assert streamed.status_code == 400 and "stream" in streamed.json()["error"]["message"]


def test_scoring_errors_are_specific(served):
    url, loaded = served
    batch = pairs(loaded.tokenizer)[:1]
    with pytest.raises(ScoringError, match="answered 404: The model `reference` does not exist"):
        OpenAIScorer(url, "reference", vocab_size=len(loaded.tokenizer)).score(batch)
    with pytest.raises(ScoringError, match="cannot reach"):
        OpenAIScorer("http://127.0.0.1:9", "gt", vocab_size=len(loaded.tokenizer), timeout=5).score(batch)
    with pytest.raises(ScoringError, match="answered 400"):
        OpenAIScorer(url, "gt", vocab_size=len(loaded.tokenizer)).score([(batch[0][0], [10**6])])
    with pytest.raises(ValueError, match="prompt is empty"):
        OpenAIScorer(url, "gt", vocab_size=len(loaded.tokenizer)).score([([], [5])])
