"""An overlay on loopback for tests: user relays and model nodes in one event loop, every link real TLS,
the directory (verified user and node lists) given directly; tests of the ledger path read it from the
chain instead."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace

import httpx
from modelnodes import free_port, make_node, view

from planetserve.chain.keys import KeySet
from planetserve.node.directory import DirectoryView
from planetserve.node.home import UserConfig
from planetserve.node.model_node import ModelNode
from planetserve.node.paths import PathSettings
from planetserve.node.user import UserRelay
from planetserve.registry.entities import ModelNode as NodeRecord
from planetserve.registry.entities import User

FAST = PathSettings(target=4, setup_timeout=3.0, ping_interval=0.5, ping_timeout=1.0, misses_allowed=1)


def user_config(**overrides: object) -> UserConfig:
    base = UserConfig(http=f"127.0.0.1:{free_port()}", peer=f"127.0.0.1:{free_port()}", proxies=4,
                      response_timeout=30.0)
    return replace(base, **overrides)  # type: ignore[arg-type]


def make_user(cls: type[UserRelay] = UserRelay, settings: PathSettings = FAST, **overrides: object) -> UserRelay:
    return cls(user_config(**overrides), KeySet.generate(), None, settings=settings)


def directory(users: Iterable[UserRelay], nodes: Iterable[ModelNode], height: int = 1) -> DirectoryView:
    return DirectoryView.of(
        height,
        [User(u.keys.public, u.config.address, "global", 0, 1 << 40) for u in users],
        [NodeRecord(n.keys.public, "acme", n.config.model_id, n.config.address, "cpu", n.config.capacity,
                    "global", "active", 1) for n in nodes])


@dataclass
class Overlay:
    users: list[UserRelay]
    nodes: list[ModelNode]
    height: int = 1

    @property
    def client(self) -> UserRelay:
        return self.users[0]

    def publish(self, users: list[UserRelay] | None = None) -> None:
        """Give everyone the current directory (as a new verified list would)."""
        self.height += 1
        listed = self.users if users is None else users
        dir_view = directory(listed, self.nodes, self.height)
        for user in self.users:
            user.apply_view(dir_view)
        for node in self.nodes:
            node.apply_users(dir_view)

    async def close(self) -> None:
        for user in self.users:
            await user.close()
        for node in self.nodes:
            await node.close()
            await node.engine.close()


async def start_overlay(data, users: list[UserRelay], model_nodes: int) -> Overlay:
    nodes = [make_node(data) for _ in range(model_nodes)]
    overlay = Overlay(users, nodes)
    for node in nodes:
        await node.start()
    group = view(nodes)
    for node in nodes:
        node.apply_view(group)
    for user in users:
        await user.start(serve_http=user is users[0])
    overlay.publish()
    overlay.client.start_paths()
    assert await overlay.client.paths.wait_live(overlay.client.paths.settings.target, 20), \
        overlay.client.paths.last_error
    return overlay


async def wait_until(predicate, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.05)


async def chat(user: UserRelay, content: str, *, stream: bool = False, max_tokens: int = 8,
               **extra: object) -> httpx.Response:
    async with httpx.AsyncClient(timeout=60) as client:
        return await client.post(f"{user.http_url}/v1/chat/completions", json={
            "model": "gt", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream, **extra})
