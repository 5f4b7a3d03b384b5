"""The state layout: which key holds what, and typed access to it.

Every key is ASCII. Identifier components are percent-escaped so that a prefix query for one model
or region can never match another (model ids may contain '/').

    acct/<signer hex>                       account sequence (int)
    params                                  Params
    org/<org>                               Organisation
    user/<pubkey hex>                       User
    ulist/<region>/<pubkey hex>             User            (the signed user list, per region)
    uexp/<expires_at:012d>/<pubkey hex>     b""             (expiry index, swept every block)
    model/<model>                           Model
    node/<pubkey hex>                       ModelNode
    nlist/<model>/<region>/<pubkey hex>     ModelNode       (the signed node list, per model/region)
    member/<operator hex>                   Member
    proposal/<id:012d>                      Proposal
    next/proposal                           int
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, TypeVar
from urllib.parse import quote

from planetserve.registry import codec
from planetserve.registry.entities import (
    Member,
    Model,
    ModelNode,
    Organisation,
    Proposal,
    Record,
    User,
)
from planetserve.registry.params import Params

R = TypeVar("R", bound=Record)


class KV(Protocol):
    def get(self, key: bytes) -> bytes | None: ...
    def set(self, key: bytes, value: bytes) -> None: ...
    def delete(self, key: bytes) -> None: ...


class IterableKV(KV, Protocol):
    def iterate(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]: ...


def _c(component: str) -> str:
    return quote(component, safe="")


def key(*parts: str) -> bytes:
    return "/".join(parts).encode("ascii")


def account_key(signer: bytes) -> bytes:
    return key("acct", signer.hex())


def org_key(org_id: str) -> bytes:
    return key("org", _c(org_id))


def user_key(pubkey: bytes) -> bytes:
    return key("user", pubkey.hex())


def user_list_prefix(region: str | None = None) -> bytes:
    return key("ulist", _c(region), "") if region else key("ulist", "")


def user_list_key(user: User) -> bytes:
    return user_list_prefix(user.region) + user.pubkey.hex().encode()


EXPIRY_PREFIX = key("uexp", "")


def expiry_key(expires_at: int, pubkey: bytes) -> bytes:
    return EXPIRY_PREFIX + f"{expires_at:012d}/{pubkey.hex()}".encode()


def model_key(model_id: str) -> bytes:
    return key("model", _c(model_id))


def node_key(pubkey: bytes) -> bytes:
    return key("node", pubkey.hex())


def node_list_prefix(model_id: str | None = None, region: str | None = None) -> bytes:
    if model_id is None:
        return key("nlist", "")
    if region is None:
        return key("nlist", _c(model_id), "")
    return key("nlist", _c(model_id), _c(region), "")


def node_list_key(node: ModelNode) -> bytes:
    return node_list_prefix(node.model_id, node.region) + node.pubkey.hex().encode()


def member_key(operator: bytes) -> bytes:
    return key("member", operator.hex())


MEMBER_PREFIX = key("member", "")


PROPOSAL_PREFIX = key("proposal", "")


def proposal_key(proposal_id: int) -> bytes:
    return PROPOSAL_PREFIX + f"{proposal_id:012d}".encode()


PARAMS_KEY = key("params")
NEXT_PROPOSAL_KEY = key("next", "proposal")


class TxScope:
    """Writes of one transaction, applied to the block's batch only if the transaction succeeds."""

    def __init__(self, base: KV) -> None:
        self._base = base
        self._writes: dict[bytes, bytes | None] = {}

    def get(self, k: bytes) -> bytes | None:
        if k in self._writes:
            return self._writes[k]
        return self._base.get(k)

    def set(self, k: bytes, value: bytes) -> None:
        self._writes[k] = value

    def delete(self, k: bytes) -> None:
        self._writes[k] = None

    def apply(self) -> None:
        for k in sorted(self._writes):
            value = self._writes[k]
            if value is None:
                self._base.delete(k)
            else:
                self._base.set(k, value)


