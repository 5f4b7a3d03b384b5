"""A member's key rotation in its validator's home: the keys it rotates to wait beside the current
ones (`*.next.json`) until the ledger's rotation takes effect; then they replace them, the consensus key
in CometBFT's own file format, and the previous operator keys stay as `*.retired.json`, whose X25519 key
opens the plan that was sealed before the rotation."""

from __future__ import annotations

import base64
import json
from pathlib import Path

from nacl.signing import SigningKey

from planetserve.chain.abci.epochs import validator_address
from planetserve.chain.keys import KeySet, next_key_file, retired_key_file, write_private
from planetserve.genesis.network import KEYS_FILE

PRIV_VALIDATOR_KEY = "priv_validator_key.json"


class RotationFileError(Exception):
    """The home's key files are not as a rotation needs them."""


def consensus_key_document(key: SigningKey) -> dict:
    """CometBFT's priv_validator_key.json for an ed25519 key."""
    public = bytes(key.verify_key)
    return {"address": validator_address(public).hex().upper(),
            "pub_key": {"type": "tendermint/PubKeyEd25519", "value": base64.b64encode(public).decode()},
            "priv_key": {"type": "tendermint/PrivKeyEd25519",
                         "value": base64.b64encode(bytes(key) + public).decode()}}


def load_consensus_key(path: Path) -> SigningKey:
    try:
        raw = base64.b64decode(json.loads(path.read_text())["priv_key"]["value"])
        return SigningKey(raw[:32])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RotationFileError(f"{path} is not a CometBFT ed25519 validator key: {exc}") from exc


def _paths(home: Path) -> tuple[Path, Path]:
    return home / "config" / KEYS_FILE, home / "config" / PRIV_VALIDATOR_KEY


def prepare(home: Path) -> tuple[KeySet, SigningKey]:
    """The keys to rotate to: those already prepared (a rotation sent again reuses them), else fresh."""
    keys_file, consensus_file = (next_key_file(p) for p in _paths(home))
    if not keys_file.exists():
        KeySet.generate().save(keys_file)
    if not consensus_file.exists():
        write_private(consensus_file, json.dumps(consensus_key_document(SigningKey.generate()), indent=2))
    return KeySet.load(keys_file), load_consensus_key(consensus_file)


def prepared(home: Path) -> tuple[KeySet, SigningKey]:
    keys_file, consensus_file = (next_key_file(p) for p in _paths(home))
    if not (keys_file.exists() and consensus_file.exists()):
        raise RotationFileError(f"{home} has no prepared rotation ({keys_file.name} and "
                                f"{consensus_file.name}): send one first")
    return KeySet.load(keys_file), load_consensus_key(consensus_file)


def finish(home: Path) -> None:
    """Put the rotated-to keys in place (the validator must be stopped): the operator keys before keep
    their file as *.retired.json; the old consensus key's file is replaced."""
    keys_path, consensus_path = _paths(home)
    prepared(home)
    keys_path.replace(retired_key_file(keys_path))
    next_key_file(keys_path).replace(keys_path)
    next_key_file(consensus_path).replace(consensus_path)
