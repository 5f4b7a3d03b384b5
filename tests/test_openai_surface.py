"""The OpenAI surface as the `openai` client sees it, on an engine server over the quick gt: generated
tokens' `logprobs` (chat and completions, whole and streamed) are the model's own log-softmax at those
positions, checked against a teacher-forced pass; stop strings; `/v1/models/{id}`; every error in
OpenAI's shape, unknown paths and methods included. The engines' side: the built-in engine computes
log-probabilities only for the requests that ask and chooses the same tokens either way, a RemoteEngine
carries them through an OpenAI-compatible server, a pipeline refuses them clearly."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import httpx
import openai
import pytest
import torch
from enginefaults import fault
from openai import AsyncOpenAI, OpenAI
from overlaynet import make_user, start_overlay
from stagecluster import cluster
from waiting import run

from planetserve.models import load
from planetserve.models.loading import LoadedModel
from planetserve.node.api.engine_server import EngineServer
from planetserve.node.engine.base import GenerationRequest, TokenChunk
from planetserve.node.engine.builtin import BuiltinEngine
from planetserve.node.engine.remote import RemoteEngine
from planetserve.node.pipeline.coordinator import PipelineClient
from planetserve.node.pipeline.engine import PipelineEngine
from planetserve.node.pipeline.stages import ModelShape

MODEL = "planetserve/gt"
"""Served under a name with a slash, as a real model id has, so /v1/models/{id} must take it."""
QUESTION = [{"role": "user", "content": "What does the json module do?"}]
PROMPT = "The json module"
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def gt(quick_family) -> LoadedModel:
    return load("gt", data_dir=quick_family)


@pytest.fixture(scope="module")
def served(gt) -> Iterator[tuple[str, BuiltinEngine]]:
    """The quick gt behind an engine server on its own event loop thread; yields (url, engine)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    engine = BuiltinEngine(gt.model, MODEL)
    server = EngineServer(engine, gt.tokenizer, model_name=MODEL, eos_token_ids=gt.stop_token_ids)
    url = asyncio.run_coroutine_threadsafe(server.start(), loop).result(30)
    yield url, engine
    asyncio.run_coroutine_threadsafe(server.close(), loop).result(30)
    asyncio.run_coroutine_threadsafe(engine.close(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


@pytest.fixture(scope="module")
def client(served) -> OpenAI:
    return OpenAI(base_url=f"{served[0]}/v1", api_key="none", max_retries=0)


def teacher_forced(gt: LoadedModel, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """The model's log-softmax over the vocabulary at each answer position ([len(answer), vocab])."""
    with torch.inference_mode():
        logits = gt.model(input_ids=torch.tensor([prompt + answer])).logits[0].float()
    return logits.log_softmax(-1)[len(prompt) - 1 : -1]


def extra(obj: Any, name: str) -> Any:
    """A vLLM extension field of an openai response object."""
    return (obj.model_extra or {})[name]


def check_token(row: torch.Tensor, token: int, logprob: float, top: list[tuple[int, float]], k: int) -> None:
    """One generated token's entry against the teacher-forced row at its position: its own value, and the
    k likeliest, sorted, the chosen token among them whenever its rank is within k."""
    assert logprob == pytest.approx(row[token].item(), abs=TOLERANCE)
    values, ids = row.topk(k)
    assert [t for t, _ in top] == ids.tolist()
    assert [v for _, v in top] == pytest.approx(values.tolist(), abs=TOLERANCE)
    assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    if int((row > row[token]).sum()) < k:
        assert token in [t for t, _ in top]


def token_id(text: str) -> int:
    """A token of `return_tokens_as_token_ids`."""
    assert text.startswith("token_id:")
    return int(text[len("token_id:"):])


# -- chat --------------------------------------------------------------------------------------------


def vllm_fields(as_ids: bool) -> dict[str, Any]:
    return {"return_token_ids": True, **({"return_tokens_as_token_ids": True} if as_ids else {})}


def chat_logprobs(client: OpenAI, *, stream: bool, k: int = 5, as_ids: bool = False, **options: Any):
    """(token ids, prompt ids, logprobs content entries, text, finish reason) of one chat answer."""
    asked = dict(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0.8, seed=7, logprobs=True,
                 top_logprobs=k, extra_body=vllm_fields(as_ids), **options)
    if not stream:
        answer = client.chat.completions.create(**asked)
        choice = answer.choices[0]
        return (extra(choice, "token_ids"), extra(answer, "prompt_token_ids"), choice.logprobs.content,
                choice.message.content, choice.finish_reason)
    ids, prompt, content, text, finish = [], None, [], "", None
    for chunk in client.chat.completions.create(stream=True, **asked):
        choice = chunk.choices[0]
        ids += extra(choice, "token_ids")
        prompt = prompt or (chunk.model_extra or {}).get("prompt_token_ids")
        if choice.logprobs is not None:
            assert len(choice.logprobs.content) == len(extra(choice, "token_ids"))  # the chunk's own tokens
            content += choice.logprobs.content
        text += choice.delta.content or ""
        finish = choice.finish_reason or finish
    return ids, prompt, content, text, finish


def test_chat_logprobs_are_the_models_own_log_softmax(client, gt):
    ids, prompt, content, _, _ = chat_logprobs(client, stream=False, as_ids=True)
    assert len(content) == len(ids) > 0
    rows = teacher_forced(gt, prompt, ids)
    for row, token, entry in zip(rows, ids, content, strict=True):
        assert token_id(entry.token) == token and len(entry.top_logprobs) == 5
        check_token(row, token, entry.logprob, [(token_id(e.token), e.logprob) for e in entry.top_logprobs], 5)
    # at temperature 0.8 some token is not the likeliest: the values are still the raw logits' softmax
    assert any(e.logprob < e.top_logprobs[0].logprob for e in content)


def test_chat_logprobs_show_each_tokens_text_and_exact_bytes(client, gt):
    ids, _, content, text, _ = chat_logprobs(client, stream=False)
    for token, entry in zip(ids, content, strict=True):
        assert entry.token == gt.tokenizer.decode([token], skip_special_tokens=False)
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                 reverse=True)
    # the bytes are exact, where a token holds part of a character too
    shown = b"".join(bytes(e.bytes) for e, t in zip(content, ids, strict=True) if t not in gt.stop_token_ids)
    assert shown.decode() == text


def test_streamed_chat_logprobs_agree_with_the_whole_answer(client):
    whole = chat_logprobs(client, stream=False, k=3)
    streamed = chat_logprobs(client, stream=True, k=3)
    assert streamed[0] == whole[0] and streamed[3] == whole[3]
    assert [e.token for e in streamed[2]] == [e.token for e in whole[2]]
    assert [e.logprob for e in streamed[2]] == pytest.approx([e.logprob for e in whole[2]], abs=TOLERANCE)
    assert [[t.token for t in e.top_logprobs] for e in streamed[2]] == \
        [[t.token for t in e.top_logprobs] for e in whole[2]]


def test_chat_logprobs_without_alternatives_and_answers_without_logprobs(client):
    ids, _, content, _, _ = chat_logprobs(client, stream=False, k=0)
    assert len(content) == len(ids) and all(e.top_logprobs == [] for e in content)
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


# -- completions -------------------------------------------------------------------------------------


def completion_logprobs(client: OpenAI, *, stream: bool, as_ids: bool = False, **options: Any) -> dict[str, Any]:
    """The answer's ids, text and logprobs lists (streamed chunks' lists concatenated)."""
    asked = {"model": MODEL, "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "logprobs": 3,
             "extra_body": vllm_fields(as_ids), **options}
    if not stream:
        choice = client.completions.create(**asked).choices[0]
        return {"ids": extra(choice, "token_ids"), "prompt": extra(choice, "prompt_token_ids"),
                "text": choice.text, "finish": choice.finish_reason, **choice.logprobs.model_dump()}
    out: dict[str, Any] = {"ids": [], "text": "", "tokens": [], "token_logprobs": [], "top_logprobs": [],
                           "text_offset": []}
    for chunk in client.completions.create(stream=True, **asked):
        choice = chunk.choices[0]
        out["ids"] += extra(choice, "token_ids")
        out["text"] += choice.text
        out["finish"] = choice.finish_reason
        if choice.logprobs is not None:
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                out[name] += getattr(choice.logprobs, name)
    return out


def test_completion_logprobs_are_the_models_own_in_the_legacy_shape(client, gt):
    answer = completion_logprobs(client, stream=False, as_ids=True)
    ids = answer["ids"]
    assert len(answer["tokens"]) == len(answer["token_logprobs"]) == len(answer["top_logprobs"]) == len(ids)
    rows = teacher_forced(gt, answer["prompt"], ids)
    for row, token, text, logprob, top in zip(rows, ids, answer["tokens"], answer["token_logprobs"],
                                             answer["top_logprobs"], strict=True):
        assert token_id(text) == token and len(top) == 3
        assert top[text] == pytest.approx(logprob)  # greedy: the likeliest, among the 3
        check_token(row, token, logprob, [(token_id(t), v) for t, v in top.items()], 3)
    plain = completion_logprobs(client, stream=False)
    assert plain["ids"] == ids
    assert plain["tokens"] == [gt.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    lengths = [len(t) for t in plain["tokens"]]
    assert plain["text_offset"] == [sum(lengths[:i]) for i in range(len(lengths))]


def test_streamed_completion_logprobs_agree_with_the_whole_answer(client):
    whole = completion_logprobs(client, stream=False)
    streamed = completion_logprobs(client, stream=True)
    for name in ("ids", "text", "tokens", "text_offset", "finish"):
        assert streamed[name] == whole[name], name
    assert streamed["token_logprobs"] == pytest.approx(whole["token_logprobs"], abs=TOLERANCE)
    assert [list(t) for t in streamed["top_logprobs"]] == [list(t) for t in whole["top_logprobs"]]


def test_completion_logprobs_as_token_ids_and_with_the_sampled_token_added(client, gt):
    answer = completion_logprobs(client, stream=False, as_ids=True, temperature=1.5, seed=3, logprobs=0)
    assert answer["tokens"] == [f"token_id:{t}" for t in answer["ids"]]
    # logprobs 0: only the sampled token, as OpenAI returns it
    assert [list(t) for t in answer["top_logprobs"]] == [[f"token_id:{t}"] for t in answer["ids"]]


A = TypeVar("A")
SEEDS = 32
"""Seeds tried for a sampled answer with text to stop at: greedy, quick gt may answer nothing but newlines
(trained on some CPUs it does)."""


def with_a_stop(ask: Callable[[int], A], text_of: Callable[[A], str], size: int) -> tuple[int, A, str]:
    """The first seed whose answer (`ask(seed)`) has `size` characters, not all blank, at the middle of
    its text: the seed, the answer and those characters."""
    for seed in range(SEEDS):
        answer = ask(seed)
        text = text_of(answer)
        stop = text[len(text) // 2 :][:size]
        if stop.strip():
            return seed, answer, stop
    pytest.fail(f"none of {SEEDS} sampled answers has text to stop at")


def test_stop_strings_end_the_answer_and_its_logprobs(client):
    sampled = {"temperature": 1.0, "max_tokens": 16}
    seed, free, stop = with_a_stop(lambda s: completion_logprobs(client, stream=False, seed=s, **sampled),
                                   lambda answer: answer["text"], 3)
    cut = free["text"][: free["text"].index(stop)]
    for stream in (False, True):
        answer = completion_logprobs(client, stream=stream, stop=[stop], seed=seed, **sampled)
        assert answer["text"] == cut and answer["finish"] == "stop"
        # the tokens up to the one that completed the stop string, and their log-probabilities
        assert answer["ids"] == free["ids"][: len(answer["ids"])] and len(answer["ids"]) < len(free["ids"])
        assert "".join(answer["tokens"]).startswith(cut + stop[:1])
        assert len(answer["token_logprobs"]) == len(answer["ids"])

    def chat(seed: int, **options: Any) -> Any:
        return client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=1.0,
                                              seed=seed, **options).choices[0]

    seed, text, stop = with_a_stop(lambda s: chat(s).message.content, str, 2)
    stopped = chat(seed, stop=stop)
    assert stopped.message.content == text[: text.index(stop)]
    assert stopped.finish_reason == "stop"


# -- bad values --------------------------------------------------------------------------------------


BAD: list[tuple[str, dict[str, Any], str, str]] = [
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "between 0 and 20"),
    ("chat", {"top_logprobs": 3}, "top_logprobs", "needs `logprobs` set to true"),
    ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs", "between 0 and 20"),
    ("completions", {"logprobs": 6}, "logprobs", "between 0 and 5"),
    ("completions", {"logprobs": -1}, "logprobs", "between 0 and 5"),
]


@pytest.mark.parametrize(("endpoint", "options", "param", "fragment"), BAD)
def test_bad_logprobs_values_get_a_400_naming_the_parameter(client, endpoint, options, param, fragment):
    with pytest.raises(openai.BadRequestError) as refused:
        if endpoint == "chat":
            client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, **options)
        else:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, **options)
    assert refused.value.status_code == 400 and refused.value.param == param
    assert fragment in refused.value.message


