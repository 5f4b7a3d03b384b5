"""ECVRF per RFC 9381, suite ECVRF-EDWARDS25519-SHA512-TAI (suite_string 0x03), for committee leader election.

Each committee member proves over the epoch's seed with its VRF key; anyone holding the member's public key
verifies the proof and gets the same 64-byte output beta, so a leader drawn from the betas is
unpredictable beforehand yet checkable by every validator. The secret is a 32-byte ed25519 seed and the
public key is the matching ed25519 verify key (RFC 9381 section 5.1 / RFC 8032 section 5.1.5).

Group operations run on libsodium through PyNaCl. Its point decoder is lax (it takes y >= p, and x = 0 with
the sign bit set), so encodings are checked strictly here (RFC 8032 section 5.1.3); its scalar
multiplications refuse points outside the prime-order subgroup, so the cofactor is cleared with point
additions, which only require a point on the curve. Beyond RFC 9381's validate_key, verify also rejects a
public key or Gamma outside the prime-order subgroup: an honest prover never produces one, and every proof
accepted here is accepted by the RFC's verifier.
"""

from __future__ import annotations

import hashlib

from nacl.bindings import (
    crypto_core_ed25519_add,
    crypto_core_ed25519_is_valid_point,
    crypto_core_ed25519_sub,
    crypto_scalarmult_ed25519_base_noclamp,
    crypto_scalarmult_ed25519_noclamp,
)

SUITE = b"\x03"
PROOF_BYTES = 80
OUTPUT_BYTES = 64
KEY_BYTES = 32

_P = 2**255 - 19
_Q = 2**252 + 27742317777372353535851937790883648493
_D = -121665 * pow(121666, -1, _P) % _P
_IDENTITY = bytes([1]) + bytes(31)
_C_BYTES = 16


class VrfError(ValueError):
    """A key, proof or output is malformed or does not verify."""


def public_key(secret: bytes) -> bytes:
    """Y = x*B for the 32-byte seed `secret`; equals the seed's ed25519 verify key."""
    x, _ = _expand(secret)
    return _mul_base(x)


def prove(secret: bytes, alpha: bytes) -> bytes:
    """The 80-byte proof pi = Gamma || c || s over `alpha` (RFC 9381 section 5.1)."""
    x, nonce_key = _expand(secret)
    y = _mul_base(x)
    h = _encode_to_curve(y, alpha)
    gamma = _mul(x, h)
    k = int.from_bytes(hashlib.sha512(nonce_key + h).digest(), "little") % _Q
    c = _challenge(y, h, gamma, _mul_base(k), _mul(k, h))
    s = (k + c * x) % _Q
    return gamma + c.to_bytes(_C_BYTES, "little") + s.to_bytes(32, "little")


def proof_to_hash(pi: bytes) -> bytes:
    """The 64-byte output beta of a proof (RFC 9381 section 5.2); does not verify the proof."""
    gamma, _, _ = _decode_proof(pi)
    return _beta(gamma)


def verify(public: bytes, pi: bytes, alpha: bytes) -> bytes:
    """Beta if `pi` is a valid proof over `alpha` under `public` (RFC 9381 section 5.3); else VrfError."""
    if len(public) != KEY_BYTES:
        raise VrfError(f"public key must be {KEY_BYTES} bytes")
    if not _decodes(public):
        raise VrfError("public key is not a valid curve point")
    _require_prime_order(public, "public key")
    gamma, c, s = _decode_proof(pi)
    _require_prime_order(gamma, "proof's Gamma")
    h = _encode_to_curve(public, alpha)
    u = crypto_core_ed25519_sub(_mul_base(s), _mul(c, public))
    v = crypto_core_ed25519_sub(_mul(s, h), _mul(c, gamma))
    if _challenge(public, h, gamma, u, v) != c:
        raise VrfError("proof does not verify")
    return _beta(gamma)


