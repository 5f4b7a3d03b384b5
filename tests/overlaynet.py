"""An overlay on loopback for tests: user relays and model nodes in one event loop, every link real TLS,
the directory (verified user and node lists) given directly; tests of the ledger path read it from the
chain instead. Nodes can be trusted (in the signed list) or only registered (left the list, still
reachable by a request that names them)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import httpx
from modelnodes import make_node, view

from planetserve.chain.keys import KeySet
from planetserve.node.home import UserConfig
from planetserve.node.model_node import ModelNode
from planetserve.node.overlay.directory import DirectoryView
from planetserve.node.overlay.paths import Path, PathSettings
from planetserve.node.overlay.relay import Relay
from planetserve.node.user import UserRelay
from planetserve.registry.entities import ModelNode as NodeRecord
from planetserve.registry.entities import User

CLOSE_TIMEOUT_S = 30.0
FAST = PathSettings(target=4, setup_timeout=3.0, ping_interval=0.5, ping_timeout=1.0, misses_allowed=1)


def user_config(**overrides: object) -> UserConfig:
    base = UserConfig(http="127.0.0.1:0", peer="127.0.0.1:0", proxies=4, response_timeout=30.0)
    return replace(base, **overrides)  # type: ignore[arg-type]


def make_user(cls: type[UserRelay] = UserRelay, settings: PathSettings = FAST, **overrides: object) -> UserRelay:
    return cls(user_config(**overrides), KeySet.generate(), None, settings=settings)


def record(node: ModelNode, status: str = "active") -> NodeRecord:
    return NodeRecord(node.keys.public, "acme", node.config.model_id, node.config.address, "cpu",
                      node.config.capacity, "global", status, 1)


def directory(users: Iterable[UserRelay], nodes: Iterable[ModelNode], height: int = 1,
              registered: Iterable[ModelNode] = ()) -> DirectoryView:
    """Trusted `nodes`; `registered` ones are registered but not in the trusted list."""
    return DirectoryView.of(
        height, [User(u.keys.public, u.config.address, "global", 0, 1 << 40) for u in users],
        [record(n) for n in nodes], [record(n) for n in registered])


class FaultyRelay(Relay):
    """A relay that misbehaves on command: flips a bit of, drops, or holds back for `DELAY_S` what it
    carries back toward users, sparing small payloads (pings) as a careful adversary would."""

    mode: str | None = None
    DELAY_S = 5.0

    async def _pass_on(self, peer: bytes, msg_type: str, body: object) -> bool:
        if self.mode in ("flip", "drop", "delay") and msg_type == "back" and len(body[1]) > 200:  # type: ignore[index]
            if self.mode == "drop":
                return True
            if self.mode == "delay":
                await asyncio.sleep(self.DELAY_S)
                return await super()._pass_on(peer, msg_type, body)
            data = bytearray(body[1])  # type: ignore[index]
            data[len(data) // 2] ^= 0x01  # not the last bytes, which the next relay cuts (`onion.wrap_backward`)
            body = [body[0], bytes(data)]  # type: ignore[index]
        return await super()._pass_on(peer, msg_type, body)

    async def _back(self, hop, kind: str, data: bytes, reply_id: bytes = b"") -> None:  # type: ignore[no-untyped-def]
        if self.mode == "flip-at-proxy" and kind == "clove":
            data = data[:-1] + bytes([data[-1] ^ 0x01])
        await super()._back(hop, kind, data, reply_id)


def faulty(user: UserRelay) -> UserRelay:
    """The same user relay, but with a relay part that can be told to misbehave."""
    old = user.relay
    user.relay = FaultyRelay(old.secret, old.send, is_user=old.is_user, is_node=old.is_node, owner=old.owner)
    return user


def relays_on_one_path(user: UserRelay) -> dict[bytes, Path]:
    """Relays that carry exactly one of the user's live paths, with that path."""
    seen: dict[bytes, list[Path]] = {}
    for path in user.paths.live():
        for relay in path.route:
            seen.setdefault(relay, []).append(path)
    return {relay: paths[0] for relay, paths in seen.items() if len(paths) == 1}


@dataclass
class Overlay:
    users: list[UserRelay]
    nodes: list[ModelNode]
    """Trusted model nodes."""
    untrusted: list[ModelNode] = field(default_factory=list)
    """Registered model nodes outside the trusted list."""
    height: int = 1

    @property
    def client(self) -> UserRelay:
        return self.users[0]

    def user(self, key: bytes) -> UserRelay:
        return next(u for u in self.users if u.keys.public == key)

    def publish(self, users: list[UserRelay] | None = None) -> None:
        """Give everyone the current directory (as a new verified list would)."""
        self.height += 1
        listed = self.users if users is None else users
        dir_view = directory(listed, self.nodes, self.height, self.untrusted)
        for user in self.users:
            user.apply_view(dir_view)
        for node in [*self.nodes, *self.untrusted]:
            node.apply_users(dir_view)

    async def close(self) -> None:
        """Close everything; a part that does not close within CLOSE_TIMEOUT_S is named in the error
        rather than left to hang the test run."""
        stuck = []
        parts = [(f"user {u.keys.public.hex()[:8]}", u.close) for u in self.users]
        for node in [*self.nodes, *self.untrusted]:
            parts += [(f"node {node.node_id[:8]}", node.close), (f"engine {node.node_id[:8]}", node.engine.close)]
        for name, close in parts:
            try:
                await asyncio.wait_for(close(), CLOSE_TIMEOUT_S)
            except TimeoutError:
                stuck.append(name)
        assert not stuck, f"did not close within {CLOSE_TIMEOUT_S:g} s: {stuck}"


async def start_overlay(data, users: list[UserRelay], model_nodes: int, untrusted: int = 0) -> Overlay:
    """`model_nodes` trusted nodes in one group, and `untrusted` registered ones that read the same
    group (the trusted list) without being in it."""
    overlay = Overlay(users, [make_node(data) for _ in range(model_nodes)],
                      [make_node(data) for _ in range(untrusted)])
    everyone = [*overlay.nodes, *overlay.untrusted]
    for node in everyone:
        await node.start()
    group = view(overlay.nodes)
    for node in everyone:
        node.apply_view(group)
    for user in users:
        await user.start(serve_http=user is users[0])
    overlay.publish()
    overlay.client.start_paths()
    assert await overlay.client.paths.wait_live(overlay.client.paths.settings.target, 20), \
        overlay.client.paths.last_error
    return overlay


async def start_apart(nodes: list[ModelNode], users: int = 6) -> Overlay:
    """`users` relays (the first serving HTTP, with its paths live) to `nodes`, each node in a group of its
    own: none forwards to another, so the node a request names is the one that computes it."""
    overlay = Overlay([make_user() for _ in range(users)], nodes)
    for node in nodes:
        await node.start()
        node.apply_view(view([node]))
    for user in overlay.users:
        await user.start(serve_http=user is overlay.users[0])
    overlay.publish()
    overlay.client.start_paths()
    assert await overlay.client.paths.wait_live(overlay.client.paths.settings.target, 20), \
        overlay.client.paths.last_error
    return overlay


async def chat(user: UserRelay, content: str, *, stream: bool = False, max_tokens: int = 8,
               **extra: object) -> httpx.Response:
    async with httpx.AsyncClient(timeout=60) as client:
        return await client.post(f"{user.http_url}/v1/chat/completions", json={
            "model": "gt", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream, **extra})
