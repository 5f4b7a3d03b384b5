"""The OpenAI-compatible surface (validation, responses, streaming), RemoteEngine against well- and
badly-behaved servers, and end to end: the built-in engine served over HTTP with its cache events on
ZMQ, consumed by a RemoteEngine, must behave like the engine itself."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
import torch
from aiohttp import web
from crosssite import allowed, apost, attacks, check_refusal
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from waiting import run, until

from planetserve.models.detokenize import TextAssembler
from planetserve.node.api.engine_server import EngineServer
from planetserve.node.api.openai import ApiLimits, PlanetServeOptions, parse_chat_request
from planetserve.node.engine.base import (
    BlockStored,
    CacheEvent,
    EngineError,
    EngineLoad,
    GenerationRequest,
    TokenChunk,
    TokenLogprob,
)
from planetserve.node.engine.builtin import BuiltinEngine
from planetserve.node.engine.kvcache import block_hashes
from planetserve.node.engine.kvevents import KVEventPublisher, PrefixMirror
from planetserve.node.engine.profile import random_llama
from planetserve.node.engine.remote import RemoteEngine, RemoteEngineError
from planetserve.node.engine.wire import SSEDecoder, SSEError
from planetserve.node.routing.cachesync import CacheSync

VOCAB = 512
SPECIAL = ["<unk>", "<s>", "</s>", "user", "assistant", "system", ":"]
FIRST_WORD = len(SPECIAL)
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}assistant :{% endif %}")


def make_tokenizer(chat_template: bool = True) -> PreTrainedTokenizerFast:
    """Word-level: id FIRST_WORD + i is the word "w{i}", so any id below VOCAB decodes."""
    words = SPECIAL + [f"w{i}" for i in range(VOCAB - FIRST_WORD)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>")
    if chat_template:
        tokenizer.chat_template = TEMPLATE
    return tokenizer


def words(ids: list[int] | tuple[int, ...]) -> str:
    return " ".join(f"w{t - FIRST_WORD}" for t in ids)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return make_tokenizer()


class FakeEngine:
    """Counts upwards from the prompt's last token, one token per chunk."""

    model_id = "fake"
    block_size = 4
    max_model_len = 64

    def __init__(self, queued: int = 0, fail_after: int | None = None) -> None:
        self.queued = queued
        self.fail_after = fail_after
        self.requests: list[GenerationRequest] = []

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenChunk]:
        self.requests.append(request)
        if request.prompt_ids[0] == FIRST_WORD + 499:
            raise EngineError("the fake engine refuses w499")
        for i in range(request.max_tokens):
            if self.fail_after is not None and i == self.fail_after:
                raise EngineError("the fake engine broke")
            token = (request.prompt_ids[-1] + 1 + i) % VOCAB
            finish = "stop" if token in request.stop_ids else "length" if i == request.max_tokens - 1 else None
            first = i == 0
            yield TokenChunk((token,), finish, len(request.prompt_ids) if first else 0,
                             len(request.prompt_ids) // 2 if first else 0)
            if finish:
                return
            await asyncio.sleep(0)

    def load(self) -> EngineLoad:
        return EngineLoad(0, self.queued, 4)

    def on_cache_events(self, callback: Callable[[list[CacheEvent]], None]) -> None:
        pass

    async def close(self) -> None:
        pass


def serve(engine: Any, tokenizer: Any, body: Callable[[httpx.AsyncClient], Awaitable[None]],
          **options: Any) -> None:
    async def main() -> None:
        server = EngineServer(engine, tokenizer, **options)
        url = await server.start()
        try:
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                await body(client)
        finally:
            await server.close()

    run(main(), 120)


def sse_events(text: str) -> list[Any]:
    return [e if e == "[DONE]" else json.loads(e) for e in SSEDecoder().feed(text.encode())]


PROMPT = [FIRST_WORD + 10, FIRST_WORD + 11, FIRST_WORD + 12]

# (path, body, status, error code, message fragment)
BAD_REQUESTS: list[tuple[str, Any, int, str | None, str]] = [
    ("/v1/completions", b"{not json", 400, "invalid_json", "not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, "invalid_json", "must be a JSON object"),
    ("/v1/completions", b"[" * 60_000, 400, "invalid_json", "not valid JSON"),
    ("/v1/completions", {"model": "fake"}, 400, "missing_required_parameter", "`prompt` is required"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "invalid_value", "Batched prompts"),
    ("/v1/completions", {"prompt": [[1, 2]]}, 400, "invalid_value", "Batched prompts"),
    ("/v1/completions", {"prompt": []}, 400, "invalid_value", "`prompt` must not be empty"),
    ("/v1/completions", {"prompt": [1, -2]}, 400, "invalid_value", "non-negative integer token ids"),
    ("/v1/completions", {"prompt": [1, True]}, 400, "invalid_value", "non-negative integer token ids"),
    ("/v1/completions", {"prompt": 7}, 400, "invalid_value", "`prompt` must be a list of token ids"),
    ("/v1/completions", {"prompt": [1, VOCAB]}, 400, "invalid_value", "below the vocabulary size 512"),
    ("/v1/completions", {"prompt": "w1", "model": "gpt-9"}, 404, "model_not_found",
     "The model `gpt-9` does not exist."),
    ("/v1/completions", {"prompt": "w1", "model": 5}, 400, "invalid_value", "`model` must be a string"),
    ("/v1/completions", {"prompt": "w1", "max_tokens": 0}, 400, "invalid_value",
     "`max_tokens` must be between 1"),
    ("/v1/completions", {"prompt": "w1", "max_tokens": "5"}, 400, "invalid_value",
     "`max_tokens` must be an integer"),
    ("/v1/completions", {"prompt": "w1", "temperature": -0.5}, 400, "invalid_value",
     "`temperature` must be between 0 and 2"),
    ("/v1/completions", {"prompt": "w1", "temperature": "hot"}, 400, "invalid_value", "finite number"),
    ("/v1/completions", {"prompt": "w1", "seed": 1.5}, 400, "invalid_value", "`seed` must be an integer"),
    ("/v1/completions", {"prompt": "w1", "n": 2}, 400, "unsupported_parameter", "`n` is not supported"),
    ("/v1/completions", {"prompt": "w1", "logprobs": 6}, 400, "invalid_value",
     "`logprobs` must be between 0 and 5, got 6"),
    ("/v1/completions", {"prompt": "w1", "logprobs": True}, 400, "invalid_value",
     "`logprobs` must be an integer"),
    ("/v1/completions", {"prompt": "w1", "top_p": 1.5}, 400, "invalid_value", "`top_p` must be between 0 and 1."),
    ("/v1/completions", {"prompt": "w1", "top_p": "0.9"}, 400, "invalid_value", "`top_p` must be a finite number."),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}], "top_k": 40}, 400,
     "unsupported_parameter", "`top_k` is not supported by this server: sampling is over the model's distribution "
     "(or its `top_p` nucleus) under the request's seed"),
    ("/v1/completions", {"prompt": "w1", "stream": "yes"}, 400, "invalid_value", "`stream` must be a boolean"),
    ("/v1/completions", {"prompt": "w1", "stream_options": {"include_usage": True}}, 400, "invalid_value",
     "only allowed when `stream` is true"),
    ("/v1/completions", {"prompt": "w1", "stop": ["x"] * 17}, 400, "invalid_value", "17 entries; at most 16"),
    ("/v1/completions", {"prompt": "w1", "stop": [""]}, 400, "invalid_value", "1 to 256 characters"),
    ("/v1/completions", {"prompt": "w1", "stop": 3}, 400, "invalid_value", "string or a list of strings"),
    ("/v1/completions", {"prompt": "w1", "stop_token_ids": [VOCAB]}, 400, "invalid_value",
     "Stop token ids must be below"),
    ("/v1/completions", {"prompt": "w1", "return_token_ids": 1}, 400, "invalid_value",
     "`return_token_ids` must be a boolean"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 62}, 413, "context_length_exceeded",
     "maximum context length is 64 tokens. However, you requested 65 tokens"),
    ("/v1/completions", {"prompt": [FIRST_WORD] * 64}, 413, "context_length_exceeded",
     "the prompt has 64 tokens"),
    ("/v1/completions", {"prompt": "w1 " * 30_000}, 413, "request_too_large", "exceeds the limit of 65536"),
    ("/v1/completions", {"prompt": [FIRST_WORD + 499]}, 400, None, "the fake engine refuses w499"),
    ("/v1/completions", {"prompt": "w1", "planetserve": {"session": "x"}}, 400, "invalid_value",
     "Unknown `planetserve` field(s): session"),
    ("/v1/completions", {"prompt": "w1", "planetserve": {"session_id": "a b"}}, 400, "invalid_value",
     "`planetserve.session_id` must be"),
    ("/v1/completions", {"prompt": "w1", "planetserve": {"hops": 17}}, 400, "invalid_value",
     "`hops` must be between 0 and 16"),
    ("/v1/completions", {"prompt": "w1", "planetserve": []}, 400, "invalid_value",
     "`planetserve` must be an object"),
    ("/v1/chat/completions", {"model": "fake"}, 400, "invalid_value", "`messages` must be a non-empty list"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "w1"}]}, 400, "invalid_value",
     "`messages[0].role` must be one of"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "invalid_value",
     "`messages[0].content` must be a string or a list of text parts"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "invalid_value", "parts must be text parts"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}], "tools": [{"type": "function"}]},
     400, "unsupported_parameter", "`tools` is not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}], "top_logprobs": 2}, 400,
     "invalid_value", "`top_logprobs` needs `logprobs` set to true"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}], "logprobs": True,
                              "top_logprobs": 21}, 400, "invalid_value", "`top_logprobs` must be between 0 and 20"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}], "logprobs": 1}, 400,
     "invalid_value", "`logprobs` must be a boolean"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}], "continue_final_message": True},
     400, "invalid_value", "requires `add_generation_prompt` false"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}] * 1025}, 413,
     "request_too_large", "1025 entries"),
]


