"""The verifier: scoring engines over a reference model, and the credibility of model nodes' signed
responses to challenges (section 3.4 of the paper). Imports `chain` (client side), `registry` and
`models`; never `node`."""

from planetserve.verifier.credibility import (
    Answer,
    ReferenceModel,
    Rejection,
    Verdict,
    choice_credibility,
    credibility,
    deviations,
    to_ppm,
)
from planetserve.verifier.remote import OpenAIScorer, ScoringError
from planetserve.verifier.scoring import (
    Algorithm3Scorer,
    Decoding,
    OnePassScorer,
    Pair,
    Scorer,
    TokenScores,
    TorchScorer,
)

__all__ = [
    "Algorithm3Scorer",
    "Answer",
    "Decoding",
    "OnePassScorer",
    "OpenAIScorer",
    "Pair",
    "ReferenceModel",
    "Rejection",
    "Scorer",
    "ScoringError",
    "TokenScores",
    "TorchScorer",
    "Verdict",
    "choice_credibility",
    "credibility",
    "deviations",
    "to_ppm",
]
