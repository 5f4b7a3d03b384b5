"""How many members must re-challenge a node for its silence to be seen.

A node that answers only the leader's challenge (told it by a colluding member, or guessing it from the
results window's burst) and nothing else, users' requests and members' re-challenges alike, is cut only
where members holding more than a third of the power report it (registry/finalization.py): fewer could
be framing it. Each member re-challenges a node on a secret coin; at the configured share of two thirds,
four members left such a node unreported in 26% of epochs (55% with a colluding member beside the
leader). `rechallenge_share` raises the coin to the least share at which the members who can be
counted on report it with a chosen probability (`silent_escape` in verifier.json): in a small committee
that is every member, every node; in a large one the configured share already is.

The members counted on are all but the most powerful (it may be the leader, who re-challenges nothing)
and, after it, the most powerful ones that hold at most a third of the power together (they may collude
with the node). Powers are rounded down to at most `POWER_STEPS` steps of the total, so the probability
computed is never above the true one."""

from __future__ import annotations

import math
from collections.abc import Sequence

POWER_STEPS = 3000
"""Steps the total power is divided into for the reckoning: exact for committees of equal members
(up to this many), and a lower bound for the rest."""
SHARE_STEP = 0.01
SILENT_ESCAPE = 0.01
"""The most a silent node may expect to escape an epoch unreported, by default: every member
re-challenges every node with four members."""
KEEP_SHARE = 1.0
"""`silent_escape` that keeps `rechallenge_share` as configured."""


def counted_on(powers: Sequence[int]) -> list[int]:
    """The powers of the members whose reports a silent node cannot prevent: all but the most powerful
    (a leader) and the most powerful of the rest holding together at most a third of the total."""
    ordered = sorted(powers, reverse=True)[1:]
    total = sum(powers)
    colluding = 0
    while ordered and 3 * (colluding + ordered[0]) <= total:
        colluding += ordered.pop(0)
    return ordered


def reported(powers: Sequence[int], share: float) -> float:
    """The probability that the members counted on, each re-challenging a node with probability `share`,
    hold more than a third of the power (a lower bound where powers are not multiples of a step)."""
    total = sum(powers)
    if total <= 0:
        return 0.0
    step = max(1, total // POWER_STEPS)
    odds = {0: 1.0}
    for power in counted_on(powers):
        units = power // step
        grown: dict[int, float] = {}
        for held, p in odds.items():
            grown[held] = grown.get(held, 0.0) + p * (1 - share)
            grown[held + units] = grown.get(held + units, 0.0) + p * share
        odds = grown
    return sum(p for held, p in odds.items() if 3 * held * step > total)


def rechallenge_share(powers: Sequence[int], floor: float, escape: float) -> float:
    """The least share, no lower than `floor`, in steps of `SHARE_STEP`, at which a silent node is reported
    by members holding more than a third of the power with probability at least 1 - `escape`; 1 where
    none is (too few members can be counted on)."""
    steps = round(1 / SHARE_STEP)
    for k in range(math.ceil(floor * steps - 1e-9), steps):
        share = max(floor, k / steps)
        if reported(powers, share) >= 1 - escape:
            return share
    return 1.0
