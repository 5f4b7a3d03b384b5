"""What a handler may see and do: the signer, the block's height and time, the state, and the events
and validator updates it leaves."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

from planetserve.chain.abci.state import State
from planetserve.registry.entities import Member, Organisation
from planetserve.registry.errors import Unauthorized, UnknownEntity
from planetserve.registry.params import Params


@dataclass
class Context:
    state: State
    signer: bytes
    height: int
    time: int
    chain_id: str
    params: Params
    load_committee: Callable[[], dict[bytes, Member]]
    validator_updates: list[tuple[bytes, int]] = field(default_factory=list)
    events: list[tuple[str, dict[str, str]]] = field(default_factory=list)

    @cached_property
    def committee(self) -> dict[bytes, Member]:
        """Read only by the handlers that need it: loading it for every transaction would cost
        a scan per transaction."""
        return self.load_committee()

    def emit(self, kind: str, **attributes: str) -> None:
        self.events.append((kind, attributes))

    def require_member(self) -> Member:
        member = self.committee.get(self.signer)
        if member is None:
            raise Unauthorized("signer is not a committee member")
        return member

    def owned_org(self, org_id: str) -> Organisation:
        org = self.state.org(org_id)
        if org is None:
            raise UnknownEntity(f"organisation {org_id!r} is not registered")
        if org.owner != self.signer:
            raise Unauthorized(f"signer does not own organisation {org_id!r}")
        return org
