"""The registry's entities; records are plain dicts of ints, strings and bytes (canonical msgpack)."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Self

from planetserve.registry import codec

NODE_STATUSES = ("active", "inactive")
MEMBER_ACTIONS = ("add", "remove", "renew")
GOVERNANCE_ACTIONS = ("model", "params", "upgrade")
"""What a committee proposal does besides admitting or removing a member: register a model, change
parameters at a height, or require a newer app from a height on."""


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


class Record:
    """Conversion between an entity and its record: a dict for people and JSON, and, in state, the
    canonical msgpack array of its fields in declaration order (no field names on the wire)."""

    def to_record(self) -> dict[str, Any]:
        return {
            f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
            for f in dataclasses.fields(self)  # type: ignore[arg-type]
        }

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Self:
        values = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            value = record[f.name]
            values[f.name] = tuple(value) if isinstance(value, list) else value
        return cls(**values)

    def encode(self) -> bytes:
        return codec.pack([getattr(self, name) for name in _field_names(type(self))])

    @classmethod
    def decode(cls, raw: bytes) -> Self:
        """Decode a stored record; raises CodecError for bytes of another shape."""
        values = codec.unpack_stored(raw)
        names = _field_names(cls)
        if not isinstance(values, list) or len(values) != len(names):
            raise codec.CodecError(f"not a {cls.__name__} record")
        return cls(**{n: tuple(v) if isinstance(v, list) else v for n, v in zip(names, values, strict=True)})


@dataclass(frozen=True)
class Organisation(Record):
    org_id: str
    name: str
    owner: bytes
    registered_at: int


@dataclass(frozen=True)
class User(Record):
    """A user relay; it disappears from the ledger when expires_at (block time, seconds) passes."""

    pubkey: bytes
    address: str
    region: str
    registered_at: int
    expires_at: int


@dataclass(frozen=True)
class Model(Record):
    """A model nodes may serve. `layers` and `layer_mib` (both 0 when not declared) size it, so that a
    deployment on nodes that cannot hold it whole is split into a layer pipeline."""

    model_id: str
    name: str
    registered_at: int
    layers: int = 0
    layer_mib: int = 0

    @property
    def sized(self) -> bool:
        return self.layers > 0 and self.layer_mib > 0


@dataclass(frozen=True)
class ModelNode(Record):
    pubkey: bytes
    org_id: str
    model_id: str
    address: str
    hardware: str
    capacity: int
    region: str
    status: str
    registered_at: int
    memory_mib: int = 0
    """Accelerator memory for model weights, declared at registration (0: not declared)."""
    gflops: int = 0
    """Compute throughput (GFLOP/s), declared at registration (0: not declared)."""


@dataclass(frozen=True)
class NodeRotation(Record):
    """A model node's move from key `old` to key `new`, both of whose holders signed it: due at the start
    of block `height` (the next epoch's first), when the node's record, listing, reputation, deployment
    and planned challenge move to the new key. Kept for both keys until then, and for the old key after:
    neither may be registered again."""

    old: bytes
    new: bytes
    org_id: str
    height: int


@dataclass(frozen=True)
class Member(Record):
    """A verification-committee member: an institution running a validator."""

    operator: bytes
    consensus_key: bytes
    vrf_key: bytes
    x25519_key: bytes
    credential: str
    power: int
    expires_at: int = 0
    """When its credential lapses (block time, seconds; 0 until admission sets it): at the first epoch
    end from then on it loses its power, unless the committee renewed it."""


@dataclass(frozen=True)
class MemberRotation(Record):
    """A member's new keys (empty: unchanged), each signed for by its holder except the X25519 key, which
    cannot sign and harms only its own member if wrong: due at the start of block `height` (the next
    epoch's first), when the member's record, validator, faults and votes move to them."""

    operator: bytes
    height: int
    new_operator: bytes = b""
    consensus_key: bytes = b""
    vrf_key: bytes = b""
    x25519_key: bytes = b""

    def applied(self, member: Member) -> Member:
        return dataclasses.replace(
            member, operator=self.new_operator or member.operator,
            consensus_key=self.consensus_key or member.consensus_key,
            vrf_key=self.vrf_key or member.vrf_key, x25519_key=self.x25519_key or member.x25519_key)


@dataclass(frozen=True)
class Proposal(Record):
    """A pending committee decision (an admission or removal, a model, a parameter change, an upgrade):
    approved at more than 2/3 of the power, rejected at 1/3 or more. `subject` is the member's record, the
    model's (registered at the approval's time), the parameters' new values with their height
    (`{"height": h, "changes": {...}}`), or the UpgradePlan's record."""

    proposal_id: int
    action: str
    subject: dict[str, Any]
    proposer: bytes
    votes: tuple[bytes, ...]
    rejections: tuple[bytes, ...]
    created_height: int
    expires_height: int


@dataclass(frozen=True)
class UpgradePlan(Record):
    """An approved upgrade: from `height` on, validators must run an app of at least `app_version`, which
    runs its migration `name` at the start of that block; an older app halts there."""

    name: str
    app_version: int
    height: int
