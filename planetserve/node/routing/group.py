"""A model node's group: the trusted model nodes serving the same model, read from the verified node
list. Only members may connect to the peer port, and only members are forwarding candidates, so a
node the committee delists drops out of its group at the next refresh. A group whose list is older than
the light client's `max_age` is dropped while refreshes fail (as the overlay's directory is)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from planetserve.chain.client import LedgerClient, QueryRefused
from planetserve.chain.lightclient import Header, VerificationError
from planetserve.chain.rpc import RpcError
from planetserve.registry.entities import ModelNode

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupView:
    height: int
    members: dict[bytes, ModelNode]
    """Trusted, active nodes of the model, keyed by identity key (ourselves included if listed)."""
    header: Header | None = None
    """The verified header the list was read from (None: no list, or an unverified one)."""

    def address(self, key: bytes) -> str | None:
        node = self.members.get(key)
        return None if node is None else node.address


EMPTY = GroupView(0, {})


class Group:
    """The latest verified view; a failed refresh keeps the previous one (an RPC outage must not
    empty the group) while it is fresh and drops it once it is older than the light client's
    `max_age`, and a view older than the one held is never adopted."""

    def __init__(self, ledger: LedgerClient, model_id: str) -> None:
        self.ledger = ledger
        self.model_id = model_id
        self.view = EMPTY
        self.last_error: str | None = None

    def refresh(self) -> GroupView:
        """Read the verified list (blocking: run it in a thread)."""
        try:
            listing, nodes = self.ledger.nodes(self.model_id)
        except (QueryRefused, VerificationError, RpcError) as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"
            if (stale := self.ledger.staleness(self.view.header)) is not None:
                log.warning("node list refresh failed (%s) and the list held is too old to serve from, "
                            "dropped it until a fresh view verifies: %s", exc, stale)
                self.view = GroupView(self.view.height, {})
            else:
                log.warning("node list refresh failed, keeping height %d: %s", self.view.height, exc)
            return self.view
        self.last_error = None
        if listing.height >= self.view.height:
            self.view = GroupView(listing.height, {n.pubkey: n for n in nodes if n.status == "active"},
                                  listing.header)
        return self.view
