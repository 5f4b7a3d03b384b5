"""The overlay's view of who exists: the verified user list (relays and proxies), the verified list
of trusted model nodes, and every registered model node, read from the ledger with their proofs. Relays
and model nodes accept connections only from keys in it, and resolve the addresses of the keys they
forward to from it. Ordinary requests go to trusted nodes only; a request may name any registered
node (the committee keeps challenging nodes that left the trusted list), so proxies reach those too.

A view is as old as the verified header it was read from. While refreshes fail it is kept, but only
within the light client's `max_age` of the local clock: past that it is dropped (an empty view of the
same height) until a fresh one verifies, so a lying or stalled endpoint cannot keep the overlay on an
old list that still names a delisted node."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from planetserve.chain.client import LedgerClient, QueryRefused
from planetserve.chain.lightclient import Header, VerificationError
from planetserve.chain.rpc import RpcError
from planetserve.node.overlay.rate import TokenBucket
from planetserve.registry.entities import ModelNode, User

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class DirectoryView:
    height: int
    users: dict[bytes, User] = field(default_factory=dict)
    nodes: dict[bytes, ModelNode] = field(default_factory=dict)
    """Trusted, active model nodes of every model."""
    registered: dict[bytes, ModelNode] = field(default_factory=dict)
    """Active registered model nodes of every model, whatever their reputation."""
    header: Header | None = None
    """The verified header the user list was read from (None: no list, or an unverified one)."""

    @classmethod
    def of(cls, height: int, users: Iterable[User], nodes: Iterable[ModelNode],
           registered: Iterable[ModelNode] = (), header: Header | None = None) -> DirectoryView:
        """`registered` adds to the trusted `nodes`, which are registered too."""
        trusted = {n.pubkey: n for n in nodes if n.status == "active"}
        return cls(height, {u.pubkey: u for u in users}, trusted,
                   {**{n.pubkey: n for n in registered if n.status == "active"}, **trusted}, header)

    def node(self, key: bytes) -> ModelNode | None:
        """An active registered model node, trusted or not."""
        return self.nodes.get(key) or self.registered.get(key)

    def address(self, key: bytes) -> str | None:
        entity = self.users.get(key) or self.node(key)
        return None if entity is None else entity.address

    def models(self) -> dict[str, list[ModelNode]]:
        """Model id → its trusted nodes, in key order."""
        served: dict[str, list[ModelNode]] = {}
        for key in sorted(self.nodes):
            served.setdefault(self.nodes[key].model_id, []).append(self.nodes[key])
        return served


class Directory:
    """The latest verified view. A failed refresh keeps the previous view (an RPC outage must not empty
    the overlay) while it is fresh, and drops it once it is older than the light client's `max_age`;
    a view older than the one held is never adopted."""

    def __init__(self, ledger: LedgerClient, *, with_nodes: bool = True) -> None:
        self.ledger = ledger
        self.with_nodes = with_nodes
        self.view = DirectoryView(0)
        self.last_error: str | None = None

    def refresh(self) -> DirectoryView:
        """Read the lists (blocking: run it in a thread)."""
        try:
            users_listing, users = self.ledger.users()
            nodes = self.ledger.nodes()[1] if self.with_nodes else []
            registered = self.ledger.registered_nodes() if self.with_nodes else []
        except (QueryRefused, VerificationError, RpcError) as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"
            if (stale := self.ledger.staleness(self.view.header)) is not None:
                log.warning("directory refresh failed (%s) and the lists held are too old to serve from, "
                            "dropped them until a fresh view verifies: %s", exc, stale)
                self.view = DirectoryView(self.view.height)
            else:
                log.warning("directory refresh failed, keeping height %d: %s", self.view.height, exc)
            return self.view
        self.last_error = None
        if users_listing.height >= self.view.height:
            self.view = DirectoryView.of(users_listing.height, users, nodes, registered, users_listing.header)
        return self.view


def registered(ledger: LedgerClient, key: bytes, *, nodes: bool) -> bool | None:
    """Whether the ledger holds `key` as a user's (or, with `nodes`, a model node's), read as that one
    proven entry: None when it could not be read."""
    try:
        return ledger.user(key) is not None or (nodes and ledger.node(key) is not None)
    except (QueryRefused, VerificationError, RpcError) as exc:
        log.info("could not look up a knocking key: %s", exc)
        return None


KNOCK_LOOKUPS_PER_S = 4.0
"""Lookups of unknown keys a relay or model node makes a second, on average."""
KNOCK_BURST = 8
"""Lookups it may make at once after a quiet spell."""
ABSENT_FOR_S = 10.0
"""How long a key the ledger did not hold is refused without a lookup: a registration takes a block or
two, and a key that knocked just before its own commits may knock again soon after."""
ABSENT_MEMORY = 4096
"""Keys remembered absent, the least recently found first forgotten."""


class Knocks:
    """What a knock from a key the lists do not hold may cost. A hello needs only a fresh key pair, so
    the lists (every user, every node, with their proofs) are read again only for a key the ledger
    holds: first that key alone is looked up (`lookup`, one proven entry). Lookups are limited to
    `rate` a second (a bucket of `burst`), and a key found absent is refused without one for
    `absent_for` seconds. A flood of fresh keys costs the validator's RPC a few small lookups a second,
    and while it lasts a newcomer whose knock finds the bucket empty waits for the periodic read of the
    lists, or knocks again."""

    def __init__(self, lookup: Callable[[bytes], bool | None], refresh: Callable[[], Awaitable[None]], *,
                 rate: float = KNOCK_LOOKUPS_PER_S, burst: int = KNOCK_BURST,
                 absent_for: float = ABSENT_FOR_S, memory: int = ABSENT_MEMORY) -> None:
        self.lookup = lookup
        self.refresh = refresh
        self.lookups = TokenBucket(rate, burst)
        self.absent_for = absent_for
        self.memory = memory
        self._absent: OrderedDict[bytes, float] = OrderedDict()
        self.counts = {"lookups": 0, "refreshes": 0, "absent": 0, "limited": 0}

    async def __call__(self, key: bytes) -> None:
        """Read the lists again if `key` may be one they now hold."""
        if self._recently_absent(key):
            self.counts["absent"] += 1
            return
        if not self.lookups.take():
            self.counts["limited"] += 1
            return
        self.counts["lookups"] += 1
        found = await asyncio.to_thread(self.lookup, key)
        if found:
            self.counts["refreshes"] += 1
            await self.refresh()
        elif found is not None:
            self._absent[key] = time.monotonic()
            self._absent.move_to_end(key)
            while len(self._absent) > self.memory:
                self._absent.popitem(last=False)

    def _recently_absent(self, key: bytes) -> bool:
        since = self._absent.get(key)
        if since is None:
            return False
        if time.monotonic() - since < self.absent_for:
            return True
        del self._absent[key]
        return False


class OnDemand(Generic[T]):
    """A blocking list read run when a key the ledger holds knocks unknown (`Knocks`) and periodically:
    at most once per `min_interval`, and callers that arrive during a read share it."""

    def __init__(self, fetch: Callable[[], T], apply: Callable[[T], None], min_interval: float = 0.5) -> None:
        self.fetch = fetch
        self.apply = apply
        self.min_interval = min_interval
        self._lock = asyncio.Lock()
        self._last = float("-inf")

    async def __call__(self) -> None:
        async with self._lock:
            if time.monotonic() - self._last < self.min_interval:
                return
            try:
                self.apply(await asyncio.to_thread(self.fetch))
            except Exception:  # what a fetch did not foresee must not end the loops that call it
                log.exception("reading the verified lists failed")
            self._last = time.monotonic()