def test_bad_requests_get_specific_errors(tokenizer: PreTrainedTokenizerFast) -> None:
    async def body(client: httpx.AsyncClient) -> None:
        for path, payload, status, code, fragment in BAD_REQUESTS:
            content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            response = await client.post(path, content=content, headers={"Content-Type": "application/json"})
            assert response.status_code == status, (path, payload, response.text)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert fragment in error["message"], (fragment, error)
            assert error["code"] == code, (payload, error)

    serve(FakeEngine(), tokenizer, body, limits=ApiLimits(max_body_bytes=65536))


OPENAI_ERROR = {"message", "type", "param", "code"}


def test_other_sites_pages_and_rebinding_never_reach_the_engine(tokenizer: PreTrainedTokenizerFast) -> None:
    """Every request a web page can make the user's browser send here (another site's fetch or form, a
    page re-pointing its DNS name at 127.0.0.1, a simple-request body) is refused in OpenAI's shape before
    the engine sees it; programs and the server's own origin still get answers."""
    engine = FakeEngine()
    requests = {"/v1/completions": {"prompt": "w1", "max_tokens": 2},
                "/v1/chat/completions": {"messages": [{"role": "user", "content": "w1"}], "max_tokens": 2}}

    async def body(client: httpx.AsyncClient) -> None:
        url = str(client.base_url)
        for attack in attacks(url):
            for path, payload in requests.items():
                check_refusal(await apost(client, path, payload, attack), attack, OPENAI_ERROR)
            if attack.reads:
                for path in ("/v1/models", "/load", "/health", "/nothing/here"):
                    check_refusal(await client.get(path, headers=attack.headers), attack, OPENAI_ERROR)
        assert engine.requests == []
        for name, headers in allowed(url):
            for path, payload in requests.items():
                answer = await client.post(path, json=payload, headers=headers)
                assert answer.status_code == 200, (name, answer.text)
            assert (await client.get("/v1/models", headers=headers)).status_code == 200, name
        assert len(engine.requests) == 2 * len(allowed(url))

    serve(engine, make_tokenizer(chat_template=True), body)