# -- models and errors -------------------------------------------------------------------------------


def test_models_report_max_model_len_and_one_model_is_found_by_id(client, served):
    engine = served[1]
    (card,) = client.models.list().data
    assert card.id == MODEL and extra(card, "max_model_len") == engine.max_model_len
    one = client.models.retrieve(MODEL)  # sent as planetserve%2Fgt
    assert one.id == MODEL and one.object == "model" and extra(one, "max_model_len") == engine.max_model_len
    raw = httpx.get(f"{served[0]}/v1/models/{MODEL}")  # the slash as it is
    assert raw.status_code == 200 and raw.json()["id"] == MODEL
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-9")
    assert missing.value.code == "model_not_found" and "gpt-9" in missing.value.message


def assert_openai_error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    return error


async def check_unknown_paths_and_methods(url: str) -> None:
    """404 and 405 in OpenAI's shape, for any surface at `url`."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        missing = assert_openai_error(await http.post("/v1/embeddings", json={}), 404, "not_found")
        assert "/v1/embeddings" in missing["message"]
        assert_openai_error(await http.get("/nothing/here"), 404, "not_found")
        wrong = await http.get("/v1/completions")
        assert "use POST" in assert_openai_error(wrong, 405, "method_not_allowed")["message"]
        assert wrong.headers["Allow"] == "POST"
        assert_openai_error(await http.post("/v1/models", json={}), 405, "method_not_allowed")
        assert_openai_error(await http.delete("/v1/chat/completions"), 405, "method_not_allowed")
        assert_openai_error(await http.get("/v1/models/nope"), 404, "model_not_found")


def test_unknown_paths_and_methods_get_openai_errors(served):
    run(check_unknown_paths_and_methods(served[0]))


# -- engines -----------------------------------------------------------------------------------------


def test_the_builtin_engine_scores_only_requests_that_ask_and_picks_the_same_tokens(gt):
    prompt = tuple(gt.tokenizer(PROMPT)["input_ids"])

    async def main() -> list[list[TokenChunk]]:
        engine = BuiltinEngine(gt.model, "gt", max_batch=4)
        try:
            requests = [GenerationRequest(prompt, 8, 0.9, 11, logprobs=k) for k in (None, 2, None, 20)]

            async def one(request: GenerationRequest) -> list[TokenChunk]:
                return [chunk async for chunk in engine.generate(request)]

            return await asyncio.gather(*(one(r) for r in requests))  # one batch, asking or not
        finally:
            await engine.close()

    plain, two, again, twenty = run(main())
    tokens = [[t for c in chunks for t in c.token_ids] for chunks in (plain, two, again, twenty)]
    assert tokens[0] == tokens[1] == tokens[2] == tokens[3]  # asking changes no choice
    assert all(c.logprobs is None for c in plain + again)
    rows = teacher_forced(gt, list(prompt), tokens[0])
    for chunks, k in ((two, 2), (twenty, 20)):
        scored = [lp for c in chunks for lp in c.logprobs]
        for row, token, entry in zip(rows, tokens[0], scored, strict=True):
            check_token(row, token, entry.logprob, list(entry.top), k)


def test_a_remote_engine_carries_logprobs_through_an_openai_server(served, gt):
    url, engine = served
    prompt = tuple(gt.tokenizer(PROMPT)["input_ids"])

    async def main() -> list[TokenChunk]:
        remote = await RemoteEngine.connect(url, MODEL)
        try:
            return [c async for c in remote.generate(GenerationRequest(prompt, 6, 0.0, logprobs=4))]
        finally:
            await remote.close()

    chunks = run(main())
    tokens = [t for c in chunks for t in c.token_ids]
    rows = teacher_forced(gt, list(prompt), tokens)
    scored = [lp for c in chunks for lp in c.logprobs]
    for row, token, entry in zip(rows, tokens, scored, strict=True):
        check_token(row, token, entry.logprob, list(entry.top), 4)


def test_a_pipelined_model_reports_logprobs_as_one_engine_does(gt):
    """A model split over two stage servers (TLS on loopback) answers `logprobs` through the OpenAI
    surface with the whole model's values: each token's own and its likeliest alternatives."""
    layers = {"a": (0, 1), "b": (1, 2)}
    shape = ModelShape.of(gt.model.config)

    async def main():
        c = await cluster(gt, layers)
        pipeline = PipelineEngine(lambda peering: PipelineClient(peering, c.router, {g: c.address(g) for g in layers},
                                                                 shape, gt.tokenizer),
                                  "gt", max_model_len=shape.max_positions, capacity=1)
        await pipeline.start(c.peering)
        server = EngineServer(pipeline, gt.tokenizer, model_name=MODEL)
        url = await server.start()
        try:
            return await asyncio.to_thread(chat_logprobs, OpenAI(base_url=f"{url}/v1", api_key="none"),
                                           stream=False, as_ids=True)
        finally:
            await server.close()
            await pipeline.close()
            await c.close()

    ids, prompt, content, _, _ = run(main(), 60)
    assert len(content) == len(ids) > 0
    for row, token, entry in zip(teacher_forced(gt, prompt, ids), ids, content, strict=True):
        assert token_id(entry.token) == token and len(entry.top_logprobs) == 5
        check_token(row, token, entry.logprob, [(token_id(e.token), e.logprob) for e in entry.top_logprobs], 5)


def test_a_failing_request_gets_a_500_a_full_queue_a_503_and_the_others_their_answers(gt):
    """Through the OpenAI client: the engine's own failure of one request and its refusal of one more
    than its queue holds arrive in OpenAI's error shape, while the requests beside them complete."""
    poison = gt.tokenizer("json")["input_ids"][-1]

    async def main() -> None:
        engine = BuiltinEngine(gt.model, "gt", max_batch=1, max_queue=1)
        server = EngineServer(engine, gt.tokenizer, model_name="gt", eos_token_ids=gt.stop_token_ids)
        url = await server.start()
        api = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        ask = {"model": "gt", "max_tokens": 8, "temperature": 0}
        try:
            with fault(gt.model, lambda ids: ids.shape[1] > 1 and bool((ids == poison).any())) as paused:
                with pytest.raises(openai.InternalServerError) as failed:
                    await api.completions.create(prompt="The json module", **ask)
                assert "injected device fault" in failed.value.message
                running = await api.completions.create(prompt="The os module", stream=True, **ask)
                first = await anext(running)
                paused.gate.clear()
                queued = asyncio.ensure_future(api.completions.create(prompt="The re module", **ask))
                while engine.load().queued < 1:
                    await asyncio.sleep(0.01)
                with pytest.raises(openai.InternalServerError) as refused:
                    await api.completions.create(prompt="The sys module", **ask)
                assert refused.value.status_code == 503 and refused.value.code == "overloaded"
                assert "already waiting" in refused.value.message
                paused.gate.set()
                rest = [chunk async for chunk in running]
                assert (first.choices or rest[0].choices) and rest[-1].choices[0].finish_reason
                assert (await queued).choices[0].finish_reason in ("stop", "length")
        finally:
            await server.close()
            await engine.close()

    run(main())


