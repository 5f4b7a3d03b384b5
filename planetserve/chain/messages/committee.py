"""Messages of the committee family: proposals to admit or remove a member, and votes on them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Self

from planetserve.chain.messages.base import Message
from planetserve.registry import fields
from planetserve.registry.entities import MEMBER_ACTIONS, Member

MAX_POWER = 1_000_000


@dataclass(frozen=True)
class ProposeMember(Message):
    """Admit a member (every key, its credential and power given) or remove one (its operator key only)."""

    TYPE: ClassVar[str] = "propose-member"
    action: str
    operator: bytes
    consensus_key: bytes | None = None
    vrf_key: bytes | None = None
    x25519_key: bytes | None = None
    credential: str | None = None
    power: int | None = None

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Self:
        action = fields.choice(body, "action", MEMBER_ACTIONS)
        if action == "remove":
            fields.check_keys(body, {"action", "operator"})
            return cls(action, fields.key32(body, "operator"))
        required, optional = cls.keys()
        fields.check_keys(body, required | optional)
        return cls(
            action,
            operator=fields.key32(body, "operator"),
            consensus_key=fields.key32(body, "consensus_key"),
            vrf_key=fields.key32(body, "vrf_key"),
            x25519_key=fields.key32(body, "x25519_key"),
            credential=fields.text(body, "credential", 1024),
            power=fields.integer(body, "power", 1, MAX_POWER),
        )

    def member(self) -> Member:
        """The member an "add" proposal admits (from_body has checked that every key is given)."""
        return Member(self.operator, self.consensus_key, self.vrf_key, self.x25519_key,  # type: ignore[arg-type]
                      self.credential, self.power)  # type: ignore[arg-type]


@dataclass(frozen=True)
class VoteMember(Message):
    TYPE: ClassVar[str] = "vote-member"
    proposal_id: int
    approve: bool

    @classmethod
    def parse(cls, body: dict[str, Any]) -> Self:
        return cls(fields.integer(body, "proposal_id", 1, 2**62), fields.flag(body, "approve"))