def test_a_server_on_every_address_answers_ip_literals_and_its_configured_names() -> None:
    """Bound to 0.0.0.0 (reachable by peers), the API answers to any IP literal, since it listens on each,
    and to the names its owner configured; a rebinding name is still refused."""

    async def main() -> None:
        engine = FakeEngine()
        server = EngineServer(engine, make_tokenizer(), hosts=("node.example.org:9000", ""))
        url = await server.start("0.0.0.0", 0)  # noqa: S104 - the case under test
        port = int(url.rsplit(":", 1)[1])
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
                for host in ("192.0.2.7", "[2001:db8::7]", "node.example.org", "localhost", "0.0.0.0"):  # noqa: S104
                    answer = await client.post("/v1/completions", json={"prompt": "w1", "max_tokens": 1},
                                               headers={"Host": f"{host}:{port}", "Origin": f"http://{host}:{port}"})
                    assert answer.status_code == 200, (host, answer.text)
                for host in ("evil.example", "node.example.org.evil.example", "example.org", "192.0.2.7.nip.io"):
                    refused = await client.get("/v1/models", headers={"Host": f"{host}:{port}"})
                    assert refused.status_code == 403, (host, refused.text)
                    assert refused.json()["error"]["code"] == "host_not_allowed"
                assert len(engine.requests) == 5
        finally:
            await server.close()

    run(main(), 60)


def test_overload_missing_chat_template_and_info_endpoints() -> None:
    async def body(client: httpx.AsyncClient) -> None:
        response = await client.post("/v1/completions", json={"prompt": "w1"})
        assert response.status_code == 503 and response.json()["error"]["code"] == "overloaded"
        assert (await client.get("/load")).json() == {"server_load": 2, "running": 0, "queued": 2, "capacity": 4}
        engine.queued = 1
        response = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "w1"}]})
        assert response.status_code == 400 and response.json()["error"]["code"] == "no_chat_template"
        assert (await client.get("/health")).status_code == 200
        models = (await client.get("/v1/models")).json()
        assert models["object"] == "list"
        assert [(m["id"], m["object"], m["max_model_len"]) for m in models["data"]] == [("served", "model", 64)]

    engine = FakeEngine(queued=2)
    serve(engine, make_tokenizer(chat_template=False), body, max_queued=2, model_name="served")


