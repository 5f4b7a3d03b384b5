"""Handlers of the registry family. Each checks against the state, then writes through it; a refusal
raises a RegistryError before any write becomes visible (the caller discards the TxScope)."""

from __future__ import annotations

from dataclasses import replace

from planetserve.chain.abci.deployments import heal_node
from planetserve.chain.abci.handlers.context import Context
from planetserve.chain.abci.rotations import next_epoch_start
from planetserve.chain.keys import exchange_capable, verify_signature
from planetserve.chain.messages.registry import (
    Heartbeat,
    RegisterModelNode,
    RegisterOrg,
    RegisterUser,
    RotateNodeKey,
    UpdateModelNode,
    Worked,
    node_pop_message,
    node_rotation_message,
)
from planetserve.registry import reputation, rules, work
from planetserve.registry.entities import ModelNode, NodeRotation, Organisation, User
from planetserve.registry.epochs import Reputation
from planetserve.registry.errors import AlreadyExists, Expired, InsufficientWork, InvalidField, UnknownEntity


def _check_work(ctx: Context, msg: Worked) -> None:
    """A new identity costs 2^bits hashes (registry/work.py); checked before anything is read."""
    bits = msg.bits(ctx.params)
    if not work.meets(ctx.chain_id, msg.TYPE, ctx.signer, msg.work or 0, bits):
        raise InsufficientWork(f"{msg.TYPE} needs a proof of work of {bits} leading zero bits over "
                               f"(chain id, type, signer key) in `work`; clients compute it "
                               f"(planetserve.registry.work.solve)")


def register_org(ctx: Context, msg: RegisterOrg) -> None:
    _check_work(ctx, msg)
    if ctx.state.org(msg.org_id) is not None:
        raise AlreadyExists(f"organisation {msg.org_id!r} is already registered")
    ctx.state.put_org(Organisation(msg.org_id, msg.name, ctx.signer, ctx.time))
    ctx.emit("register_org", org_id=msg.org_id)


def _sealable(key: bytes, name: str) -> None:
    if not exchange_capable(key):
        raise InvalidField(name, "is an ed25519 key with a small-order part: no onion layer or clove can be "
                                 "sealed to it")


def register_user(ctx: Context, msg: RegisterUser) -> None:
    _check_work(ctx, msg)
    _sealable(ctx.signer, "signer")
    existing = ctx.state.user(ctx.signer)
    if existing is not None and not rules.is_expired(existing, ctx.time):
        raise AlreadyExists("user key is already registered; send a heartbeat to renew it")
    expires = rules.user_expiry(ctx.time, ctx.params.user_ttl_seconds)
    if existing is not None:
        ctx.state.delete_user(existing)
    ctx.state.put_user(User(ctx.signer, msg.address, msg.region, ctx.time, expires))
    ctx.emit("register_user", user=ctx.signer.hex())


def heartbeat(ctx: Context, msg: Heartbeat) -> None:
    user = ctx.state.user(ctx.signer)
    if user is None:
        raise UnknownEntity("user is not registered (or expired and was removed); register again")
    if rules.is_expired(user, ctx.time):
        raise Expired("user registration has expired; register again")
    renewed = replace(
        user,
        address=msg.address or user.address,
        region=msg.region or user.region,
        expires_at=rules.user_expiry(ctx.time, ctx.params.user_ttl_seconds),
    )
    ctx.state.put_user(renewed)
    ctx.emit("heartbeat", user=ctx.signer.hex())


def _known_model(ctx: Context, model_id: str) -> None:
    if ctx.state.model(model_id) is None:
        raise UnknownEntity(f"model {model_id!r} is not registered")


def register_model_node(ctx: Context, msg: RegisterModelNode) -> None:
    ctx.owned_org(msg.org_id)
    _known_model(ctx, msg.model_id)
    if not verify_signature(msg.node_pubkey, node_pop_message(ctx.chain_id, msg.org_id, msg.node_pubkey),
                            msg.pop):
        raise InvalidField("pop", "is not a signature by node_pubkey over the registration")
    if ctx.state.node(msg.node_pubkey) is not None:
        raise AlreadyExists("model node key is already registered")
    _sealable(msg.node_pubkey, "node_pubkey")
    _not_rotated(ctx, msg.node_pubkey, "node_pubkey")
    start = _new_standing(ctx, msg.org_id, msg.node_pubkey)
    ctx.state.put_node(ModelNode(
        pubkey=msg.node_pubkey,
        org_id=msg.org_id,
        model_id=msg.model_id,
        address=msg.address,
        hardware=msg.hardware,
        capacity=msg.capacity,
        region=msg.region,
        status="active",
        registered_at=ctx.time,
        memory_mib=msg.memory_mib or 0,
        gflops=msg.gflops or 0,
    ), at=ctx.time)
    ctx.emit("register_model_node", node=msg.node_pubkey.hex(), org_id=msg.org_id, model_id=msg.model_id,
             reputation=str(start.value), probation=str(start.probation))


