"""Messages of the registry family: organisations, users, models and model nodes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from planetserve.chain.keys import KeySet
from planetserve.chain.messages.base import Message
from planetserve.registry import codec, fields, work
from planetserve.registry.entities import NODE_STATUSES
from planetserve.registry.errors import InvalidField
from planetserve.registry.params import Params

NODE_POP_DOMAIN = "planetserve/node-pop/v1"
NODE_ROTATION_DOMAIN = "planetserve/node-rotation/v1"
MAX_CAPACITY = 1_000_000


def node_pop_message(chain_id: str, org_id: str, node_pubkey: bytes) -> bytes:
    """What a model node's key signs to prove its owner holds it when the organisation registers it."""
    return codec.pack([NODE_POP_DOMAIN, chain_id, org_id, node_pubkey])


def node_rotation_message(chain_id: str, org_id: str, old: bytes, new: bytes) -> bytes:
    """What both of a model node's keys sign to move the node from the old to the new."""
    return codec.pack([NODE_ROTATION_DOMAIN, chain_id, org_id, old, new])


def _optional(body: dict[str, Any], name: str, check: Any, *args: Any) -> Any:
    return check(body, name, *args) if name in body else None


class Worked(Message):
    """A registration that carries a proof of work (`work`, registry/work.py) over the chain id, its
    type and the signer's key, of the difficulty the chain's parameters set for its kind."""

    WORK_PARAM: ClassVar[str]
    work: int | None

    def bits(self, params: Params) -> int:
        return int(getattr(params, self.WORK_PARAM))

    def solved(self, chain_id: str, signer: bytes, params: Params) -> Self:
        """This registration with a nonce that meets the chain's difficulty for `signer`."""
        bits = self.bits(params)
        if self.work is not None and work.meets(chain_id, self.TYPE, signer, self.work, bits):
            return self
        return dataclasses.replace(self, work=work.solve(chain_id, self.TYPE, signer, bits))


def _work(body: dict[str, Any]) -> int | None:
    return _optional(body, "work", fields.integer, 0, work.MAX_NONCE)


@dataclass(frozen=True)
class RegisterOrg(Worked):
    TYPE: ClassVar[str] = "register-org"
    WORK_PARAM: ClassVar[str] = "org_work_bits"
    org_id: str
    name: str
    work: int | None = None

    @classmethod
    def parse(cls, body: dict[str, Any]) -> Self:
        return cls(fields.ident(body, "org_id"), fields.text(body, "name", 128), _work(body))


@dataclass(frozen=True)
class RegisterUser(Worked):
    TYPE: ClassVar[str] = "register-user"
    WORK_PARAM: ClassVar[str] = "user_work_bits"
    address: str
    region: str
    work: int | None = None

    @classmethod
    def parse(cls, body: dict[str, Any]) -> Self:
        return cls(fields.address(body), fields.region(body), _work(body))


@dataclass(frozen=True)
class Heartbeat(Message):
    """Renews the signer's user registration, changing its address or region where given."""

    TYPE: ClassVar[str] = "heartbeat"
    address: str | None = None
    region: str | None = None

    @classmethod
    def parse(cls, body: dict[str, Any]) -> Self:
        return cls(_optional(body, "address", fields.address), _optional(body, "region", fields.region))


@dataclass(frozen=True)
class RegisterModel(Message):
    """A model nodes may serve; `layers` and `layer_mib` (both or neither) size it for pipelines."""

    TYPE: ClassVar[str] = "register-model"
    model_id: str
    name: str
    layers: int | None = None
    layer_mib: int | None = None

    @classmethod
    def parse(cls, body: dict[str, Any]) -> Self:
        layers, layer_mib = fields.model_size(body)
        return cls(fields.ident(body, "model_id"), fields.text(body, "name", 128), layers or None,
                   layer_mib or None)


@dataclass(frozen=True)
class RegisterModelNode(Message):
    """An organisation's model node, with the node key's signature proving the owner holds it."""

    TYPE: ClassVar[str] = "register-model-node"
    org_id: str
    node_pubkey: bytes
    pop: bytes
    model_id: str
    address: str
    hardware: str
    capacity: int
    region: str
    memory_mib: int | None = None
    gflops: int | None = None

    @classmethod
    def signed(cls, chain_id: str, org_id: str, node: KeySet, **settings: Any) -> Self:
        """The registration of `node`, its proof of possession signed with the node's own key."""
        pop = node.sign(node_pop_message(chain_id, org_id, node.public))
        return cls(org_id=org_id, node_pubkey=node.public, pop=pop, **settings)

    @classmethod
    def parse(cls, body: dict[str, Any]) -> Self:
        return cls(
            org_id=fields.ident(body, "org_id"),
            node_pubkey=fields.key32(body, "node_pubkey"),
            pop=fields.sig64(body, "pop"),
            model_id=fields.ident(body, "model_id"),
            address=fields.address(body),
            hardware=fields.hardware(body),
            capacity=fields.integer(body, "capacity", 1, MAX_CAPACITY),
            region=fields.region(body),
            memory_mib=_optional(body, "memory_mib", fields.integer, 0, fields.MAX_MIB),
            gflops=_optional(body, "gflops", fields.integer, 0, fields.MAX_GFLOPS),
        )


@dataclass(frozen=True)
class UpdateModelNode(Message):
    """Changes the settings given of a model node of the signer's organisation."""

    TYPE: ClassVar[str] = "update-model-node"
    node_pubkey: bytes
    address: str | None = None
    capacity: int | None = None
    region: str | None = None
    status: str | None = None
    model_id: str | None = None
    memory_mib: int | None = None
    gflops: int | None = None

    @classmethod
    def parse(cls, body: dict[str, Any]) -> Self:
        return cls(
            node_pubkey=fields.key32(body, "node_pubkey"),
            address=_optional(body, "address", fields.address),
            capacity=_optional(body, "capacity", fields.integer, 1, MAX_CAPACITY),
            region=_optional(body, "region", fields.region),
            status=_optional(body, "status", fields.choice, NODE_STATUSES),
            model_id=_optional(body, "model_id", fields.ident),
            memory_mib=_optional(body, "memory_mib", fields.integer, 0, fields.MAX_MIB),
            gflops=_optional(body, "gflops", fields.integer, 0, fields.MAX_GFLOPS),
        )


@dataclass(frozen=True)
class RotateNodeKey(Message):
    """Moves a model node of the signer's organisation to a new key at the next epoch's first block:
    the old key's signature shows its holder agrees, the new key's that its holder exists."""

    TYPE: ClassVar[str] = "rotate-node-key"
    node_pubkey: bytes
    new_pubkey: bytes
    old_signature: bytes
    new_signature: bytes

    @classmethod
    def signed(cls, chain_id: str, org_id: str, old: KeySet, new: KeySet) -> Self:
        message = node_rotation_message(chain_id, org_id, old.public, new.public)
        return cls(old.public, new.public, old.sign(message), new.sign(message))

    @classmethod
    def parse(cls, body: dict[str, Any]) -> Self:
        msg = cls(fields.key32(body, "node_pubkey"), fields.key32(body, "new_pubkey"),
                  fields.sig64(body, "old_signature"), fields.sig64(body, "new_signature"))
        if msg.new_pubkey == msg.node_pubkey:
            raise InvalidField("new_pubkey", "must differ from node_pubkey")
        return msg