class State:
    """Typed reads and writes of registry entities over any key-value view."""

    def __init__(self, kv: KV) -> None:
        self.kv = kv

    def _load(self, k: bytes, cls: type[R]) -> R | None:
        raw = self.kv.get(k)
        return None if raw is None else cls.decode(raw)

    def _put(self, k: bytes, entity: Record) -> None:
        self.kv.set(k, entity.encode())

    def get_int(self, k: bytes) -> int:
        raw = self.kv.get(k)
        return 0 if raw is None else int(codec.unpack(raw))

    def put_int(self, k: bytes, value: int) -> None:
        self.kv.set(k, codec.pack(value))

    def sequence(self, signer: bytes) -> int:
        return self.get_int(account_key(signer))

    def params(self) -> Params:
        loaded = self._load(PARAMS_KEY, Params)
        return loaded if loaded is not None else Params()

    def put_params(self, params: Params) -> None:
        self._put(PARAMS_KEY, params)

    def org(self, org_id: str) -> Organisation | None:
        return self._load(org_key(org_id), Organisation)

    def put_org(self, org: Organisation) -> None:
        self._put(org_key(org.org_id), org)

    def model(self, model_id: str) -> Model | None:
        return self._load(model_key(model_id), Model)

    def put_model(self, model: Model) -> None:
        self._put(model_key(model.model_id), model)

    def user(self, pubkey: bytes) -> User | None:
        return self._load(user_key(pubkey), User)

    def put_user(self, user: User) -> None:
        """Store a user with its list entry and expiry index, replacing the old ones."""
        old = self.user(user.pubkey)
        if old is not None:
            self.kv.delete(user_list_key(old))
            self.kv.delete(expiry_key(old.expires_at, old.pubkey))
        record = user.encode()
        self.kv.set(user_key(user.pubkey), record)
        self.kv.set(user_list_key(user), record)
        self.kv.set(expiry_key(user.expires_at, user.pubkey), b"")

    def delete_user(self, user: User) -> None:
        self.kv.delete(user_key(user.pubkey))
        self.kv.delete(user_list_key(user))
        self.kv.delete(expiry_key(user.expires_at, user.pubkey))

    def node(self, pubkey: bytes) -> ModelNode | None:
        return self._load(node_key(pubkey), ModelNode)

    def put_node(self, node: ModelNode) -> None:
        """Store a model node with its list entry; only active nodes are listed."""
        old = self.node(node.pubkey)
        if old is not None:
            self.kv.delete(node_list_key(old))
        record = node.encode()
        self.kv.set(node_key(node.pubkey), record)
        if node.status == "active":
            self.kv.set(node_list_key(node), record)

    def member(self, operator: bytes) -> Member | None:
        return self._load(member_key(operator), Member)

    def put_member(self, member: Member) -> None:
        self._put(member_key(member.operator), member)

    def delete_member(self, operator: bytes) -> None:
        self.kv.delete(member_key(operator))

    def proposal(self, proposal_id: int) -> Proposal | None:
        return self._load(proposal_key(proposal_id), Proposal)

    def put_proposal(self, proposal: Proposal) -> None:
        self._put(proposal_key(proposal.proposal_id), proposal)

    def delete_proposal(self, proposal_id: int) -> None:
        self.kv.delete(proposal_key(proposal_id))

    def next_proposal_id(self) -> int:
        value = self.get_int(NEXT_PROPOSAL_KEY) + 1
        self.put_int(NEXT_PROPOSAL_KEY, value)
        return value


def members(kv: IterableKV) -> dict[bytes, Member]:
    """The committee, keyed by operator key, in key order."""
    return {
        m.operator: m
        for m in (Member.decode(v) for _, v in kv.iterate(MEMBER_PREFIX))
    }


def decode_records(entries: list[tuple[bytes, bytes]], cls: type[R]) -> list[R]:
    return [cls.decode(v) for _, v in entries]
