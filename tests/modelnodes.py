"""Model nodes for tests: real engines over the quick family's gt, real TLS peer ports and HTTP APIs on
loopback, in one event loop. The group view is given directly (tests of the ledger path build it
from the verified list instead)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path

import httpx

from planetserve.chain.challenge import response_from_extension, response_valid
from planetserve.chain.keys import KeySet
from planetserve.genesis.network import free_ports
from planetserve.models import load
from planetserve.node.api.openai import ApiError, overloaded
from planetserve.node.engine.builtin import BuiltinEngine
from planetserve.node.home import ModelNodeConfig
from planetserve.node.model_node import Job, ModelNode
from planetserve.node.routing.group import GroupView
from planetserve.registry.entities import ModelNode as NodeRecord
from planetserve.registry.epochs import SignedResponse

SHARED = ("The committee keeps a ledger of every model node, and each node answers questions about "
          "the standard library of the language in plain words. ") * 3


def config(**overrides: object) -> ModelNodeConfig:
    http, peer = free_ports(2)
    base = ModelNodeConfig(org_id="acme", model_id="gt", http=f"127.0.0.1:{http}",
                           peer=f"127.0.0.1:{peer}", capacity=2, max_prompt_tokens=400,
                           cache_tokens=4096, delta_interval=0.05, load_interval=0.1, sync_interval=1.0)
    return replace(base, **overrides)  # type: ignore[arg-type]


def make_node(data: Path, cls: type[ModelNode] = ModelNode, **overrides: object) -> ModelNode:
    cfg = config(**overrides)
    loaded = load("gt", data_dir=data)
    engine = BuiltinEngine(loaded.model, cfg.model_id, block_size=cfg.block_size,
                           max_batch=cfg.capacity, cache_capacity_tokens=cfg.cache_tokens)
    return cls(cfg, KeySet.generate(), engine, loaded.tokenizer, vocab_size=engine.vocab_size,
                     eos_ids=loaded.stop_token_ids, group=None)


class PartlyCheapNode(ModelNode):
    """Serves the requests `cheats` picks with `cheap` (a smaller model's engine: `cheap_engine`), and the
    rest with the model it registered."""

    cheap: BuiltinEngine | None = None

    def cheats(self, job: Job) -> bool:
        return False

    def _local(self, job, prompt_ids, generation, route_reason):  # type: ignore[no-untyped-def]
        if self.cheap is None or not self.cheats(job):
            return super()._local(job, prompt_ids, generation, route_reason)
        registered, self.engine = self.engine, self.cheap
        try:
            return super()._local(job, prompt_ids, generation, route_reason)
        finally:
            self.engine = registered


class TippedNode(PartlyCheapNode):
    """Answers the prompts it was told (by a colluding member) with the model it registered; every other
    request, users' and re-challenges alike, with `cheap` or, without one, not at all (`refusal`: by
    default 503, as an overloaded node would)."""

    told: set[str]
    refusal: Callable[[], ApiError] = staticmethod(overloaded)

    def cheats(self, job: Job) -> bool:
        return job.prompt not in self.told

    async def produce(self, job, prompt_ids, generation, options, *, whole=False):  # type: ignore[no-untyped-def]
        if job.prompt not in self.told and self.cheap is None:
            raise self.refusal()
        return await super().produce(job, prompt_ids, generation, options, whole=whole)


def cheap_engine(data: Path, node: ModelNode) -> BuiltinEngine:
    """The quick family's tiny, served under gt's name with `node`'s engine settings."""
    tiny = load("tiny", data_dir=data)
    return BuiltinEngine(tiny.model, "gt", block_size=node.config.block_size, max_batch=node.config.capacity,
                         cache_capacity_tokens=node.config.cache_tokens)


def view(nodes: Iterable[ModelNode], height: int = 1) -> GroupView:
    members = {n.keys.public: NodeRecord(n.keys.public, "acme", "gt", n.config.address, "cpu", n.config.capacity,
                                         "global", "active", 1) for n in nodes}
    return GroupView(height, members)


async def complete(node: ModelNode, prompt: str, max_tokens: int = 8, **extra: object) -> httpx.Response:
    async with httpx.AsyncClient(timeout=60) as client:
        return await client.post(f"{node.http_url}/v1/completions",
                                 json={"model": "gt", "prompt": prompt, "max_tokens": max_tokens,
                                       "temperature": 0, **extra})


async def streamed(node: ModelNode, prompt: str, max_tokens: int = 8, **extra: object) -> list[str]:
    """The data of every server-sent event of a streamed completion, in order (the last is "[DONE]")."""
    async with httpx.AsyncClient(timeout=60) as client, client.stream(
            "POST", f"{node.http_url}/v1/completions",
            json={"model": "gt", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                  **extra}) as response:
        assert response.status_code == 200, await response.aread()
        return [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]


def signed(answer: dict) -> SignedResponse:
    """The answer's signed response, checked: a valid signature over exactly the returned text."""
    text = answer["choices"][0].get("text", answer["choices"][0].get("message", {}).get("content"))
    response = response_from_extension(answer.get("planetserve"), text)
    assert response_valid(response), "the answer's signature does not verify"
    return response
