"""Reputation of model nodes (seed planetserve.md 3.4), in exact integer arithmetic.

At epoch T a node's reputation is R(T) = α·R(T-1) + β·C(T), where C(T) in [0, 1] is the epoch's
credibility (the median of the attested values). Sliding-window punishment: the window holds the last
W credibilities *including* C(T), so a bad epoch is punished in the epoch it happens; a value below τ
is abnormal, c counts the abnormal values in the window, and if c/W > γ then
R(T) = α·R(T-1) + (W+1)/(W + c/γ + 2)·C(T). Until W epochs have passed the window is shorter, but c
is still divided by W. A node is trusted while R >= the untrusted threshold.

Fixed point: every fraction is an integer in parts per million (PPM = 1_000_000 means 1.0). With
γ = g/PPM the punished factor is the exact rational (W+1)·g / ((W+2)·g + c·PPM) and the condition
c/W > γ is c·PPM > g·W. Each update puts α·R/PPM + factor·C over one common denominator and rounds
once, half up, so the result is the exact rational value to within 0.5 ppm and identical on every
replica. The result is clamped to [0, PPM] (it can only leave that range if α + β > 1).

Trust is earned. A new key starts at the initial reputation bounded by its organisation's
(`starting`), so a punished operator's fresh key inherits the mark its punished node left. It is on
probation: challenged every epoch like any node, but not listed until it has ended `probation`
consecutive scored epochs trusted (`probation_left`). Organisations are free to register, so a new
organisation escapes the mark; probation, which every new key serves, is what makes a fresh start
cost epochs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Self

from planetserve.registry.params import PPM, Params


@dataclass(frozen=True)
class ReputationRule:
    """The reputation constants; every field except window is in ppm."""

    alpha: int
    beta: int
    window: int
    gamma: int
    abnormal: int
    untrusted: int
    initial: int
    probation: int
    """Consecutive scored epochs a new key must end trusted before it is listed (not in ppm)."""

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"reputation window must be at least 1, got {self.window}")
        if self.probation < 0:
            raise ValueError(f"probation must be at least 0 epochs, got {self.probation}")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name not in ("window", "probation") and not 0 <= value <= PPM:
                raise ValueError(f"reputation {f.name} must be in [0, {PPM}] ppm, got {value}")
        if self.gamma == 0:
            raise ValueError("reputation gamma must be positive: the punished factor divides by it")

    @classmethod
    def from_params(cls, params: Params) -> Self:
        return cls(
            alpha=params.reputation_alpha_ppm,
            beta=params.reputation_beta_ppm,
            window=params.reputation_window,
            gamma=params.reputation_gamma_ppm,
            abnormal=params.abnormal_threshold_ppm,
            untrusted=params.untrusted_threshold_ppm,
            initial=params.initial_reputation_ppm,
            probation=params.probation_epochs,
        )


def _check_ppm(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= PPM:
        raise ValueError(f"{name} must be an integer in [0, {PPM}] ppm, got {value!r}")


def update(rule: ReputationRule, previous: int, credibility: int,
           window: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    """One epoch: (new reputation ppm, new window of the last W credibilities, oldest first).

    `window` is the one returned by the previous update (empty for a new node): at most W values, or
    more where a vote has lowered W since, of which the last W - 1 count with this epoch's. (Refusing a
    longer window raised in every validator's FinalizeBlock once such a vote applied: a chain halt.)
    """
    _check_ppm("previous reputation", previous)
    _check_ppm("credibility", credibility)
    for value in window:
        _check_ppm("window credibility", value)
    new_window = (*window, credibility)[-rule.window:]
    abnormal = sum(1 for value in new_window if value < rule.abnormal)
    if abnormal * PPM > rule.gamma * rule.window:
        num = (rule.window + 1) * rule.gamma
        den = (rule.window + 2) * rule.gamma + abnormal * PPM
    else:
        num, den = rule.beta, PPM
    # R = α·prev/PPM + (num/den)·C, over the common denominator PPM·den, rounded half up.
    numerator = rule.alpha * previous * den + PPM * num * credibility
    denominator = PPM * den
    reputation = (2 * numerator + denominator) // (2 * denominator)
    return min(reputation, PPM), new_window


def starting(rule: ReputationRule, organisation: Iterable[int]) -> int:
    """A new key's reputation: the initial one, or its organisation's reputation (the reputations of
    every node it registered, deactivated ones included) if that is lower. Taking a punished node out
    of service or registering a fresh key beside it does not clear the organisation's record; an
    organisation's first key starts at the initial reputation (there is nothing to bound it by)."""
    return min((rule.initial, *organisation))


def probation_left(rule: ReputationRule, left: int, trusted: bool) -> int:
    """A node's probation after a scored epoch it ended `trusted` or not. One epoch fewer when trusted;
    all of them again when not, so only consecutive trusted epochs pass it (a node cannot bank trusted
    epochs, then cheat and still be listed). Once passed (0) it stays passed: from then on the key has
    a history, and its reputation alone decides whether it is listed."""
    if left == 0:
        return 0
    return left - 1 if trusted else rule.probation


def is_trusted(rule: ReputationRule, reputation: int) -> bool:
    """Trusted at or above the threshold, so a node exactly at it keeps serving."""
    return reputation >= rule.untrusted


def median(values: Sequence[int]) -> int:
    """Median in integers (an even count takes the floor of the two middle values' mean), so that a
    minority of outlying attestations cannot move C(T)."""
    if not values:
        raise ValueError("median of no values")
    ordered = sorted(values)
    mid = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[mid]
    return (ordered[mid - 1] + ordered[mid]) // 2


def organisation_reputation(node_reputations: Iterable[int]) -> int:
    """An organisation's reputation is the minimum of its nodes' reputations, 0 with no nodes.

    The organisation answers for all its nodes (in the paper they share one score), so a single
    dishonest node costs the whole organisation; averaging would let honest nodes hide a cheating one.
    An organisation without nodes has earned nothing, hence 0.
    """
    return min(node_reputations, default=0)
