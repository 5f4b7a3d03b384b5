"""A user relay's forwarding for other users: onion setup, then table lookups only.

Peer messages between relays (one-way, over `transport`):
  "setup" [link id, packet]   builds a path hop by hop; the packet is peeled here (`onion`)
  "fwd"   [link id, sealed]   toward the proxy, which opens (destination, data) with the path key and
                              sends data to the model node `destination`, any registered active one,
                              trusted or not (empty: a ping, echoed)
  "back"  [link id, sealed]   toward the user: (kind, data), kind "ready", "pong", "clove", or
                              "unreachable" (the proxy could not reach the model node named)
  "down"  [link id]           the path is gone (sent both ways when a neighbour disappears)
and between a proxy and model nodes:
  "clove" data                    proxy → model node: one clove of a prompt
  "reply" [reply id, data]        model node → proxy: one clove of an answer

A relay stores, per path, only (predecessor, link id in) ↔ (successor, link id out), or at the proxy
the reply id and path key; link ids are random per link and payloads are sealed per path, so relays on
different paths, or on different links of one path, hold and see nothing in common.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from planetserve.node.overlay import onion
from planetserve.node.overlay.transport import TransportError

log = logging.getLogger(__name__)

MAX_HOPS_STORED = 20_000
HOP_IDLE_SECONDS = 900.0
REPLAY_MEMORY = 65_536
MAX_PING = 64

Send = Callable[[bytes, str, Any], Awaitable[None]]


class PathOwner(Protocol):
    """The user side of this relay: paths that start here are not in the relay's table."""

    def deliver(self, peer: bytes, link_id: bytes, sealed: bytes) -> bool: ...
    def path_down(self, peer: bytes, link_id: bytes) -> bool: ...


@dataclass
class Hop:
    """What this relay knows of one path through it."""

    pred: bytes
    in_id: bytes
    succ: bytes | None
    out_id: bytes | None
    reply_id: bytes | None
    key: bytes | None = field(default=None, repr=False)
    """The path key (the proxy only)."""
    used: float = field(default_factory=time.monotonic)


class RelayError(Exception):
    """A malformed or unroutable path message (the sender is a listed user, but that is all)."""


def _link(value: Any) -> bytes:
    if type(value) is not bytes or len(value) != onion.ID_SIZE:
        raise RelayError("link id must be 16 bytes")
    return value


