"""Getting onto the ledger: a model node's registration (signed by its organisation, with the node's
proof of possession) kept equal to its configuration, and a user relay's self-registration and
heartbeats."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

from planetserve.chain.client import LedgerClient
from planetserve.chain.errors import Code
from planetserve.chain.keys import KeySet
from planetserve.chain.messages.base import Message
from planetserve.chain.messages.registry import (
    Heartbeat,
    RegisterModelNode,
    RegisterUser,
    RotateNodeKey,
    UpdateModelNode,
)
from planetserve.node.home import ModelNodeConfig, UserConfig
from planetserve.registry.entities import ModelNode, NodeRotation, User


class RegistrationError(Exception):
    """The node is not registered and cannot register itself, or the ledger refused it."""


@dataclass(frozen=True)
class Registered:
    node: ModelNode
    action: str
    """"existing", "registered" or "updated"."""


SEQUENCE_PATIENCE = 60.0
"""Seconds a node retries a sequence another node of its organisation took first. The sequence it reads
moves on only once that one's transaction commits, some blocks later, so nodes starting together queue
behind each other: the fourth of four waited about three commits (five tries in 7 s were not always
enough at CometBFT's default pace)."""


def _submit(ledger: LedgerClient, org_keys: KeySet, msg: Message) -> None:
    """Submit, retrying a sequence clash: an organisation's nodes starting together all sign with its
    key, and all but one of them took a sequence another one used first."""
    deadline = time.monotonic() + SEQUENCE_PATIENCE
    while True:
        result = ledger.submit(org_keys, msg)
        if result.outcome.code != Code.BAD_SEQUENCE or time.monotonic() >= deadline:
            break
        time.sleep(0.5 + secrets.randbelow(1000) / 1000)
    if not result.outcome.ok:
        raise RegistrationError(f"{msg.TYPE} refused (code {result.outcome.code}): {result.outcome.log}")


def rotate_key(ledger: LedgerClient, config: ModelNodeConfig, node_keys: KeySet, new_keys: KeySet,
               org_keys: KeySet) -> NodeRotation:
    """Ask the ledger to move the node to `new_keys` at the next epoch's first block."""
    _submit(ledger, org_keys, RotateNodeKey.signed(ledger.chain_id(), config.org_id, node_keys, new_keys))
    rotation = ledger.rotation(node_keys.public)
    if rotation is None:
        raise RegistrationError("the rotation was accepted but the ledger does not show it yet; query again")
    return rotation


def rotated_record(ledger: LedgerClient, new_keys: KeySet | None) -> ModelNode | None:
    """The node's record under the key it rotates to, once the rotation has taken effect."""
    return ledger.node(new_keys.public) if new_keys is not None else None


def ensure_registered(ledger: LedgerClient, config: ModelNodeConfig, node_keys: KeySet,
                      org_keys: KeySet | None) -> Registered:
    """The node's ledger record, registering or updating it with the organisation's key if needed."""
    current = ledger.node(node_keys.public)
    if current is None:
        if org_keys is None:
            raise RegistrationError(
                f"node {node_keys.public.hex()} is not registered; its organisation registers it with "
                f"`planetserve tx register-model-node --org-id {config.org_id} "
                f"--node-keys <home>/node_keys.json "
                f"--model-id {config.model_id} --address {config.address} --hardware {config.hardware} "
                f"--capacity {config.capacity} --region {config.region} --keys <org keys>`, "
                f"or pass --org-keys to this command")
        registration = RegisterModelNode.signed(
            ledger.chain_id(), config.org_id, node_keys, model_id=config.model_id, address=config.address,
            hardware=config.hardware, capacity=config.capacity, region=config.region, **_sizes(config))
        _submit(ledger, org_keys, registration)
        return Registered(_read(ledger, node_keys), "registered")
    if current.model_id != config.model_id or current.org_id != config.org_id:
        raise RegistrationError(
            f"node {node_keys.public.hex()[:16]} is registered for model {current.model_id!r} of "
            f"{current.org_id!r}, not {config.model_id!r} of {config.org_id!r}; "
            f"use a new home for another model")
    changes = {k: v for k, v in (("address", config.address), ("capacity", config.capacity),
                                 ("region", config.region), ("status", "active"), *_sizes(config).items())
               if getattr(current, k) != v}
    if not changes:
        return Registered(current, "existing")
    if org_keys is None:
        raise RegistrationError(f"the registered {', '.join(sorted(changes))} differ from the configuration; "
                                f"pass --org-keys so the organisation can update them")
    _submit(ledger, org_keys, UpdateModelNode(node_keys.public, **changes))
    return Registered(_read(ledger, node_keys), "updated")


def _sizes(config: ModelNodeConfig) -> dict[str, int]:
    """What the node declares for pipelines; nothing when it declares no memory."""
    if not config.memory_mib:
        return {}
    return {"memory_mib": config.memory_mib, "gflops": config.gflops}


def _read(ledger: LedgerClient, node_keys: KeySet) -> ModelNode:
    node = ledger.node(node_keys.public)
    if node is None:
        raise RegistrationError("the registration was committed but the node is not in the verified state")
    return node


def ensure_user(ledger: LedgerClient, config: UserConfig, keys: KeySet) -> tuple[User, str]:
    """The relay's user record, registered ("registered") or renewed with the configured address and
    region ("renewed")."""
    current = ledger.user(keys.public)
    if current is None:
        _submit(ledger, keys, RegisterUser(config.address, config.region))
        action = "registered"
    else:
        heartbeat(ledger, keys, config)
        action = "renewed"
    user = ledger.user(keys.public)
    if user is None:
        raise RegistrationError("the registration was committed but the user is not in the verified state")
    return user, action


def heartbeat(ledger: LedgerClient, keys: KeySet, config: UserConfig) -> None:
    """Renew the registration before its time-to-live runs out (and correct the address if it moved)."""
    _submit(ledger, keys, Heartbeat(config.address, config.region))