def test_completion_and_chat_responses(tokenizer: PreTrainedTokenizerFast) -> None:
    engine = FakeEngine()

    async def body(client: httpx.AsyncClient) -> None:
        response = await client.post("/v1/completions", json={
            "model": "fake", "prompt": PROMPT, "max_tokens": 3, "return_token_ids": True,
            "planetserve": {"session_id": "s-1", "hops": 2, "no_forward": True}})
        assert response.status_code == 200, response.text
        out = response.json()
        assert out["object"] == "text_completion" and out["id"].startswith("cmpl-")
        choice = out["choices"][0]
        assert choice["text"] == words([PROMPT[-1] + 1, PROMPT[-1] + 2, PROMPT[-1] + 3])
        assert choice["token_ids"] == [PROMPT[-1] + 1, PROMPT[-1] + 2, PROMPT[-1] + 3]
        assert choice["prompt_token_ids"] == PROMPT and choice["finish_reason"] == "length"
        assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                                "prompt_tokens_details": {"cached_tokens": 1}}

        # a text prompt; no token ids unless asked; a stop string ends the text before it
        response = await client.post("/v1/completions", json={"prompt": "w10 w11", "max_tokens": 8,
                                                              "stop": "w15"})
        choice = response.json()["choices"][0]
        assert choice["text"] == "w12 w13 w14 " and choice["finish_reason"] == "stop"
        assert "token_ids" not in choice and response.json()["usage"]["completion_tokens"] == 4
        assert engine.requests[-1].prompt_ids == (FIRST_WORD + 10, FIRST_WORD + 11)

        # the tokenizer's EOS stops generation, unless ignore_eos
        assert engine.requests[-1].stop_ids == (2,)
        await client.post("/v1/completions", json={"prompt": "w1", "ignore_eos": True, "stop_token_ids": [9]})
        assert engine.requests[-1].stop_ids == (9,)

        response = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "system", "content": "w1"}, {"role": "user", "content": [
                {"type": "text", "text": "w2 "}, {"type": "text", "text": "w3"}]}],
            "max_completion_tokens": 2, "return_token_ids": True})
        out = response.json()
        rendered = list(tokenizer("system : w1 user : w2 w3 assistant :", add_special_tokens=False)["input_ids"])
        assert out["object"] == "chat.completion" and out["prompt_token_ids"] == rendered
        choice = out["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": "w0 w1"} and choice["token_ids"] == [7, 8]

    serve(engine, tokenizer, body)


def test_streaming(tokenizer: PreTrainedTokenizerFast) -> None:
    async def body(client: httpx.AsyncClient) -> None:
        response = await client.post("/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 3, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response.text)
        assert events[-1] == "[DONE]"
        chunks, usage = events[:3], events[3]
        assert [c["choices"][0]["token_ids"] for c in chunks] == [[PROMPT[-1] + i] for i in (1, 2, 3)]
        assert chunks[0]["choices"][0]["prompt_token_ids"] == PROMPT
        assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
        assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
        assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3]
        assert usage["choices"] == [] and usage["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}
        assert "".join(c["choices"][0]["text"] for c in chunks) == words([PROMPT[-1] + i for i in (1, 2, 3)])

        response = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "w1"}], "max_tokens": 2, "stream": True})
        events = sse_events(response.text)
        assert events[-1] == "[DONE]" and all(e["object"] == "chat.completion.chunk" for e in events[:-1])
        deltas = [e["choices"][0]["delta"] for e in events[:-1]]
        assert deltas[0]["role"] == "assistant"
        assert "".join(d.get("content", "") for d in deltas) == "w0 w1"
        assert events[-2]["choices"][0]["finish_reason"] == "length"

    serve(FakeEngine(), tokenizer, body)


def test_failure_mid_stream_is_an_error_event(tokenizer: PreTrainedTokenizerFast) -> None:
    async def body(client: httpx.AsyncClient) -> None:
        response = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "stream": True})
        events = sse_events(response.text)
        assert events[-1] == "[DONE]" and "the fake engine broke" in events[-2]["error"]["message"]
        response = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5})
        assert response.status_code == 500 and "the fake engine broke" in response.json()["error"]["message"]

    serve(FakeEngine(fail_after=2), tokenizer, body)


def test_api_helpers(tokenizer: PreTrainedTokenizerFast) -> None:
    request = parse_chat_request({"messages": [{"role": "user", "content": "x"}],
                                  "planetserve": {"session_id": "abc:1", "hops": 1}})
    assert request.planetserve == PlanetServeOptions("abc:1", 1, False)
    assert request.max_tokens is None and request.temperature == 1.0

    decoder = SSEDecoder(max_event_bytes=64)
    assert decoder.feed(b"data: {\"a\":") == [] and decoder.pending
    assert decoder.feed(b" 1}\r\n: comment\r\nevent: x\n\ndata: [DONE]\n\n") == ['{"a": 1}', "[DONE]"]
    assert not decoder.pending
    with pytest.raises(SSEError, match="exceeds 64 bytes"):
        decoder.feed(b"data: " + b"x" * 100)

    text = TextAssembler(tokenizer, stop=["w3 w4"])
    pieces = [text.push([FIRST_WORD + i]) for i in range(6)]
    assert "".join(pieces) + text.finish() == "w0 w1 w2 " and text.stopped and text.consumed == 5