class Relay:
    def __init__(self, secret: bytes, send: Send, *, is_user: Callable[[bytes], bool],
                 is_node: Callable[[bytes], bool], owner: PathOwner | None = None,
                 max_hops: int = MAX_HOPS_STORED) -> None:
        self.secret = secret
        self.send = send
        self.is_user = is_user
        self.is_node = is_node
        self.owner = owner
        self.max_hops = max_hops
        self.forward: dict[tuple[bytes, bytes], Hop] = {}
        self.backward: dict[tuple[bytes, bytes], Hop] = {}
        self.replies: dict[bytes, Hop] = {}
        self.seen: OrderedDict[bytes, None] = OrderedDict()
        self.counters = {"setups": 0, "proxied": 0, "forwarded": 0, "returned": 0, "to_nodes": 0,
                         "refused": 0, "unknown_path": 0, "send_failures": 0}

    @property
    def hops(self) -> list[Hop]:
        return list(self.forward.values())

    # -- dispatch ------------------------------------------------------------------------------------

    async def handle(self, peer: bytes, msg_type: str, body: Any) -> None:
        """A path message from `peer`; malformed ones are counted and dropped."""
        try:
            if msg_type == "reply":
                if not self.is_node(peer):
                    raise RelayError("only model nodes send replies")
                await self._on_reply(body)
            elif not self.is_user(peer):
                raise RelayError(f"{msg_type} from a key that is not a listed user")
            elif msg_type == "setup":
                await self._on_setup(peer, body)
            elif msg_type == "fwd":
                await self._on_fwd(peer, body)
            elif msg_type == "back":
                await self._on_back(peer, body)
            elif msg_type == "down":
                await self._on_down(peer, body)
            else:
                raise RelayError(f"unknown message type {msg_type!r}")
        except (RelayError, onion.OnionError) as exc:
            self.counters["refused"] += 1
            log.info("refused %s from %s: %s", msg_type, peer.hex()[:16], exc)

    async def _pass_on(self, peer: bytes, msg_type: str, body: Any) -> bool:
        try:
            await self.send(peer, msg_type, body)
            return True
        except TransportError as exc:
            self.counters["send_failures"] += 1
            log.debug("%s to %s failed: %s", msg_type, peer.hex()[:16], exc)
            return False

    # -- setup ---------------------------------------------------------------------------------------

    async def _on_setup(self, peer: bytes, body: Any) -> None:
        if not (isinstance(body, list) and len(body) == 2 and type(body[1]) is bytes):
            raise RelayError("setup is [link id, packet]")
        in_id, packet = _link(body[0]), body[1]
        if (peer, in_id) in self.forward:
            raise RelayError("link id already in use")
        if len(self.forward) >= self.max_hops:
            self.expire()
            if len(self.forward) >= self.max_hops:
                raise RelayError("relay is carrying its maximum number of paths")
        ephemeral = packet[:onion.KEY_SIZE]
        if ephemeral in self.seen:
            raise RelayError("replayed setup packet")
        layer, inner = onion.peel(self.secret, packet)
        self._remember(ephemeral)
        self.counters["setups"] += 1
        if layer.is_proxy:
            hop = Hop(peer, in_id, None, None, layer.reply_id, layer.path_key)
            if layer.reply_id in self.replies:
                raise RelayError("reply id already in use")
            self._store(hop)
            await self._back(hop, "ready", layer.token)
            return
        if not self.is_user(layer.next_key):
            await self._pass_on(peer, "down", [in_id])
            raise RelayError("next relay is not a listed user")
        hop = Hop(peer, in_id, layer.next_key, layer.out_id, None)
        self._store(hop)
        if not await self._pass_on(layer.next_key, "setup", [layer.out_id, inner]):
            self._drop(hop)
            await self._pass_on(peer, "down", [in_id])

    def _remember(self, ephemeral: bytes) -> None:
        self.seen[ephemeral] = None
        while len(self.seen) > REPLAY_MEMORY:
            self.seen.popitem(last=False)

    def _store(self, hop: Hop) -> None:
        self.forward[(hop.pred, hop.in_id)] = hop
        if hop.succ is not None and hop.out_id is not None:
            self.backward[(hop.succ, hop.out_id)] = hop
        if hop.reply_id is not None:
            self.replies[hop.reply_id] = hop

    def _drop(self, hop: Hop) -> None:
        self.forward.pop((hop.pred, hop.in_id), None)
        if hop.succ is not None and hop.out_id is not None:
            self.backward.pop((hop.succ, hop.out_id), None)
        if hop.reply_id is not None:
            self.replies.pop(hop.reply_id, None)

    # -- traffic -------------------------------------------------------------------------------------

    async def _back(self, hop: Hop, kind: str, data: bytes) -> None:
        """Originate a payload toward the user (we are its proxy)."""
        assert hop.key is not None
        sealed = onion.seal_payload(hop.key, onion.BACKWARD, kind, data)
        await self._pass_on(hop.pred, "back", [hop.in_id, sealed])

    async def _on_fwd(self, peer: bytes, body: Any) -> None:
        if not (isinstance(body, list) and len(body) == 2 and type(body[1]) is bytes):
            raise RelayError("fwd is [link id, sealed payload]")
        hop = self.forward.get((peer, _link(body[0])))
        if hop is None:
            self.counters["unknown_path"] += 1
            await self._pass_on(peer, "down", [body[0]])
            return
        hop.used = time.monotonic()
        if hop.succ is not None:
            self.counters["forwarded"] += 1
            await self._pass_on(hop.succ, "fwd", [hop.out_id, body[1]])
            return
        assert hop.key is not None
        destination, data = onion.open_payload(hop.key, onion.FORWARD, body[1])
        if not destination:
            if len(data) > MAX_PING:
                raise RelayError("ping too long")
            await self._back(hop, "pong", data)
        elif type(destination) is bytes and self.is_node(destination):
            self.counters["to_nodes"] += 1
            if not await self._pass_on(destination, "clove", data):
                await self._back(hop, "unreachable", destination)
        else:
            raise RelayError("destination is not a registered model node")

    async def _on_reply(self, body: Any) -> None:
        if not (isinstance(body, list) and len(body) == 2 and type(body[1]) is bytes):
            raise RelayError("reply is [reply id, clove]")
        hop = self.replies.get(_link(body[0]))
        if hop is None:
            self.counters["unknown_path"] += 1
            return
        hop.used = time.monotonic()
        self.counters["proxied"] += 1
        await self._back(hop, "clove", body[1])

    async def _on_back(self, peer: bytes, body: Any) -> None:
        if not (isinstance(body, list) and len(body) == 2 and type(body[1]) is bytes):
            raise RelayError("back is [link id, sealed payload]")
        link = _link(body[0])
        hop = self.backward.get((peer, link))
        if hop is not None:
            hop.used = time.monotonic()
            self.counters["returned"] += 1
            await self._pass_on(hop.pred, "back", [hop.in_id, body[1]])
        elif self.owner is None or not self.owner.deliver(peer, link, body[1]):
            self.counters["unknown_path"] += 1

    async def _on_down(self, peer: bytes, body: Any) -> None:
        if not (isinstance(body, list) and len(body) == 1):
            raise RelayError("down is [link id]")
        link = _link(body[0])
        hop = self.forward.get((peer, link)) or self.backward.get((peer, link))
        if hop is not None:
            await self._tear_down(hop, peer)
        elif self.owner is not None:
            self.owner.path_down(peer, link)

    async def _tear_down(self, hop: Hop, gone: bytes) -> None:
        """Forget a path whose neighbour `gone` left it, and tell the neighbour on the other side."""
        self._drop(hop)
        if hop.pred == gone and hop.succ is not None:
            await self._pass_on(hop.succ, "down", [hop.out_id])
        elif hop.succ == gone:
            await self._pass_on(hop.pred, "down", [hop.in_id])

    # -- upkeep --------------------------------------------------------------------------------------

    async def peer_closed(self, peer: bytes) -> None:
        """Tear down every path through a neighbour that disappeared, telling the other side."""
        for hop in [h for h in self.forward.values() if peer in (h.pred, h.succ)]:
            await self._tear_down(hop, peer)

    def expire(self, now: float | None = None) -> int:
        """Forget paths unused for HOP_IDLE_SECONDS (their users keep live ones busy with pings)."""
        cutoff = (time.monotonic() if now is None else now) - HOP_IDLE_SECONDS
        stale = [h for h in self.forward.values() if h.used < cutoff]
        for hop in stale:
            self._drop(hop)
        return len(stale)
