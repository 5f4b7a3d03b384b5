"""Proof of work for registrations: the price of a new identity (docs/threat-model.md, "Client").

A registration of `kind` ("register-user" or "register-org") by the key `signer` on chain `chain_id`
carries a nonce `work` (0 to 2^64 - 1) such that

    sha256(canonical msgpack ["planetserve/work/v1", chain_id, kind, signer, work])

begins with at least `bits` zero bits. The digest is bound to the chain and to the key, so one solution
buys one key on one chain and cannot be reused for another; the chain checks it with one hash. Finding
one takes 2^bits hashes on average. Integers only: the rule is the same on every machine.
"""

from __future__ import annotations

import hashlib

from planetserve.registry import codec

DOMAIN = "planetserve/work/v1"
MAX_NONCE = (1 << 64) - 1


def digest(chain_id: str, kind: str, signer: bytes, work: int) -> bytes:
    return hashlib.sha256(codec.pack([DOMAIN, chain_id, kind, signer, work])).digest()


def zero_bits(value: bytes) -> int:
    """Leading zero bits of a digest."""
    number = int.from_bytes(value, "big")
    return len(value) * 8 - number.bit_length()


def meets(chain_id: str, kind: str, signer: bytes, work: int, bits: int) -> bool:
    return bits == 0 or zero_bits(digest(chain_id, kind, signer, work)) >= bits


def solve(chain_id: str, kind: str, signer: bytes, bits: int, start: int = 0) -> int:
    """The first nonce from `start` whose digest has `bits` leading zero bits."""
    if bits == 0:
        return start
    prefix = codec.pack([DOMAIN, chain_id, kind, signer])
    # The canonical msgpack of the 5-array is the 4-array's bytes with its header (0x94) turned into
    # 0x95 and the nonce's encoding appended: hash that directly rather than re-packing every try.
    head = bytes([0x95]) + prefix[1:]
    limit = 1 << (256 - bits)
    work = start
    while work <= MAX_NONCE:
        if int.from_bytes(hashlib.sha256(head + codec.pack(work)).digest(), "big") < limit:
            return work
        work += 1
    raise ValueError("no nonce found")  # pragma: no cover - 2^64 tries
