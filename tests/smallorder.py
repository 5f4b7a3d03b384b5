"""An adversary's ed25519 key with a small-order part: A = aB + T with T of order 8. libsodium verifies
signatures under it (cofactorless: the signer grinds its nonce until the small-order terms cancel), but
refuses to convert it to X25519, which is what every onion layer and clove is sealed to."""

from __future__ import annotations

import hashlib
import secrets

P = 2**255 - 19
L = 2**252 + 27742317777372353535851937790883648493
D = -121665 * pow(121666, -1, P) % P
SQRT_M1 = pow(2, (P - 1) // 4, P)

Point = tuple[int, int]


def _x(y: int, sign: int) -> int:
    xx = (y * y - 1) * pow(D * y * y + 1, P - 2, P) % P
    x = pow(xx, (P + 3) // 8, P)
    if (x * x - xx) % P:
        x = x * SQRT_M1 % P
    return P - x if x % 2 != sign else x


def _add(a: Point, b: Point) -> Point:
    (x1, y1), (x2, y2) = a, b
    t = D * x1 * x2 * y1 * y2
    return ((x1 * y2 + x2 * y1) * pow(1 + t, P - 2, P) % P, (y1 * y2 + x1 * x2) * pow(1 - t, P - 2, P) % P)


def _mul(point: Point, e: int) -> Point:
    out: Point = (0, 1)
    while e:
        if e & 1:
            out = _add(out, point)
        point, e = _add(point, point), e >> 1
    return out


def _encode(point: Point) -> bytes:
    x, y = point
    return (y | (x & 1) << 255).to_bytes(32, "little")


def _decode(data: bytes) -> Point:
    y = int.from_bytes(data, "little") & ((1 << 255) - 1)
    return _x(y, data[31] >> 7), y


BASE: Point = (_x(4 * pow(5, P - 2, P) % P, 0), 4 * pow(5, P - 2, P) % P)
TORSION = _decode(bytes.fromhex("26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05"))
"""A point of order 8."""
MINUS_JT = [_mul((P - TORSION[0], TORSION[1]), j) for j in range(8)]


class SmallOrderKeys:
    """Signs like a KeySet (`public`, `sign`), under a key with a small-order part."""

    def __init__(self) -> None:
        self.secret = secrets.randbelow(L - 1) + 1
        self.public = _encode(_add(_mul(BASE, self.secret), TORSION))

    def sign(self, message: bytes) -> bytes:
        while True:
            r = secrets.randbelow(L)
            rb = _mul(BASE, r)
            for j, minus in enumerate(MINUS_JT):
                big_r = _encode(_add(rb, minus))
                k = int.from_bytes(hashlib.sha512(big_r + self.public + message).digest(), "little") % L
                if k % 8 == j:  # R + kA = (r + ka)B + (k - j)T, and (k - j)T vanishes
                    return big_r + ((r + k * self.secret) % L).to_bytes(32, "little")
