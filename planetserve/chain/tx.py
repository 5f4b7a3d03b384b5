"""The one transaction envelope: type, body, signer, per-account sequence, chain id, ed25519 signature.

Wire form: the canonical msgpack array [1, type, body, signer, sequence, chain_id, signature].
The signature covers the canonical msgpack of ["planetserve/tx/v1", chain_id, type, body, signer,
sequence], so a signature is bound to one chain, one account position and one exact body.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from planetserve.chain.errors import Code, TxError
from planetserve.chain.keys import KeySet, verify_signature
from planetserve.chain.messages.base import Message
from planetserve.registry import codec

VERSION = 1
DOMAIN = "planetserve/tx/v1"
CONTAINER_BYTES = 16
"""A transaction of n bytes may decode into at most `max_containers(n)` arrays and maps. Each container
a valid message holds comes with a 32-byte key or several fields (a plan entry, a result, a score, a
sealed box), so valid transactions stay well inside the bound (tests/adversaries/test_checktx_flood.py
builds the densest of each). A body of empty lists, one byte each on the wire and a Python object and
a microsecond of decoding each, is refused after that many, not after 16,000."""


def max_containers(size: int) -> int:
    """Arrays and maps a transaction of `size` bytes may hold (the envelope and body among them)."""
    return 16 + size // CONTAINER_BYTES


@dataclass(frozen=True)
class Tx:
    type: str
    body: dict[str, Any]
    signer: bytes
    sequence: int
    chain_id: str
    signature: bytes = b""

    def sign_bytes(self) -> bytes:
        return codec.pack([DOMAIN, self.chain_id, self.type, self.body, self.signer, self.sequence])

    def encode(self) -> bytes:
        return codec.pack(
            [VERSION, self.type, self.body, self.signer, self.sequence, self.chain_id, self.signature]
        )

    def signature_valid(self) -> bool:
        return verify_signature(self.signer, self.sign_bytes(), self.signature)


def build(keys: KeySet, chain_id: str, tx_type: str, body: dict[str, Any], sequence: int) -> bytes:
    """Sign and encode a transaction."""
    unsigned = Tx(tx_type, body, keys.public, sequence, chain_id)
    return Tx(tx_type, body, keys.public, sequence, chain_id, keys.sign(unsigned.sign_bytes())).encode()


def sign(keys: KeySet, chain_id: str, msg: Message, sequence: int) -> bytes:
    """Sign and encode the transaction that carries `msg`."""
    return build(keys, chain_id, msg.TYPE, msg.body(), sequence)


def decode(raw: bytes, max_bytes: int) -> Tx:
    """Parse the envelope; raises TxError(OVERSIZE | UNDECODABLE) with the reason."""
    if len(raw) > max_bytes:
        raise TxError(Code.OVERSIZE, f"oversize: {len(raw)} bytes exceeds the limit of {max_bytes}")
    try:
        fields = codec.unpack(raw, max_size=max_bytes, max_containers=max_containers(len(raw)))
    except codec.LimitExceeded as exc:
        raise TxError(Code.UNDECODABLE, f"undecodable: {exc} in a transaction of {len(raw)} bytes (one per "
                                        f"{CONTAINER_BYTES} bytes, and 16, are allowed)") from exc
    except codec.CodecError as exc:
        raise TxError(Code.UNDECODABLE, f"undecodable: {exc}") from exc
    if not isinstance(fields, list) or len(fields) != 7:
        raise TxError(Code.UNDECODABLE, "undecodable: envelope must be a 7-element array")
    version, tx_type, body, signer, sequence, chain_id, signature = fields
    problems = [
        (version == VERSION, f"unsupported envelope version {version!r}"),
        (isinstance(tx_type, str), "type must be a string"),
        (isinstance(body, dict), "body must be a map"),
        (isinstance(signer, bytes) and len(signer) == 32, "signer must be a 32-byte public key"),
        (isinstance(sequence, int) and not isinstance(sequence, bool) and sequence >= 0,
         "sequence must be a non-negative integer"),
        (isinstance(chain_id, str), "chain_id must be a string"),
        (isinstance(signature, bytes) and len(signature) == 64, "signature must be 64 bytes"),
    ]
    for ok, reason in problems:
        if not ok:
            raise TxError(Code.UNDECODABLE, f"undecodable: {reason}")
    return Tx(tx_type, body, signer, sequence, chain_id, signature)
