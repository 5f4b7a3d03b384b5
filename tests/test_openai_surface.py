"""The OpenAI surface as the `openai` client sees it, on an engine server over the quick gt:
`/v1/models/{id}`, `max_model_len` in the model objects, and every error in OpenAI's shape, unknown
paths and methods included."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI
from waiting import run

from planetserve.models import load
from planetserve.models.loading import LoadedModel
from planetserve.node.api.engine_server import EngineServer
from planetserve.node.engine.builtin import BuiltinEngine

MODEL = "planetserve/gt"
"""Served under a name with a slash, as a real model id has, so /v1/models/{id} must take it."""


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


def extra(obj: Any, name: str) -> Any:
    """A vLLM extension field of an openai response object."""
    return (obj.model_extra or {})[name]



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
