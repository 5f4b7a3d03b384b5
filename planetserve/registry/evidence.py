"""Evidence that accumulates across epochs: per model node, the tokens its attested answers had checked
and how many of them fell beyond the verifiers' tolerance, and a sequential test over those counts that
flags a node whose rate of deviating tokens is above what honest engines produce.

Why: one epoch's few answers say little about a node that deviates on one token in a hundred (a 4-bit
copy of the model, say): its answers score close to 1 and its C(T) stays high. Counted over epochs, its
deviations add up where an honest node's do not. The test is a one-sided CUSUM, in integers only
(millinats), as consensus code must be:

    S <- max(0, S + d * deviation_weight - (n - d) * token_weight)

for an epoch's n checked tokens of which d deviated, with deviation_weight = 1000 ln(p1 / p0) and
token_weight = 1000 ln((1 - p0) / (1 - p1)) for an honest deviation rate p0 and a rate to catch p1; the
node is flagged while S >= threshold (1000 ln(1 / alpha)), and a flagged node's C(T) is 0. The defaults
take p0 = 0.1 % and p1 = 1 % with alpha = 1e-4: about four deviations close together flag a node, and
an honest node's clean tokens pull S back to 0. S has no ceiling: a node that deviated heavily stays
flagged until its clean tokens have paid its deviations back, one clean token per 9 millinats (a node
that served a weaker model for an epoch, a hundred deviations, needs some 25,000). docs/detection.md
gives the measured rates.
"""

from __future__ import annotations

from dataclasses import dataclass

from planetserve.registry.params import Params


@dataclass(frozen=True)
class EvidenceRule:
    deviation_weight: int
    """Millinats a deviating token adds."""
    token_weight: int
    """Millinats a clean token takes away."""
    threshold: int
    """Millinats at and above which the node is flagged."""

    @classmethod
    def from_params(cls, params: Params) -> EvidenceRule:
        return cls(params.evidence_deviation_weight, params.evidence_token_weight, params.evidence_threshold)


def accumulate(rule: EvidenceRule, cusum: int, checked: int, deviations: int) -> int:
    """The statistic after an epoch in which `checked` tokens were checked and `deviations` of them
    deviated."""
    if not 0 <= deviations <= checked:
        raise ValueError(f"{deviations} deviations among {checked} checked tokens")
    return max(0, cusum + deviations * rule.deviation_weight - (checked - deviations) * rule.token_weight)


def flagged(rule: EvidenceRule, cusum: int) -> bool:
    return cusum >= rule.threshold
