"""A user relay's forwarding for other users: onion setup, then table lookups only.

Peer messages between relays (one-way, over `transport`):
  "setup" [link id, packet]   builds a path hop by hop; the packet is peeled here (`onion`)
  "fwd"   [link id, sealed]   toward the proxy: each relay removes its hop layer and appends filler
                              (the payload keeps its length, `onion.unwrap_forward`); the proxy opens
                              (destination, data, reply id) with the path key, keeps the reply id for
                              the answer and sends data to the model node `destination`, any registered
                              active one, trusted or not (empty: a ping, echoed)
  "back"  [link id, sealed]   toward the user, each relay adding its hop layer around all but the last
                              bytes it received (the payload keeps its length, `onion.wrap_backward`):
                              (kind, data, reply id), kind "ready", "pong", "clove" (with the reply
                              id it came under), or
                              "unreachable" (the proxy could not reach the model node named, or
                              found no registered one of that key even after reading the lists again)
  "down"  [link id]           the path is gone (sent both ways when a neighbour disappears)
and between a proxy and model nodes:
  "clove" data                    proxy → model node: one clove of a prompt
  "reply" [reply id, data]        model node → proxy: one clove of an answer

A relay stores, per path, only (predecessor, link id in) ↔ (successor, link id out) and its hop key,
or at the proxy the path key and the reply ids of the requests in flight; link ids are random per link,
reply ids random per request and path, and payloads are sealed per path and re-encrypted at every hop,
so relays on different paths, or on different links of one path, hold and see nothing in common, and
no reply id names a path for longer than its requests last.

What a relay holds for others is bounded, per previous-hop peer as well as in all, and a setup is
refused before anything is stored (the refusal goes back as "down" [link id], so the user rebuilds over
other relays at once):
- the path table: at most `max_hops` paths (20,000) and at most `max_hops_per_peer` (256) whose
  predecessor is one peer. Entries are of one fixed size (two keys, two ids, a hop or path key) but for
  a proxy's reply ids, bounded below, so a bound in entries is a bound in bytes. An honest user keeps
  N = `proxies` paths (5 by default, each built once and torn down with "down" when replaced), and its
  paths avoid each other's relays, so as a first hop a relay holds about N of one user's paths; as a
  later hop it holds the paths that one neighbour forwards, about 2·N·U / R² of them with U users over
  R relays (under 10 for U ≈ R). 256 leaves a wide margin for small lists, where every path crosses
  the same few relays, and for replaced paths whose "down" was lost (they expire after 15 idle
  minutes), while one key fills at most 1/78 of the table.
- the replay cache of setups' ephemeral keys: a layer carries the time it was built (`onion`), and a
  setup is accepted only from SETUP_MAX_AGE (60 s) before to SETUP_MAX_AHEAD (15 s) after this relay's
  clock. An ephemeral key is remembered until its setup leaves that window and is never evicted before:
  a replay is refused as a replay inside the window and as stale after it, so the cache cannot be
  flushed. A setup issued up to SETUP_MAX_AGE past the window (a user's clock ahead) is refused and
  remembered too, so that a capture of it is refused again once it enters the window. At most
  `max_setups_per_peer` (512) remembered setups come from one peer, at most `replay_memory` (65,536)
  in all; past either, setups are refused (the cache fails closed, never
  evicting). 512 in 75 s is about 7 setups a second from one neighbour, far above what an honest user
  (N paths, rebuilt on failure) or a forwarding relay sends.
- the proxy's reply ids (16 bytes each, one per request and path, registered by the prompt clove they
  come with): at most `MAX_REPLIES_PER_PATH` (256) per path, where a new one replaces the path's least
  recently used (the path's own user is the only one it can cost); at most `max_replies_per_peer`
  (4,096) over the paths of one previous-hop peer and `max_replies` (65,536) in all, past which the clove
  is refused before anything is stored. A reply id unused for REPLY_IDLE_SECONDS (180 s, beyond the
  users' default 120 s wait for an answer's next part) is forgotten.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from planetserve.node.overlay import onion
from planetserve.node.overlay.replay import ReplayWindow
from planetserve.node.overlay.transport import TransportError

log = logging.getLogger(__name__)

MAX_HOPS_STORED = 20_000
MAX_HOPS_PER_PEER = 256
HOP_IDLE_SECONDS = 900.0
REPLAY_MEMORY = 65_536
MAX_SETUPS_PER_PEER = 512
SETUP_MAX_AGE = 60.0
SETUP_MAX_AHEAD = 15.0
MAX_PING = 64
EXPIRE_EVERY = 1.0
"""Seconds between two sweeps of the whole table when it is full (each sweep reads every path)."""
MAX_REPLIES = 65_536
MAX_REPLIES_PER_PEER = 4_096
MAX_REPLIES_PER_PATH = 256
REPLY_IDLE_SECONDS = 180.0

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
    key: bytes = field(repr=False)
    """The hop key that re-encrypts this hop's payloads (a relay), the path key (the proxy)."""
    used: float = field(default_factory=time.monotonic)
    replies: OrderedDict[bytes, float] = field(default_factory=OrderedDict, repr=False)
    """The proxy's reply ids for this path, least recently used first, with when each was last used."""