# -- RemoteEngine against scripted servers ----------------------------------------------------------


def vllm_chunk(ids: list[int], finish: str | None = None, prompt: list[int] | None = None) -> dict[str, Any]:
    """A chunk as vLLM's serving_completion.py dumps it (exclude_unset=False keeps the nulls)."""
    return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": [{
        "index": 0, "text": "x", "logprobs": None, "finish_reason": finish, "stop_reason": None,
        "prompt_token_ids": prompt, "token_ids": ids}], "usage": None}


def sse_body(*events: Any) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


def scripted(handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
             body: Callable[[RemoteEngine], Awaitable[None]], **options: Any) -> None:
    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        engine = RemoteEngine(f"http://127.0.0.1:{runner.addresses[0][1]}", "m", max_model_len=64, **options)
        try:
            await body(engine)
        finally:
            await engine.close()
            await runner.cleanup()

    run(main(), 60)


def stream_of(data: bytes, content_type: str = "text/event-stream", status: int = 200):
    async def handler(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=data, status=status, content_type=content_type)

    return handler


def recording(data: bytes) -> tuple[Any, dict[str, Any]]:
    """A handler answering `data` as an event stream, and the JSON of the request it last got."""
    seen: dict[str, Any] = {}

    async def handler(request: web.Request) -> web.Response:
        seen.update(await request.json())
        return web.Response(body=data, content_type="text/event-stream")

    return handler, seen


REQUEST = GenerationRequest((1, 2, 3), 4, stop_ids=(9,))


async def collect(engine: RemoteEngine, request: GenerationRequest = REQUEST) -> list[TokenChunk]:
    return [chunk async for chunk in engine.generate(request)]


