"""ECVRF-EDWARDS25519-SHA512-TAI: the RFC 9381 vectors, round trips, and that every malformed input is refused."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from nacl.bindings import crypto_core_ed25519_add
from nacl.signing import SigningKey

from planetserve.chain import vrf
from planetserve.chain.vrf import VrfError

Q = 2**252 + 27742317777372353535851937790883648493
P = 2**255 - 19

# RFC 9381 Appendix B.3, Examples 16-18: SK, PK, alpha, H (after cofactor clearing), pi, beta.
RFC_VECTORS = [
    (
        "9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60",
        "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a",
        "",
        "91bbed02a99461df1ad4c6564a5f5d829d0b90cfc7903e7a5797bd658abf3318",
        "8657106690b5526245a92b003bb079ccd1a92130477671f6fc01ad16f26f723f26f8a57ccaed74ee1b190bed1f479d9727d2d0f9b005a6e456a35d4fb0daab1268a1b0db10836d9826a528ca76567805",
        "90cf1df3b703cce59e2a35b925d411164068269d7b2d29f3301c03dd757876ff66b71dda49d2de59d03450451af026798e8f81cd2e333de5cdf4f3e140fdd8ae",
    ),
    (
        "4ccd089b28ff96da9db6c346ec114e0f5b8a319f35aba624da8cf6ed4fb8a6fb",
        "3d4017c3e843895a92b70aa74d1b7ebc9c982ccf2ec4968cc0cd55f12af4660c",
        "72",
        "5b659fc3d4e9263fd9a4ed1d022d75eaacc20df5e09f9ea937502396598dc551",
        "f3141cd382dc42909d19ec5110469e4feae18300e94f304590abdced48aed5933bf0864a62558b3ed7f2fea45c92a465301b3bbf5e3e54ddf2d935be3b67926da3ef39226bbc355bdc9850112c8f4b02",
        "eb4440665d3891d668e7e0fcaf587f1b4bd7fbfe99d0eb2211ccec90496310eb5e33821bc613efb94db5e5b54c70a848a0bef4553a41befc57663b56373a5031",
    ),
    (
        "c5aa8df43f9f837bedb7442f31dcb7b166d38535076f094b85ce3a2e0b4458f7",
        "fc51cd8e6218a1a38da47ed00230f0580816ed13ba3303ac5deb911548908025",
        "af82",
        "bf4339376f5542811de615e3313d2b36f6f53c0acfebb482159711201192576a",
        "9bc0f79119cc5604bf02d23b4caede71393cedfbb191434dd016d30177ccbf8096bb474e53895c362d8628ee9f9ea3c0e52c7a5c691b6c18c9979866568add7a2d41b00b05081ed0f58ee5e31b3a970e",
        "645427e5d00c62a23fb703732fa5d892940935942101e456ecca7bb217c61c452118fec1219202a0edcf038bb6373241578be7217ba85a2687f7a0310b2df19f",
    ),
]

IDENTITY = bytes([1]) + bytes(31)
ORDER_8 = bytes.fromhex("c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac037a")
ORDER_4 = bytes(31) + b"\x80"
ORDER_2 = bytes.fromhex("ecffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f")

SECRET = bytes(range(32))
ALPHA = b"epoch 7 seed"
PUBLIC = vrf.public_key(SECRET)
PI = vrf.prove(SECRET, ALPHA)

secrets_st = st.binary(min_size=32, max_size=32)
alphas_st = st.binary(max_size=64)


def refused(message: str, fn, *args) -> None:
    with pytest.raises(VrfError) as info:
        fn(*args)
    assert str(info.value) == message


@pytest.mark.parametrize(("sk", "pk", "alpha", "h", "pi", "beta"), RFC_VECTORS)
def test_rfc9381_vectors(sk: str, pk: str, alpha: str, h: str, pi: str, beta: str) -> None:
    secret, alpha_b = bytes.fromhex(sk), bytes.fromhex(alpha)
    assert vrf.public_key(secret).hex() == pk
    assert vrf._encode_to_curve(bytes.fromhex(pk), alpha_b).hex() == h
    assert vrf.prove(secret, alpha_b).hex() == pi
    assert vrf.proof_to_hash(bytes.fromhex(pi)).hex() == beta
    assert vrf.verify(bytes.fromhex(pk), bytes.fromhex(pi), alpha_b).hex() == beta


@settings(max_examples=30, deadline=None)
@given(secret=secrets_st, alpha=alphas_st)
def test_round_trip(secret: bytes, alpha: bytes) -> None:
    public = vrf.public_key(secret)
    assert public == SigningKey(secret).verify_key.encode()
    pi = vrf.prove(secret, alpha)
    assert len(pi) == vrf.PROOF_BYTES
    beta = vrf.verify(public, pi, alpha)
    assert beta == vrf.proof_to_hash(pi)
    assert len(beta) == vrf.OUTPUT_BYTES


@settings(max_examples=30, deadline=None)
@given(secret=secrets_st, alpha=alphas_st, other=alphas_st)
def test_deterministic_and_alpha_bound(secret: bytes, alpha: bytes, other: bytes) -> None:
    pi = vrf.prove(secret, alpha)
    assert vrf.prove(secret, alpha) == pi
    if other != alpha:
        assert vrf.proof_to_hash(vrf.prove(secret, other)) != vrf.proof_to_hash(pi)
        refused("proof does not verify", vrf.verify, vrf.public_key(secret), pi, other)


@settings(max_examples=200, deadline=None)
@given(encoding=st.binary(min_size=32, max_size=32))
def test_point_decoding_agrees_with_libsodium(encoding: bytes) -> None:
    """On canonical encodings the strict decoder and libsodium's (reached through addition) agree."""
    y = int.from_bytes(encoding, "little") & ((1 << 255) - 1)
    assume(y < P and y not in (1, P - 1))  # canonical, and not x = 0 where the sign bit alone decides
    try:
        crypto_core_ed25519_add(encoding, encoding)
        on_curve = True
    except RuntimeError:
        on_curve = False
    assert vrf._decodes(encoding) == on_curve


