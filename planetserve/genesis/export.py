"""Carrying a chain's state into a new genesis: `planetserve chain export` writes the genesis of a chain
that goes on from a validator's last committed height H (initial height H+1, every state entry, the same
committee); `planetserve genesis init --from-export` takes only the registry from such a file for a new
network with its own committee."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from planetserve.chain.abci.app import BLOCK_TIME_META
from planetserve.chain.abci.state import GENESIS_APP_VERSION
from planetserve.chain.abci.store import StateStore
from planetserve.chain.layout import (
    APP_VERSION_KEY,
    MEMBER_PREFIX,
    NODE_ROTATION_PREFIX,
    PARAMS_KEY,
    REGISTRY_PREFIXES,
)
from planetserve.registry import codec
from planetserve.registry.entities import Member, NodeRotation
from planetserve.registry.errors import RegistryError
from planetserve.registry.genesis import AppState, parse_exported
from planetserve.registry.params import Params


class ExportError(ValueError):
    """A state that cannot be exported, or a file that is not an export."""


def export_genesis(store: StateStore, genesis: dict[str, Any], chain_id: str | None = None) -> dict[str, Any]:
    """The genesis document of the chain of `genesis` going on from `store`'s last committed height: run
    it on a stopped validator (its state must not move while it is read)."""
    with store.snapshot() as view:
        height = view.height
        entries = list(view.entries())
    if not height:
        raise ExportError("the state has no committed height to export")
    if store.height != height:
        raise ExportError("the state moved while it was read: stop the validator's app first")
    kv = dict(entries)
    committee = tuple(Member.decode(v) for k, v in entries if k.startswith(MEMBER_PREFIX))
    version = int(codec.unpack_stored(kv[APP_VERSION_KEY])) if APP_VERSION_KEY in kv else GENESIS_APP_VERSION
    app_state = AppState(Params.decode(kv[PARAMS_KEY]), committee, models=(), prices=(),
                         exported=tuple(entries))
    seconds = int.from_bytes(store.get_meta(BLOCK_TIME_META) or b"", "big")
    consensus = json.loads(json.dumps(genesis["consensus_params"]))
    consensus["version"] = {"app": str(version)}
    return {
        "genesis_time": datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "chain_id": chain_id or genesis["chain_id"],
        "initial_height": str(height + 1),
        "consensus_params": consensus,
        "validators": [
            {"pub_key": {"type": "tendermint/PubKeyEd25519",
                         "value": base64.b64encode(m.consensus_key).decode()},
             "power": str(m.power), "name": m.credential[:64]}
            for m in sorted(committee, key=lambda m: m.consensus_key)
        ],
        "app_hash": "",
        "app_state": app_state.to_json(),
    }


def registry_of(path: Path, chain_id: str) -> tuple[tuple[bytes, bytes], ...]:
    """The registry's entries (`REGISTRY_PREFIXES`) of an exported genesis file, for a new network named
    `chain_id`. The accounts carry their sequences over, so a new network under the exported chain's id
    would take every transaction signed for the old chain at a sequence it has not reached: refused. An
    export with a node rotation still pending is refused: the rotation is due at a height of the old
    chain, so the new one would keep the node under its old key, its new key reserved (`rkey`) for ever."""
    try:
        doc = json.loads(path.read_text())
        exported = parse_exported(doc["app_state"]["exported"])
        old_chain_id = str(doc["chain_id"])
    except (OSError, ValueError, KeyError, TypeError, RegistryError) as exc:
        raise ExportError(f"{path} is not a genesis written by `planetserve chain export`: {exc}") from None
    if chain_id == old_chain_id:
        raise ExportError(f"{path} is an export of chain {old_chain_id!r}: give the new network a chain id "
                          "of its own, or a transaction signed for either chain could be replayed on the "
                          "other (the accounts and their sequences are carried over)")
    pending = [NodeRotation.decode(v) for k, v in exported if k.startswith(NODE_ROTATION_PREFIX)]
    if pending:
        due = max(r.height for r in pending)
        nodes = ", ".join(f"{r.old.hex()[:16]}… → {r.new.hex()[:16]}…" for r in pending[:3])
        raise ExportError(f"{path} holds {len(pending)} node rotation(s) not yet in effect ({nodes}), due by "
                          f"height {due} of the exported chain: a new network would keep those nodes under "
                          f"their old keys; export again once the chain is past that height")
    return tuple((k, v) for k, v in exported if k.startswith(REGISTRY_PREFIXES))
