"""Pure rules of the registry: integers only, time passed in from the block header."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from planetserve.registry.entities import Member, User


def supermajority(yes_power: int, total_power: int) -> bool:
    """More than 2/3 of the voting power, in integers."""
    return total_power > 0 and 3 * yes_power > 2 * total_power


def blocking_minority(no_power: int, total_power: int) -> bool:
    """At least 1/3 of the power against: a supermajority can no longer be reached."""
    return 3 * no_power >= total_power


def voting_power(voters: Iterable[bytes], members: dict[bytes, Member]) -> int:
    return sum(members[v].power for v in set(voters) if v in members)


def consensus_key_used(members: Iterable[Member], key: bytes) -> bool:
    """Whether one of `members` validates with `key` (two members cannot share a validator)."""
    return any(m.consensus_key == key for m in members)


def hash_sample(tag: bytes, keys: list[bytes], count: int) -> list[bytes]:
    """The `count` keys with the lowest sha256(tag || key), in key order: a choice that no
    participant makes, the same on every validator."""
    ranked = sorted(keys, key=lambda k: hashlib.sha256(tag + k).digest())
    return sorted(ranked[:count])


def user_expiry(now: int, ttl_seconds: int) -> int:
    return now + ttl_seconds


def is_expired(user: User, now: int) -> bool:
    return user.expires_at <= now