# -- model nodes and the user relay --------------------------------------------------------------------


def test_the_relay_carries_logprobs_to_a_node_that_serves_them_itself(quick_family):
    """Through the relay's canonical re-encoding and the overlay, to a group of two model nodes: the entry
    node computes a logprobs request itself (route `logprobs`) and the relay returns what the node's own
    API answers; models, one model by id and errors in OpenAI's shape at the relay and the nodes."""
    async def main() -> None:
        net = await start_overlay(quick_family, [make_user() for _ in range(6)], 2)
        try:
            relay = AsyncOpenAI(base_url=f"{net.client.http_url}/v1", api_key="none", max_retries=0)
            asked = {"model": "gt", "messages": QUESTION, "max_tokens": 6, "temperature": 0, "logprobs": True,
                     "top_logprobs": 3}
            answer = await relay.chat.completions.create(**asked)
            served = extra(answer, "planetserve")
            assert served["route"] == "logprobs" and served["served_by"] == served["node"]
            node = next(n for n in net.nodes if n.node_id == served["node"])
            direct = await AsyncOpenAI(base_url=f"{node.http_url}/v1", api_key="none", max_retries=0) \
                .chat.completions.create(**asked)
            assert answer.choices[0].message.content == direct.choices[0].message.content
            assert [(e.token, [t.token for t in e.top_logprobs]) for e in answer.choices[0].logprobs.content] == \
                [(e.token, [t.token for t in e.top_logprobs]) for e in direct.choices[0].logprobs.content]
            assert [e.logprob for e in answer.choices[0].logprobs.content] == pytest.approx(
                [e.logprob for e in direct.choices[0].logprobs.content], abs=TOLERANCE)
            completion = await relay.completions.create(model="gt", prompt=PROMPT, max_tokens=4, temperature=0,
                                                        logprobs=2, extra_body={"return_token_ids": True})
            choice = completion.choices[0]
            assert len(choice.logprobs.tokens) == len(extra(choice, "token_ids")) == 4
            assert all(len(top) in (2, 3) for top in choice.logprobs.top_logprobs)
            with pytest.raises(openai.BadRequestError) as refused:
                await relay.chat.completions.create(**{**asked, "top_logprobs": 21})
            assert refused.value.param == "top_logprobs"

            (card,) = (await relay.models.list()).data
            assert card.id == "gt" and "max_model_len" not in (card.model_extra or {})
            assert (await relay.models.retrieve("gt")).id == "gt"
            with pytest.raises(openai.NotFoundError) as missing:
                await relay.models.retrieve("llama-70b")
            assert missing.value.code == "model_not_found"
            node_card = await AsyncOpenAI(base_url=f"{node.http_url}/v1", api_key="none").models.retrieve("gt")
            assert extra(node_card, "max_model_len") == node.engine.max_model_len
            for url in (net.client.http_url, node.http_url):
                await check_unknown_paths_and_methods(url)
        finally:
            await net.close()

    run(main())