def _new_standing(ctx: Context, org_id: str, node: bytes) -> Reputation:
    """A new key's reputation record, stored before its node so that the node is listed only once it
    has earned it: bounded by its organisation's record, on probation for the genesis' epochs."""
    rule = reputation.ReputationRule.from_params(ctx.params)
    floor = ctx.state.org_reputation(org_id)
    value = reputation.starting(rule, () if floor is None else (floor,))
    record = Reputation(node, value, (), 0, 0, reputation.is_trusted(rule, value), rule.probation)
    ctx.state.put_reputation(record)
    ctx.state.add_org_node(org_id, node)
    ctx.state.put_org_reputation(org_id, value)  # at most the floor it started from
    return record


def _not_rotated(ctx: Context, key: bytes, name: str) -> None:
    rotation = ctx.state.retired(key)
    if rotation is None:
        return
    role = "retired by" if rotation.old == key else "reserved for"
    raise AlreadyExists(f"{name} {key.hex()[:16]} is {role} the rotation of node {rotation.old.hex()[:16]} "
                        f"at height {rotation.height}; no registration may take it")


def _registered_node(ctx: Context, key: bytes) -> ModelNode:
    node = ctx.state.node(key)
    if node is not None:
        return node
    rotation = ctx.state.retired(key)
    if rotation is not None and rotation.old == key:
        raise UnknownEntity(f"model node key {key.hex()[:16]} was rotated to {rotation.new.hex()} at height "
                            f"{rotation.height}; the old key is refused from then on")
    raise UnknownEntity("model node is not registered")


def update_model_node(ctx: Context, msg: UpdateModelNode) -> None:
    node = _registered_node(ctx, msg.node_pubkey)
    ctx.owned_org(node.org_id)
    changes = {name: value for name in ("address", "capacity", "region", "status", "model_id", "memory_mib",
                                        "gflops") if (value := getattr(msg, name)) is not None}
    updated = replace(node, **changes)
    if updated.model_id != node.model_id:
        _known_model(ctx, updated.model_id)
    ctx.state.put_node(updated, at=ctx.time)
    ctx.emit("update_model_node", node=msg.node_pubkey.hex())
    for kind, attributes in heal_node(ctx.state, ctx.params, ctx.time, msg.node_pubkey):
        ctx.emit(kind, **attributes)


def rotate_node_key(ctx: Context, msg: RotateNodeKey) -> None:
    node = _registered_node(ctx, msg.node_pubkey)
    ctx.owned_org(node.org_id)
    message = node_rotation_message(ctx.chain_id, node.org_id, msg.node_pubkey, msg.new_pubkey)
    if not verify_signature(msg.node_pubkey, message, msg.old_signature):
        raise InvalidField("old_signature", "is not a signature by node_pubkey over the rotation")
    if not verify_signature(msg.new_pubkey, message, msg.new_signature):
        raise InvalidField("new_signature", "is not a signature by new_pubkey over the rotation")
    pending = ctx.state.retired(msg.node_pubkey)
    if pending is not None:
        raise AlreadyExists(f"node already rotates to {pending.new.hex()[:16]} at height {pending.height}")
    if ctx.state.node(msg.new_pubkey) is not None:
        raise AlreadyExists("new_pubkey is already a registered model node's key")
    _sealable(msg.new_pubkey, "new_pubkey")
    _not_rotated(ctx, msg.new_pubkey, "new_pubkey")
    height = next_epoch_start(ctx.params, ctx.height)
    ctx.state.put_node_rotation(NodeRotation(msg.node_pubkey, msg.new_pubkey, node.org_id, height))
    ctx.emit("rotate_node_key", node=msg.node_pubkey.hex(), new=msg.new_pubkey.hex(), height=str(height))


HANDLERS = {
    RegisterOrg: register_org,
    RegisterUser: register_user,
    Heartbeat: heartbeat,
    RegisterModelNode: register_model_node,
    UpdateModelNode: update_model_node,
    RotateNodeKey: rotate_node_key,
}