@pytest.mark.parametrize("position", range(vrf.PROOF_BYTES))
@pytest.mark.parametrize("mask", [0x01, 0x80])
def test_every_byte_flip_is_refused(position: int, mask: int) -> None:
    pi = bytearray(PI)
    pi[position] ^= mask
    with pytest.raises(VrfError) as info:
        vrf.verify(PUBLIC, bytes(pi), ALPHA)
    reason = str(info.value)
    if position < 32:
        assert reason in {
            "proof's Gamma is not a valid curve point",
            "proof's Gamma is not in the prime-order subgroup",
            "proof does not verify",
        }
    elif position < 48:
        assert reason == "proof does not verify"
    else:
        assert reason in {"proof's s is not reduced", "proof does not verify"}


def test_wrong_public_key_and_alpha() -> None:
    refused("proof does not verify", vrf.verify, vrf.public_key(bytes(32)), PI, ALPHA)
    refused("proof does not verify", vrf.verify, PUBLIC, PI, ALPHA + b"\x00")
    refused("proof does not verify", vrf.verify, PUBLIC, vrf.prove(bytes(32), ALPHA), ALPHA)


@pytest.mark.parametrize("size", [0, 31, 33, 64])
def test_wrong_key_lengths(size: int) -> None:
    refused("public key must be 32 bytes", vrf.verify, bytes(size), PI, ALPHA)
    refused("secret key must be 32 bytes", vrf.prove, bytes(size), ALPHA)
    refused("secret key must be 32 bytes", vrf.public_key, bytes(size))


@pytest.mark.parametrize("size", [0, 79, 81, 96])
def test_wrong_proof_lengths(size: int) -> None:
    pi = (PI * 2)[:size]
    refused("proof must be 80 bytes", vrf.verify, PUBLIC, pi, ALPHA)
    refused("proof must be 80 bytes", vrf.proof_to_hash, pi)


@pytest.mark.parametrize("point", [IDENTITY, ORDER_2, ORDER_4, ORDER_8], ids=["1", "2", "4", "8"])
def test_small_order_public_key(point: bytes) -> None:
    refused("public key has small order", vrf.verify, point, PI, ALPHA)


@pytest.mark.parametrize(
    "encoding",
    [
        (P + 1).to_bytes(32, "little"),  # y = 1 written as y + p: libsodium reads it as the identity
        (2**255 - 1).to_bytes(32, "little"),  # y = p + 18, non-canonical
        (2).to_bytes(32, "little"),  # y = 2: (y^2 - 1)/(d y^2 + 1) is not a square
        IDENTITY[:31] + b"\x80",  # x = 0 with the sign bit set
    ],
    ids=["y=p+1", "y=2^255-1", "y=2", "x=-0"],
)
def test_public_key_not_a_point(encoding: bytes) -> None:
    refused("public key is not a valid curve point", vrf.verify, encoding, PI, ALPHA)


def test_mixed_order_public_key() -> None:
    """A key with a torsion component passes RFC 9381's validate_key but not this stricter check."""
    mixed = crypto_core_ed25519_add(PUBLIC, ORDER_8)
    refused("public key is not in the prime-order subgroup", vrf.verify, mixed, PI, ALPHA)


def test_gamma_checks() -> None:
    mixed = crypto_core_ed25519_add(PI[:32], ORDER_8) + PI[32:]
    refused("proof's Gamma is not in the prime-order subgroup", vrf.verify, PUBLIC, mixed, ALPHA)
    assert vrf.proof_to_hash(mixed) == vrf.proof_to_hash(PI)  # beta is taken of 8*Gamma
    refused("proof's Gamma has small order", vrf.verify, PUBLIC, IDENTITY + PI[32:], ALPHA)
    refused(
        "proof's Gamma is not a valid curve point", vrf.proof_to_hash, (2).to_bytes(32, "little") + PI[32:]
    )


@pytest.mark.parametrize("extra", [0, 1, 7])
def test_unreduced_s(extra: int) -> None:
    s = int.from_bytes(PI[48:], "little")
    for bad in (Q + extra, s + Q):
        pi = PI[:48] + bad.to_bytes(32, "little")
        refused("proof's s is not reduced", vrf.verify, PUBLIC, pi, ALPHA)
        refused("proof's s is not reduced", vrf.proof_to_hash, pi)


def test_zero_c_and_s_are_refused_not_crashed() -> None:
    """Zero scalars give the identity, which libsodium's multiplication refuses to return."""
    for c, s in ((0, 0), (0, 5), (5, 0)):
        pi = PI[:32] + c.to_bytes(16, "little") + s.to_bytes(32, "little")
        refused("proof does not verify", vrf.verify, PUBLIC, pi, ALPHA)