def test_remote_engine_reads_a_vllm_stream() -> None:
    data = sse_body(
        vllm_chunk([5], prompt=[1, 2, 3]), vllm_chunk([6, 7]), vllm_chunk([9], "stop"),
        {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": [],
         "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                   "prompt_tokens_details": {"cached_tokens": 2}}},
        b"[DONE]",
    )
    handler, seen = recording(data)

    async def body(engine: RemoteEngine) -> None:
        assert await collect(engine) == [
            TokenChunk((5,), None, 3, 0), TokenChunk((6, 7)), TokenChunk((9,), "stop", 3, 2)]
        assert seen["prompt"] == [1, 2, 3] and seen["stop_token_ids"] == [9] and seen["ignore_eos"] is True
        assert seen["stream"] is True and seen["return_token_ids"] is True and "seed" not in seen
        assert engine.load() == EngineLoad(0, 0, 8)

    scripted(handler, body)


def test_without_a_count_from_the_server_the_mirror_counts_the_hit_as_vllm_does() -> None:
    prompt = list(range(32))
    data = sse_body(vllm_chunk([5], prompt=prompt), vllm_chunk([9], "stop"),
                    {"choices": [], "usage": {"prompt_tokens": 32, "completion_tokens": 2, "total_tokens": 34}},
                    b"[DONE]")

    async def body(engine: RemoteEngine) -> None:
        engine.mirror.apply([BlockStored((1, 2), None, tuple(prompt), 16)])
        assert engine.cached_prefix((*prompt, 99)) == 32
        assert engine.cached_prefix(tuple(range(40, 80))) == 0
        chunks = await collect(engine, GenerationRequest(tuple(prompt), 4, stop_ids=(9,)))
        assert [c.cached_tokens for c in chunks] == [0, 16]  # all cached: vLLM computes the last block again

    scripted(stream_of(data), body)


def with_logprobs(chunk: dict[str, Any], logprobs: Any) -> dict[str, Any]:
    chunk["choices"][0]["logprobs"] = logprobs
    return chunk


def vllm_logprobs(entries: list[tuple[int, float, dict[int, float]]]) -> dict[str, Any]:
    """vLLM's completion logprobs with `return_tokens_as_token_ids`: (token, logprob, alternatives)."""
    return {"tokens": [f"token_id:{t}" for t, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [{f"token_id:{a}": v for a, v in alts.items()} for _, _, alts in entries],
            "text_offset": list(range(len(entries)))}


def test_remote_engine_asks_for_logprobs_and_maps_them_back_by_token_id() -> None:
    data = sse_body(
        with_logprobs(vllm_chunk([5], prompt=[1, 2, 3]), vllm_logprobs([(5, -0.5, {5: -0.5, 8: -1.5})])),
        # the sampled token outside the top 2: vLLM adds it, the engine keeps the 2 likeliest
        with_logprobs(vllm_chunk([6]), vllm_logprobs([(6, -3.0, {7: -0.2, 6: -3.0, 4: -2.0})])),
        with_logprobs(vllm_chunk([9], "stop"), vllm_logprobs([(9, -0.1, {9: -0.1, 2: -4.0})])),
        b"[DONE]",
    )
    handler, seen = recording(data)

    async def body(engine: RemoteEngine) -> None:
        chunks = await collect(engine, GenerationRequest((1, 2, 3), 4, stop_ids=(9,), logprobs=2))
        assert [c.logprobs for c in chunks] == [
            (TokenLogprob(-0.5, ((5, -0.5), (8, -1.5))),), (TokenLogprob(-3.0, ((7, -0.2), (4, -2.0))),),
            (TokenLogprob(-0.1, ((9, -0.1), (2, -4.0))),)]
        assert seen["logprobs"] == 2 and seen["return_tokens_as_token_ids"] is True
        seen.clear()
        assert all(c.logprobs is None for c in await collect(engine)) and "logprobs" not in seen

    scripted(handler, body)


BROKEN_LOGPROBS: list[tuple[str, Any, str]] = [
    ("none", None, "sent no logprobs"),
    ("text tokens", {"tokens": ["x"], "token_logprobs": [-1.0], "top_logprobs": [{}]}, "not a token id"),
    ("other token", vllm_logprobs([(6, -1.0, {6: -1.0})]), "do not match its tokens"),
    ("too many alternatives", vllm_logprobs([(5, -1.0, {5: -1.0, 6: -2.0, 7: -3.0, 8: -4.0})]),
     "do not match its tokens"),
    ("positive", vllm_logprobs([(5, 1.0, {5: 1.0})]), "malformed log-probability"),
    ("short", {"tokens": [], "token_logprobs": [], "top_logprobs": []}, "do not match its tokens"),
]


@pytest.mark.parametrize(("logprobs", "message"), [case[1:] for case in BROKEN_LOGPROBS],
                         ids=[case[0] for case in BROKEN_LOGPROBS])
def test_remote_engine_rejects_malformed_logprobs(logprobs: Any, message: str) -> None:
    data = sse_body(with_logprobs(vllm_chunk([5]), logprobs), vllm_chunk([9], "stop"), b"[DONE]")

    async def body(engine: RemoteEngine) -> None:
        with pytest.raises(RemoteEngineError, match=re.escape(message)):
            await collect(engine, GenerationRequest((1, 2, 3), 4, stop_ids=(9,), logprobs=2))

    scripted(stream_of(data), body)


BROKEN_SERVERS: list[tuple[str, bytes, str, int, str]] = [
    ("openai error", json.dumps({"error": {"message": "overloaded now", "type": "server_error",
                                           "code": 503}}).encode(), "application/json", 503,
     "HTTP 503: overloaded now"),
    ("old vllm error", json.dumps({"object": "error", "message": "bad prompt", "type": "BadRequestError",
                                   "code": 400}).encode(), "application/json", 400, "HTTP 400: bad prompt"),
    ("plain error", b"<html>oops</html>", "text/html", 502, "HTTP 502: <html>oops</html>"),
    ("not a stream", b"{}", "application/json", 200, "not an event stream"),
    ("not json", sse_body(b"{nope"), "text/event-stream", 200, "not JSON"),
    ("not an object", sse_body([1]), "text/event-stream", 200, "not a JSON object"),
    ("no choices", sse_body({"usage": None}), "text/event-stream", 200, "without choices"),
    ("no token ids", sse_body({"choices": [{"index": 0, "text": "x"}]}), "text/event-stream", 200,
     "no token ids (does it support return_token_ids?)"),
    ("bad token ids", sse_body(vllm_chunk([-1])), "text/event-stream", 200, "malformed token ids"),
    ("other prompt", sse_body(vllm_chunk([5], prompt=[1, 2, 4])), "text/event-stream", 200,
     "different prompt"),
    ("second choice", sse_body({"choices": [{"index": 1, "token_ids": [1]}]}), "text/event-stream", 200,
     "other than index 0"),
    ("aborted", sse_body(vllm_chunk([5], "abort")), "text/event-stream", 200, "finished with 'abort'"),
    ("too many tokens", sse_body(vllm_chunk([5, 6, 7, 8, 9])), "text/event-stream", 200,
     "more tokens than max_tokens"),
    ("error event", sse_body(vllm_chunk([5]), {"error": {"message": "engine died", "code": 500}}),
     "text/event-stream", 200, "failed mid-stream: engine died"),
    ("cut off", sse_body(vllm_chunk([5])), "text/event-stream", 200, "ended before [DONE]"),
    ("no finish", sse_body(vllm_chunk([5]), b"[DONE]"), "text/event-stream", 200,
     "ended without a finish reason"),
    ("after finish", sse_body(vllm_chunk([5], "length"), vllm_chunk([6])), "text/event-stream", 200,
     "tokens after the finish reason"),
    ("endless", sse_body(*[vllm_chunk([]) for _ in range(20)]), "text/event-stream", 200,
     "more stream events than tokens"),
    ("huge event", b"data: " + b"x" * 5000, "text/event-stream", 200, "exceeds 4096 bytes"),
]


@pytest.mark.parametrize(("data", "content_type", "status", "message"),
                         [case[1:] for case in BROKEN_SERVERS], ids=[case[0] for case in BROKEN_SERVERS])
def test_remote_engine_rejects_broken_servers(data: bytes, content_type: str, status: int, message: str) -> None:
    async def body(engine: RemoteEngine) -> None:
        with pytest.raises(RemoteEngineError, match=re.escape(message)) as caught:
            await collect(engine)
        assert caught.value.status == (status if status != 200 else None)
        assert engine.load().running == 0

    scripted(stream_of(data, content_type, status), body, max_event_bytes=4096)


def test_remote_engine_local_checks_timeouts_and_load() -> None:
    release = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(sse_body(vllm_chunk([5], prompt=[1, 2, 3])))
        await release.wait()
        await response.write(sse_body(vllm_chunk([6], "length"), b"[DONE]"))
        return response

    async def body(engine: RemoteEngine) -> None:
        with pytest.raises(RemoteEngineError, match="exceeds the context length 64"):
            await collect(engine, GenerationRequest((1,) * 60, 5))
        with pytest.raises(RemoteEngineError, match="empty prompt"):
            await collect(engine, GenerationRequest((), 5))
        streams = [engine.generate(GenerationRequest((1, 2, 3), 2)) for _ in range(2)]
        assert [await anext(s) for s in streams] == [TokenChunk((5,), None, 3, 0)] * 2
        assert engine.load() == EngineLoad(1, 1, 1)
        with pytest.raises(RemoteEngineError, match="queue is full") as caught:
            await collect(engine, GenerationRequest((1, 2, 3), 2))
        assert caught.value.status == 503
        release.set()
        assert [[c async for c in s] for s in streams] == [[TokenChunk((6,), "length", 3, 0)]] * 2
        assert engine.load() == EngineLoad(0, 0, 1)

    scripted(handler, body, capacity=1, max_queued=1)

    async def stalled(request: web.Request) -> web.Response:
        await asyncio.sleep(1)
        return web.Response()

    async def times_out(engine: RemoteEngine) -> None:
        with pytest.raises(RemoteEngineError, match="timed out"):
            await collect(engine)

    scripted(stalled, times_out, read_timeout=0.3)

    async def compressed(request: web.Request) -> web.Response:
        return web.Response(body=b"\x1f\x8b", headers={"Content-Type": "text/event-stream",
                                                       "Content-Encoding": "gzip"})

    async def refuses_compression(engine: RemoteEngine) -> None:
        with pytest.raises(RemoteEngineError, match="only identity is accepted"):
            await collect(engine)

    scripted(compressed, refuses_compression)

    async def refused() -> None:
        engine = RemoteEngine("http://127.0.0.1:1", "m", max_model_len=64)
        with pytest.raises(RemoteEngineError, match="connection failed: ConnectError"):
            await collect(engine)
        await engine.close()

    run(refused(), 120)


# -- end to end -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return random_llama(vocab_size=VOCAB, hidden_size=64, layers=2, max_len=512, seed=99)


def test_end_to_end_builtin_engine_behind_http_and_zmq(model: torch.nn.Module,
                                                       tokenizer: PreTrainedTokenizerFast) -> None:
    block = 16
    prompt_a = tuple(FIRST_WORD + (i * 7) % 400 for i in range(40))
    prompt_b = tuple(FIRST_WORD + (i * 11) % 400 for i in range(37))

    async def main() -> None:
        engine = BuiltinEngine(model, "tiny-llama", block_size=block, max_batch=4)
        publisher = KVEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
        server = EngineServer(engine, tokenizer, kv_publisher=publisher)
        url = await server.start()
        remote = await RemoteEngine.connect(
            url, kv_events_endpoint=publisher.endpoint, kv_events_replay_endpoint=publisher.replay_endpoint,
            block_size=block, capacity=4)
        try:
            assert (remote.model_id, remote.max_model_len) == ("tiny-llama", 512)
            await asyncio.sleep(0.2)  # let the subscription reach the publisher
            request_a = GenerationRequest(prompt_a, 12)
            direct = [t async for c in engine.generate(request_a) for t in c.token_ids]
            chunks = [c async for c in remote.generate(request_a)]
            assert [t for c in chunks for t in c.token_ids] == direct
            assert len(chunks) > 1 and chunks[-1].finish_reason == "length"
            assert chunks[0].prompt_tokens == 40 and chunks[-1].cached_tokens == 32  # the direct run cached it

            request_b = GenerationRequest(prompt_b, 9, stop_ids=(direct[3],))
            via_remote = [t async for c in remote.generate(request_b) for t in c.token_ids]
            assert via_remote == [t async for c in engine.generate(request_b) for t in c.token_ids]

            # the prompts' full blocks reached the mirror through ZMQ, with the engine's own hashes
            await until(lambda: remote.mirror.match_length(prompt_a) >= 32 and remote.mirror.match_length(prompt_b) >= 32)
            assert remote.mirror.prefix(block_hashes(prompt_a, block)[1]) == prompt_a[:32]
            late: list[CacheEvent] = []
            remote.on_cache_events(late.extend)
            stored = {h for e in late if isinstance(e, BlockStored) for h in e.block_hashes}
            assert set(block_hashes(prompt_a, block)) <= stored
            assert set(block_hashes(prompt_b, block)) <= stored

            # streaming and chat through plain HTTP, text matching the token ids
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                response = await client.post("/v1/completions", json={
                    "model": "tiny-llama", "prompt": words(prompt_a[:20]), "max_tokens": 5, "temperature": 0,
                    "return_token_ids": True})
                choice = response.json()["choices"][0]
                assert choice["prompt_token_ids"] == list(prompt_a[:20])
                assert choice["text"] == tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
                response = await client.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": words(prompt_b[:10])}], "max_tokens": 4,
                    "temperature": 0, "stream": True, "return_token_ids": True})
                events = sse_events(response.text)
                assert events[-1] == "[DONE]" and len([t for e in events[:-1] for t in e["choices"][0]["token_ids"]]) == 4

            seeded = GenerationRequest(prompt_b, 6, temperature=0.8, seed=7)
            first = [t async for c in remote.generate(seeded) for t in c.token_ids]
            assert first == [t async for c in remote.generate(seeded) for t in c.token_ids]
        finally:
            await remote.close()
            await server.close()
            publisher.close()
            await engine.close()

    run(main(), 300)


