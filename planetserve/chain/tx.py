"""The one transaction envelope: type, body, signer, per-account sequence, chain id, ed25519 signature.

Wire form: the canonical msgpack array [1, type, body, signer, sequence, chain_id, signature].
The signature covers the canonical msgpack of ["planetserve/tx/v1", chain_id, type, body, signer,
sequence], so a signature is bound to one chain, one account position and one exact body.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from planetserve.chain.errors import Code, TxError
from planetserve.chain.keys import KeySet, verify_signature
from planetserve.chain.messages.base import Message
from planetserve.registry import codec

VERSION = 1
DOMAIN = "planetserve/tx/v1"


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


_FIELDS: tuple[tuple[Callable[[Any], bool], str], ...] = (
    (lambda v: v == VERSION, "unsupported envelope version {!r}"),
    (lambda v: isinstance(v, str), "type must be a string"),
    (lambda v: isinstance(v, dict), "body must be a map"),
    (lambda v: isinstance(v, bytes) and len(v) == 32, "signer must be a 32-byte public key"),
    (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
     "sequence must be a non-negative integer"),
    (lambda v: isinstance(v, str), "chain_id must be a string"),
    (lambda v: isinstance(v, bytes) and len(v) == 64, "signature must be 64 bytes"),
)
"""The envelope's fields in order, each with its check and the reason a value fails it (checked in
order: the first failing field is named)."""


def decode(raw: bytes, max_bytes: int) -> Tx:
    """Parse the envelope; raises TxError(OVERSIZE | UNDECODABLE) with the reason."""
    if len(raw) > max_bytes:
        raise TxError(Code.OVERSIZE, f"oversize: {len(raw)} bytes exceeds the limit of {max_bytes}")
    try:
        fields = codec.unpack(raw, max_size=max_bytes)
    except codec.CodecError as exc:
        raise TxError(Code.UNDECODABLE, f"undecodable: {exc}") from exc
    if not isinstance(fields, list) or len(fields) != 7:
        raise TxError(Code.UNDECODABLE, "undecodable: envelope must be a 7-element array")
    for (ok, reason), value in zip(_FIELDS, fields, strict=True):
        if not ok(value):
            raise TxError(Code.UNDECODABLE, "undecodable: " + reason.format(value))
    _, tx_type, body, signer, sequence, chain_id, signature = fields
    return Tx(tx_type, body, signer, sequence, chain_id, signature)
