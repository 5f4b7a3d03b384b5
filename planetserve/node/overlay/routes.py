"""Choosing the relays of a user's onion paths from the verified user list.

A path is `length` distinct relays, the last of which becomes a proxy. Paths of one user prefer
disjoint relays, so a single relay sees at most one clove of each message; when the list is too
small for that, relays repeat across paths but never within one. Relays the user has seen fail or
corrupt traffic (`avoid`) are used only when nothing else is left. Randomness comes from `secrets`
unless a seeded generator is passed (simulations and tests).
"""

from __future__ import annotations

import random
import secrets
from collections.abc import Collection, Sequence

PATH_LENGTH = 3

_SYSTEM = secrets.SystemRandom()


class NotEnoughRelays(Exception):
    """The verified user list holds too few other relays to build a path."""


def choose_routes(
    candidates: Sequence[bytes],
    count: int,
    *,
    length: int = PATH_LENGTH,
    exclude: Collection[bytes] = (),
    avoid: Collection[bytes] = (),
    rng: random.Random | None = None,
) -> list[tuple[bytes, ...]]:
    """`count` paths of `length` relays each; `exclude` (the user itself, relays already carrying
    its paths) is never used, `avoid` only as a last resort."""
    rng = rng or _SYSTEM
    excluded = set(exclude)
    pool = sorted({c for c in candidates if c not in excluded})
    if len(pool) < length:
        raise NotEnoughRelays(f"{len(pool)} usable relays in the user list; a path needs {length}")
    avoided = set(avoid)
    preferred = [c for c in pool if c not in avoided]
    if len(preferred) >= length * count:
        picked = rng.sample(preferred, length * count)
        return [tuple(picked[i * length:(i + 1) * length]) for i in range(count)]
    routes = []
    for _ in range(count):
        route = rng.sample(preferred, min(length, len(preferred)))
        rest = [c for c in pool if c not in route]
        route += rng.sample(rest, length - len(route))
        rng.shuffle(route)
        routes.append(tuple(route))
    return routes