def follow_cache_events(sync: CacheSync) -> Callable[[list[CacheEvent]], None]:
    """What a model node does with its engine's cache events: mirror them, tell its group."""
    mirror = PrefixMirror()

    def apply(events: list[CacheEvent]) -> None:
        for change in mirror.apply(events):
            if not change.token_ids:
                sync.cleared()
            elif change.added:
                sync.stored(change.token_ids)
            else:
                sync.removed(change.token_ids)

    return apply


@pytest.mark.parametrize("details", [True, False], ids=["with-prompt-tokens-details", "without"])
def test_a_repeated_prompt_reports_its_cached_tokens_and_a_hit_claimed_on_it_holds(
        model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, details: bool) -> None:
    """A node on a vLLM-shaped server that sends its cached-token count or not (vLLM's
    --enable-prompt-tokens-details) reports the same count for a repeated prompt, so the entry node that
    sent it the prompt as a cache hit does not count the hit as a false claim."""
    block = 16
    prompt = tuple(FIRST_WORD + (i * 13) % 400 for i in range(140))  # 8 full blocks and 12 tokens
    key = b"group-key-0123456789abcdef012345"

    async def main() -> None:
        engine = BuiltinEngine(model, "tiny-llama", block_size=block, max_batch=4)
        publisher = KVEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
        server = EngineServer(engine, tokenizer, kv_publisher=publisher, prompt_tokens_details=details)
        url = await server.start()
        remote = await RemoteEngine.connect(
            url, kv_events_endpoint=publisher.endpoint, kv_events_replay_endpoint=publisher.replay_endpoint,
            block_size=block)
        peer, entry = CacheSync("peer", key, incarnation=1), CacheSync("entry", key, incarnation=2)
        peer.add_peer("entry", now=0.0, trusted=True)
        entry.add_peer("peer", now=0.0, trusted=True)
        remote.on_cache_events(follow_cache_events(peer))
        try:
            request = GenerationRequest(prompt, 4)
            assert [c async for c in remote.generate(request)][-1].cached_tokens == 0
            await until(lambda: remote.cached_prefix(prompt) == 128)
            chunks = [c async for c in remote.generate(request)]
            assert chunks[-1].cached_tokens == 128

            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                response = await client.post("/v1/completions", json={
                    "model": "tiny-llama", "prompt": list(prompt), "max_tokens": 1})
            assert ("prompt_tokens_details" in response.json()["usage"]) == details

            # the entry node learns what the peer holds, sends it the prompt as a hit and checks the
            # claim against the count the peer's answer reports, as model_node.py does
            for message in peer.poll(1.0):
                entry.receive("peer", message, 1.0)
            claimed = entry.claimed_tokens("peer", prompt)
            assert claimed == 128
            for now in (1.1, 1.2, 1.3):
                assert not entry.check_claim("peer", claimed, chunks[-1].cached_tokens, now)
            assert entry.stats.false_claims == 0 and not entry.distrusts("peer", 1.3)
        finally:
            await remote.close()
            await server.close()
            publisher.close()
            await engine.close()

    run(main(), 300)