class RelayError(Exception):
    """A malformed or unroutable path message (the sender is a listed user, but that is all)."""

    counter = "refused"


class Refused(RelayError):
    """A well-formed setup this relay will not take: a limit is reached, or it is a replay or stale.
    The sender is told with "down" [link id]."""

    def __init__(self, message: str, counter: str) -> None:
        super().__init__(message)
        self.counter = counter


def _link(value: Any) -> bytes:
    if type(value) is not bytes or len(value) != onion.ID_SIZE:
        raise RelayError("link id must be 16 bytes")
    return value


class Relay:
    def __init__(self, secret: bytes, send: Send, *, is_user: Callable[[bytes], bool],
                 is_node: Callable[[bytes], bool], knock: Callable[[bytes], Awaitable[None]] | None = None,
                 owner: PathOwner | None = None,
                 max_hops: int = MAX_HOPS_STORED, max_hops_per_peer: int = MAX_HOPS_PER_PEER,
                 replay_memory: int | None = None, max_setups_per_peer: int = MAX_SETUPS_PER_PEER,
                 max_replies: int = MAX_REPLIES, max_replies_per_peer: int = MAX_REPLIES_PER_PEER,
                 clock: Callable[[], float] = time.time) -> None:
        self.secret = secret
        self.send = send
        self.is_user = is_user
        self.is_node = is_node
        self.knock = knock
        """Reads the lists again if the ledger holds the key (`directory.Knocks`): a node registered or
        rotated to its key since the last read is a destination already."""
        self.owner = owner
        self.max_hops = max_hops
        self.max_hops_per_peer = max_hops_per_peer
        self.max_setups_per_peer = max_setups_per_peer
        self.max_replies = max_replies
        self.max_replies_per_peer = max_replies_per_peer
        self.forward: dict[tuple[bytes, bytes], Hop] = {}
        self.backward: dict[tuple[bytes, bytes], Hop] = {}
        self.replies: dict[bytes, Hop] = {}
        """The proxy's reply ids in all, and the path each answers on."""
        self.replies_by_peer: dict[bytes, int] = {}
        """Reply ids per previous-hop peer of their paths."""
        self.by_peer: dict[bytes, dict[tuple[bytes, bytes], Hop]] = {}
        """Paths by predecessor: what each peer holds in the table."""
        self.seen = ReplayWindow(SETUP_MAX_AGE, SETUP_MAX_AHEAD,
                                 REPLAY_MEMORY if replay_memory is None else replay_memory, clock)
        """Replay cache: setups' ephemeral keys, by the peer that sent them, while within the window."""
        self._swept = float("-inf")
        self.counters = {"setups": 0, "proxied": 0, "forwarded": 0, "returned": 0, "to_nodes": 0,
                         "refused": 0, "unknown_path": 0, "send_failures": 0, "refused_full": 0,
                         "refused_peer_limit": 0, "refused_setup_rate": 0, "replays": 0, "stale": 0,
                         "refused_replies": 0}

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
            if isinstance(exc, Refused):
                self.counters[exc.counter] += 1
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

    def now(self) -> float:
        return self.seen.now()

    async def _refuse(self, peer: bytes, in_id: bytes, reason: str, counter: str) -> None:
        await self._pass_on(peer, "down", [in_id])
        raise Refused(reason, counter)

    async def _on_setup(self, peer: bytes, body: Any) -> None:
        if not (isinstance(body, list) and len(body) == 2 and type(body[1]) is bytes):
            raise RelayError("setup is [link id, packet]")
        in_id, packet = _link(body[0]), body[1]
        if (peer, in_id) in self.forward:
            raise RelayError("link id already in use")
        now = self.now()
        self.forget_setups(now)
        ephemeral = packet[:onion.KEY_SIZE]
        if ephemeral in self.seen:
            raise Refused("replayed setup packet", "replays")
        # Every limit is checked before the packet is peeled (the relay's only public-key operation)
        # and before anything is stored.
        if len(self.by_peer.get(peer, ())) >= self.max_hops_per_peer:
            self.expire(peer=peer)
            if len(self.by_peer.get(peer, ())) >= self.max_hops_per_peer:
                await self._refuse(peer, in_id, f"peer holds {self.max_hops_per_peer} paths here, its limit",
                                   "refused_peer_limit")
        if len(self.forward) >= self.max_hops:
            if time.monotonic() - self._swept >= EXPIRE_EVERY:
                self.expire()
            if len(self.forward) >= self.max_hops:
                await self._refuse(peer, in_id, "relay is carrying its maximum number of paths",
                                   "refused_full")
        if self.seen.held_by(peer) >= self.max_setups_per_peer:
            await self._refuse(peer, in_id, f"peer sent {self.max_setups_per_peer} setups within the window",
                               "refused_setup_rate")
        if self.seen.full():
            await self._refuse(peer, in_id, "replay cache is full", "refused_full")
        layer, inner = onion.peel(self.secret, packet)
        if self.seen.outside(ephemeral, layer.issued, now, peer):  # the sender's room was checked above
            await self._refuse(peer, in_id,
                               f"setup issued {now - layer.issued:.0f} s ago, outside the window", "stale")
        self.seen.remember(ephemeral, layer.issued, peer)
        self.counters["setups"] += 1
        if layer.is_proxy:
            hop = Hop(peer, in_id, None, None, layer.path_key)
            self._store(hop)
            await self._back(hop, "ready", layer.token)
            return
        if not self.is_user(layer.next_key):
            await self._pass_on(peer, "down", [in_id])
            raise RelayError("next relay is not a listed user")
        hop = Hop(peer, in_id, layer.next_key, layer.out_id, layer.hop_key)
        self._store(hop)
        if not await self._pass_on(layer.next_key, "setup", [layer.out_id, inner]):
            self._drop(hop)
            await self._pass_on(peer, "down", [in_id])

    def forget_setups(self, now: float | None = None) -> int:
        """Forget the ephemeral keys of setups that left the window: a replay of one is refused as
        stale, so nothing but the window ever removes an entry."""
        return self.seen.forget(self.now() if now is None else now)

    def _store(self, hop: Hop) -> None:
        self.forward[(hop.pred, hop.in_id)] = hop
        self.by_peer.setdefault(hop.pred, {})[(hop.pred, hop.in_id)] = hop
        if hop.succ is not None and hop.out_id is not None:
            self.backward[(hop.succ, hop.out_id)] = hop

    def _drop(self, hop: Hop) -> None:
        if self.forward.pop((hop.pred, hop.in_id), None) is None:
            return
        held = self.by_peer.get(hop.pred)
        if held is not None:
            held.pop((hop.pred, hop.in_id), None)
            if not held:
                del self.by_peer[hop.pred]
        if hop.succ is not None and hop.out_id is not None:
            self.backward.pop((hop.succ, hop.out_id), None)
        while hop.replies:
            self._forget_reply(hop, next(iter(hop.replies)))

    # -- reply ids (the proxy) -----------------------------------------------------------------------

    def _forget_reply(self, hop: Hop, reply_id: bytes) -> None:
        del hop.replies[reply_id]
        self.replies.pop(reply_id, None)
        left = self.replies_by_peer[hop.pred] - 1
        if left:
            self.replies_by_peer[hop.pred] = left
        else:
            del self.replies_by_peer[hop.pred]

    def _expire_replies(self, hop: Hop, cutoff: float) -> None:
        while hop.replies and next(iter(hop.replies.values())) < cutoff:
            self._forget_reply(hop, next(iter(hop.replies)))

    def _register_reply(self, hop: Hop, reply_id: bytes) -> None:
        """Keep `reply_id` for the answer to a prompt clove on `hop`'s path (its own once more: used now)."""
        now = time.monotonic()
        owner = self.replies.get(reply_id)
        if owner is not None and owner is not hop:
            raise RelayError("reply id in use by another path")
        if owner is None:
            self._make_room_for_reply(hop, now)
            self.replies[reply_id] = hop
            self.replies_by_peer[hop.pred] = self.replies_by_peer.get(hop.pred, 0) + 1
        hop.replies[reply_id] = now
        hop.replies.move_to_end(reply_id)

    def _make_room_for_reply(self, hop: Hop, now: float) -> None:
        """Forget the path's idle reply ids, and its least recently used one at its bound; Refused, with
        nothing stored, while the path's peer or the whole table is at its bound once idle ones are gone."""
        cutoff = now - REPLY_IDLE_SECONDS
        self._expire_replies(hop, cutoff)
        if len(hop.replies) >= MAX_REPLIES_PER_PATH:
            self._forget_reply(hop, next(iter(hop.replies)))
        if self.replies_by_peer.get(hop.pred, 0) >= self.max_replies_per_peer:
            for other in list(self.by_peer.get(hop.pred, {}).values()):
                self._expire_replies(other, cutoff)
            if self.replies_by_peer.get(hop.pred, 0) >= self.max_replies_per_peer:
                raise Refused(f"peer's paths hold {self.max_replies_per_peer} reply ids here",
                              "refused_replies")
        if len(self.replies) >= self.max_replies:
            if now - self._swept >= EXPIRE_EVERY:
                self.expire()
            if len(self.replies) >= self.max_replies:
                raise Refused("the reply table is full", "refused_replies")

    # -- traffic -------------------------------------------------------------------------------------

    async def _back(self, hop: Hop, kind: str, data: bytes, reply_id: bytes = b"") -> None:
        """Originate a payload toward the user (we are its proxy)."""
        sealed = onion.seal_backward(hop.key, onion.Payload(kind, data, reply_id))
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
            inner = onion.unwrap_forward(hop.key, body[1])
            self.counters["forwarded"] += 1
            await self._pass_on(hop.succ, "fwd", [hop.out_id, inner])
            return
        payload = onion.open_forward(hop.key, body[1])
        destination = payload.first
        if not destination:
            if len(payload.data) > MAX_PING:
                raise RelayError("ping too long")
            await self._back(hop, "pong", payload.data)
        elif type(destination) is bytes:
            if not payload.reply_id:
                raise RelayError("a prompt clove names no reply id")
            if not await self._known_node(destination):  # the user learns it now, not at its timeout
                self.counters["refused"] += 1
                await self._back(hop, "unreachable", destination)
                return
            self._register_reply(hop, payload.reply_id)
            self.counters["to_nodes"] += 1
            if not await self._pass_on(destination, "clove", payload.data):
                await self._back(hop, "unreachable", destination)
        else:
            raise RelayError("a clove's destination is a model node's key")

    async def _known_node(self, key: bytes) -> bool:
        """Whether `key` is a registered model node's, reading the lists again if this relay's copy
        does not hold it (it may be older than the node's registration or key rotation)."""
        if self.is_node(key):
            return True
        if self.knock is not None:
            await self.knock(key)
        return self.is_node(key)

    async def _on_reply(self, body: Any) -> None:
        if not (isinstance(body, list) and len(body) == 2 and type(body[1]) is bytes):
            raise RelayError("reply is [reply id, clove]")
        reply_id = _link(body[0])
        hop = self.replies.get(reply_id)
        if hop is None:
            self.counters["unknown_path"] += 1
            return
        hop.used = hop.replies[reply_id] = time.monotonic()
        hop.replies.move_to_end(reply_id)
        self.counters["proxied"] += 1
        await self._back(hop, "clove", body[1], reply_id)

    async def _on_back(self, peer: bytes, body: Any) -> None:
        if not (isinstance(body, list) and len(body) == 2 and type(body[1]) is bytes):
            raise RelayError("back is [link id, sealed payload]")
        link = _link(body[0])
        hop = self.backward.get((peer, link))
        if hop is not None:
            hop.used = time.monotonic()
            self.counters["returned"] += 1
            await self._pass_on(hop.pred, "back", [hop.in_id, onion.wrap_backward(hop.key, body[1])])
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

    def expire(self, now: float | None = None, *, peer: bytes | None = None) -> int:
        """Forget paths unused for HOP_IDLE_SECONDS (their users keep live ones busy with pings): all of
        them, or those whose predecessor is `peer`; and the setups that left the window."""
        cutoff = (time.monotonic() if now is None else now) - HOP_IDLE_SECONDS
        if peer is None:
            self._swept = time.monotonic()
            self.forget_setups()
        held = self.forward.values() if peer is None else self.by_peer.get(peer, {}).values()
        stale = [h for h in held if h.used < cutoff]
        for hop in stale:
            self._drop(hop)
        if peer is None:
            reply_cutoff = cutoff + HOP_IDLE_SECONDS - REPLY_IDLE_SECONDS
            for hop in [h for h in self.forward.values() if h.replies]:
                self._expire_replies(hop, reply_cutoff)
        return len(stale)