def _expand(secret: bytes) -> tuple[int, bytes]:
    """The secret scalar x (clamped, RFC 8032) and the nonce key, the second half of SHA-512(seed)."""
    if len(secret) != KEY_BYTES:
        raise VrfError(f"secret key must be {KEY_BYTES} bytes")
    digest = hashlib.sha512(secret).digest()
    x = int.from_bytes(digest[:32], "little") & ((1 << 254) - 8) | (1 << 254)
    return x, digest[32:]


def _encode_to_curve(salt: bytes, alpha: bytes) -> bytes:
    """ECVRF_encode_to_curve_try_and_increment (RFC 9381 section 5.4.1.1), salted with the public key.

    A candidate of small order would give the identity and make libsodium refuse it; reaching one needs a
    SHA-512 preimage of one of a handful of strings, so it is not special-cased.
    """
    ctr = 0
    while True:
        candidate = hashlib.sha512(SUITE + b"\x01" + salt + alpha + ctr.to_bytes(1) + b"\x00").digest()[:32]
        if _decodes(candidate):
            return _times8(candidate)
        ctr += 1


def _challenge(*points: bytes) -> int:
    """ECVRF_challenge_generation (RFC 9381 section 5.4.3): the first 16 bytes of the hash, little-endian."""
    digest = hashlib.sha512(SUITE + b"\x02" + b"".join(points) + b"\x00").digest()
    return int.from_bytes(digest[:_C_BYTES], "little")


def _decode_proof(pi: bytes) -> tuple[bytes, int, int]:
    """ECVRF_decode_proof (RFC 9381 section 5.4.4): Gamma's encoding, c and s."""
    if len(pi) != PROOF_BYTES:
        raise VrfError(f"proof must be {PROOF_BYTES} bytes")
    gamma = pi[:32]
    if not _decodes(gamma):
        raise VrfError("proof's Gamma is not a valid curve point")
    s = int.from_bytes(pi[48:], "little")
    if s >= _Q:
        raise VrfError("proof's s is not reduced")
    return gamma, int.from_bytes(pi[32:48], "little"), s


def _beta(gamma: bytes) -> bytes:
    """ECVRF_proof_to_hash's output from Gamma's encoding: SHA-512 over 8*Gamma."""
    return hashlib.sha512(SUITE + b"\x03" + _times8(gamma) + b"\x00").digest()


def _require_prime_order(point: bytes, what: str) -> None:
    """For a decoded point: not of small order (RFC 9381 validate_key), and in the prime-order subgroup."""
    if _times8(point) == _IDENTITY:
        raise VrfError(f"{what} has small order")
    if not crypto_core_ed25519_is_valid_point(point):
        raise VrfError(f"{what} is not in the prime-order subgroup")


def _decodes(point: bytes) -> bool:
    """Whether `point` is a strict RFC 8032 (section 5.1.3) encoding of a curve point: x^2 = u/v."""
    y = int.from_bytes(point, "little") & ((1 << 255) - 1)
    if y >= _P:
        return False
    u = (y * y - 1) % _P
    v = (_D * y * y + 1) % _P
    v3 = v * v * v % _P
    x = u * v3 * pow(u * v3 * v3 * v, (_P - 5) // 8, _P) % _P
    if v * x * x % _P not in (u, -u % _P):  # no square root of u/v: not on the curve
        return False
    return u != 0 or point[31] >> 7 == 0  # u = 0 means x = 0, whose sign bit must be clear


def _times8(point: bytes) -> bytes:
    """8*P by three doublings; libsodium's point addition accepts any point on the curve."""
    for _ in range(3):
        point = crypto_core_ed25519_add(point, point)
    return point


def _mul(scalar: int, point: bytes) -> bytes:
    """scalar*P for P in the prime-order subgroup; libsodium will not return the identity, so we do."""
    scalar %= _Q
    return crypto_scalarmult_ed25519_noclamp(scalar.to_bytes(32, "little"), point) if scalar else _IDENTITY


def _mul_base(scalar: int) -> bytes:
    """scalar*B, with the identity for a scalar that is 0 mod q."""
    scalar %= _Q
    return crypto_scalarmult_ed25519_base_noclamp(scalar.to_bytes(32, "little")) if scalar else _IDENTITY
