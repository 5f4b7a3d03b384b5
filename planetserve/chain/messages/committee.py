"""Messages of the committee family: proposals to admit or remove a member, to change parameters at a
height or to require a newer app from a height on, and votes on them."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar, Self

from nacl.signing import SigningKey

from planetserve.chain.keys import KeySet
from planetserve.chain.messages.base import Message, as_map
from planetserve.registry import codec, fields
from planetserve.registry.entities import MEMBER_ACTIONS, Member
from planetserve.registry.errors import InvalidField
from planetserve.registry.params import GENESIS_ONLY, Params

MAX_POWER = 1_000_000
MEMBER_ROTATION_DOMAIN = "planetserve/member-rotation/v1"


@dataclass(frozen=True)
class ProposeMember(Message):
    """Admit a member (every key, its credential and power given), remove one (its operator key only), or
    renew one's credential (its operator key and the credential, checked again)."""

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
        if action == "renew":
            fields.check_keys(body, {"action", "operator", "credential"})
            return cls(action, fields.key32(body, "operator"),
                       credential=fields.text(body, "credential", 1024))
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


MAX_HEIGHT = 2**62
MAX_APP_VERSION = 2**31


@dataclass(frozen=True)
class ProposeParams(Message):
    """Change parameters at the start of block `height`: each named one to its value, as the genesis
    would set it. Their relations to the other parameters are checked when proposed and again when
    applied."""

    TYPE: ClassVar[str] = "propose-params"
    height: int
    changes: dict[str, int]

    @classmethod
    def parse(cls, body: dict[str, Any]) -> Self:
        changes = as_map(body["changes"], "changes")
        if not changes:
            raise InvalidField("changes", "must name at least one parameter")
        Params.check_values(changes)
        fixed = sorted(GENESIS_ONLY & changes.keys())
        if fixed:
            raise InvalidField(fixed[0], "is set by the genesis alone: it numbers every epoch from the first "
                                         "block, so a change would renumber them (a new chain's genesis may "
                                         "set another)")
        return cls(fields.integer(body, "height", 1, MAX_HEIGHT), dict(sorted(changes.items())))


@dataclass(frozen=True)
class ProposeUpgrade(Message):
    """From block `height` on, validators run an app of at least `app_version`; that app runs its
    migration `name` at the start of the block, and an older one halts there."""

    TYPE: ClassVar[str] = "propose-upgrade"
    name: str
    app_version: int
    height: int

    @classmethod
    def parse(cls, body: dict[str, Any]) -> Self:
        return cls(fields.ident(body, "name"), fields.integer(body, "app_version", 2, MAX_APP_VERSION),
                   fields.integer(body, "height", 1, MAX_HEIGHT))


@dataclass(frozen=True)
class VoteMember(Message):
    """A member's vote on any committee proposal (an admission or removal, parameters, an upgrade)."""

    TYPE: ClassVar[str] = "vote-member"
    proposal_id: int
    approve: bool

    @classmethod
    def parse(cls, body: dict[str, Any]) -> Self:
        return cls(fields.integer(body, "proposal_id", 1, 2**62), fields.flag(body, "approve"))


def member_rotation_message(chain_id: str, operator: bytes, new_operator: bytes | None,
                            consensus_key: bytes | None, vrf_key: bytes | None, x25519_key: bytes | None
                            ) -> bytes:
    """What each new signing key of a member signs: the whole rotation, so no key is moved alone."""
    return codec.pack([MEMBER_ROTATION_DOMAIN, chain_id, operator, new_operator or b"", consensus_key or b"",
                       vrf_key or b"", x25519_key or b""])


@dataclass(frozen=True)
class RotateMemberKey(Message):
    """The signer (a member's operator key) moves any of its keys to new ones at the next epoch's first
    block. Each new key that can sign (operator, consensus, VRF: all ed25519) signs the rotation; the
    X25519 key cannot, and a wrong one only stops its own member reading its sealed challenges."""

    TYPE: ClassVar[str] = "rotate-member-key"
    new_operator: bytes | None = None
    operator_signature: bytes | None = None
    consensus_key: bytes | None = None
    consensus_signature: bytes | None = None
    vrf_key: bytes | None = None
    vrf_signature: bytes | None = None
    x25519_key: bytes | None = None

    SIGNED: ClassVar[tuple[tuple[str, str], ...]] = (
        ("new_operator", "operator_signature"), ("consensus_key", "consensus_signature"),
        ("vrf_key", "vrf_signature"))

    @classmethod
    def signed(cls, chain_id: str, operator: bytes, keys: KeySet | None = None,
               consensus: SigningKey | None = None) -> Self:
        """The rotation to `keys` (operator, VRF and X25519 at once) and/or a new consensus key."""
        unsigned = cls(
            new_operator=keys.public if keys is not None else None,
            consensus_key=bytes(consensus.verify_key) if consensus is not None else None,
            vrf_key=bytes(keys.vrf.verify_key) if keys is not None else None,
            x25519_key=bytes(keys.x25519.public_key) if keys is not None else None)
        message = unsigned.message(chain_id, operator)
        return replace(
            unsigned, operator_signature=keys.sign(message) if keys is not None else None,
            consensus_signature=consensus.sign(message).signature if consensus is not None else None,
            vrf_signature=keys.vrf.sign(message).signature if keys is not None else None)

    def message(self, chain_id: str, operator: bytes) -> bytes:
        return member_rotation_message(chain_id, operator, self.new_operator, self.consensus_key,
                                       self.vrf_key, self.x25519_key)

    @classmethod
    def parse(cls, body: dict[str, Any]) -> Self:
        values: dict[str, Any] = {}
        for key, signature in cls.SIGNED:
            if (key in body) != (signature in body):
                raise InvalidField(signature, f"must be given exactly when {key} is: the new key signs")
            if key in body:
                values[key] = fields.key32(body, key)
                values[signature] = fields.sig64(body, signature)
        if "x25519_key" in body:
            values["x25519_key"] = fields.key32(body, "x25519_key")
        if not values:
            raise InvalidField("new_operator", "a rotation names at least one new key")
        return cls(**values)

    def signatures(self) -> list[tuple[str, bytes, bytes]]:
        """(field, new key, its signature) for each new signing key."""
        return [(key, getattr(self, key), getattr(self, signature)) for key, signature in self.SIGNED
                if getattr(self, key) is not None]
