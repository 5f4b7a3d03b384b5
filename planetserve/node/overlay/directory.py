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
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from planetserve.chain.client import LedgerClient, QueryRefused
from planetserve.chain.lightclient import Header, VerificationError
from planetserve.chain.rpc import RpcError
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


class OnDemand(Generic[T]):
    """A blocking list read run when someone unknown knocks: at most once per `min_interval`, and
    callers that arrive during a read share it."""

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
