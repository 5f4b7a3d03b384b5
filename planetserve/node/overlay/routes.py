"""Choosing the relays of a user's onion paths from the verified user list.

A path is `length` distinct relays, the last of which becomes a proxy. Paths of one user prefer
disjoint relays, so a single relay sees at most one clove of each message; when the list is too
small for that, relays repeat across paths but never within one. Whatever the list's size, a new
path's proxy is a relay that ends none of the user's other paths (`proxies`) whenever the list holds
one: a proxy sees every clove its paths carry, so two paths ending at one proxy hand it two cloves of
each message (with k = 2 that could be enough to read a prompt's S-IDA shares together with one more)
and let it count and time all of them. Relays the user has seen fail or corrupt traffic (`avoid`) are
used only when nothing else is left. Randomness comes from `secrets`
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
    proxies: Collection[bytes] = (),
    rng: random.Random | None = None,
) -> list[tuple[bytes, ...]]:
    """`count` paths of `length` relays each; `exclude` (the user itself) is never used, `avoid`
    (relays that misbehaved, relays already carrying the user's paths) only as a last resort, and a
    relay of `proxies` (those ending the user's other paths) ends a new path only when every relay of
    the list does; the `count` paths end at distinct proxies too when the list allows."""
    rng = rng or _SYSTEM
    excluded = set(exclude)
    pool = sorted({c for c in candidates if c not in excluded})
    if len(pool) < length:
        raise NotEnoughRelays(f"{len(pool)} usable relays in the user list; a path needs {length}")
    avoided, taken = set(avoid), set(proxies)
    preferred = [c for c in pool if c not in avoided and c not in taken]
    if len(preferred) >= length * count:
        picked = rng.sample(preferred, length * count)
        return [tuple(picked[i * length:(i + 1) * length]) for i in range(count)]
    routes = []
    for _ in range(count):
        # the proxy first: untaken and not avoided, else untaken, else any relay of the list
        proxy = rng.choice(preferred or [c for c in pool if c not in taken] or pool)
        hops = [c for c in preferred if c != proxy]
        route = rng.sample(hops, min(length - 1, len(hops)))
        rest = [c for c in pool if c not in route and c != proxy]
        route += rng.sample(rest, length - 1 - len(route))
        rng.shuffle(route)
        routes.append((*route, proxy))
        taken.add(proxy)
        preferred = [c for c in preferred if c != proxy]
    return routes
