"""Credibility of a model node's signed response to a challenge, scored with the verifier's reference model.

Two credibilities, both in [0, 1], higher is better:

- `credibility`: the paper's 1/PPL over the node's returned token ids (section 3.4);
- the calibrated credibility, `choice_credibility`: how far each of the node's tokens falls short of
  what an honest engine holding the reference emits under the decoding the node signed (its temperature
  and seed, `planetserve.sampling`). Greedy or sampled, an honest node has no choice to make, so any
  clear shortfall is evidence; a count of tokens beyond the tolerance goes with it.

Before scoring, a response is checked against what the verifier expected; a `Verdict` carries either
the credibilities or a `Rejection` with a readable detail. The ledger stores credibilities as integer
parts per million (`to_ppm`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from planetserve.chain.challenge import MAX_CHALLENGE_PROMPT_TOKENS, Challenge, response_valid
from planetserve.models.detokenize import TextAssembler
from planetserve.models.prompts import adds_special_tokens
from planetserve.registry.epochs import MILLI, SignedResponse, prompt_hash
from planetserve.registry.params import PPM
from planetserve.verifier.scoring import Decoding, OnePassScorer, Scorer, TokenScores

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from planetserve.models import LoadedModel


def to_ppm(value: float) -> int:
    """A credibility as the ledger's integer parts per million: clamped to [0, 1], rounded to the nearest
    ppm (halves up). NaN has no place on the ledger and is refused."""
    if math.isnan(value):
        raise ValueError("a credibility cannot be NaN")
    return math.floor(min(1.0, max(0.0, value)) * PPM + 0.5)


def credibility(logprobs: Sequence[float]) -> float:
    """The paper's normalised perplexity: 1/PPL = exp(mean log p(t_i | t_<i)), over every token."""
    if not logprobs:
        raise ValueError("perplexity is undefined for an empty response")
    return math.exp(math.fsum(logprobs) / len(logprobs))


TOLERANCE = 0.05
"""Nats by which a token may fall short of the honest choice without cost: ties broken differently by
another engine or batch (float rounding) stay free, a different choice does not. On the project's family
honest answers fall short by under 1e-4 at every temperature (docs/detection.md); a bf16 engine may
need more."""


def choice_credibility(shortfalls: Sequence[float], tolerance: float = TOLERANCE) -> float:
    """exp(-sum_i max(0, s_i - tolerance)), with s_i token i's shortfall under the node's decoding
    (`planetserve.sampling.shortfalls`).

    Why: a node serving the claimed model emits, at every step, the token that maximises the reference's
    log-probability plus the seed's noise scaled by the temperature (none when greedy), so its answer
    scores 1 up to rounding, which the tolerance absorbs. Each token it chose otherwise costs how far its
    noised score falls below the honest choice's, so a clear deviation (a weaker model, an altered
    prompt, an injected passage) drives the score to 0, and a near-tie costs almost nothing. It is a
    sum, not a mean: every extra deviation is extra evidence, and no length dilutes it."""
    if not shortfalls:
        raise ValueError("an empty response has no choices to check")
    return math.exp(-math.fsum(max(0.0, s - tolerance) for s in shortfalls))


def deviations(shortfalls: Sequence[float], tolerance: float = TOLERANCE) -> int:
    """How many tokens fall short of the honest choice by more than the tolerance."""
    return sum(s > tolerance for s in shortfalls)


def decoding(response: SignedResponse, tolerance: float = TOLERANCE) -> Decoding:
    """The decoding a node signed it used (its temperature and top_p in thousandths, and its seed), with
    the verifier's tolerance as the margin of its nucleus."""
    return Decoding(response.temperature / MILLI, response.seed, response.top_p / MILLI, tolerance)


class Rejection(StrEnum):
    """Why a response is not scored. `node_fault` says whether the node's own valid signature proves the
    fault; the others may be the leader's doing (an altered or misdirected response)."""

    WRONG_NODE = "wrong_node"
    BAD_SIGNATURE = "bad_signature"
    WRONG_PROMPT = "wrong_prompt"
    WRONG_MODEL = "wrong_model"
    EMPTY_RESPONSE = "empty_response"
    INVALID_TOKEN_ID = "invalid_token_id"  # noqa: S105 (a rejection code, not a secret)
    TOKENIZATION_MISMATCH = "tokenization_mismatch"
    TOO_LONG = "too_long"

    @property
    def node_fault(self) -> bool:
        return self not in (Rejection.WRONG_NODE, Rejection.BAD_SIGNATURE, Rejection.WRONG_PROMPT)


@dataclass(frozen=True)
class Verdict:
    """A scored response (credibility set, calibrated too when it was asked for) or a rejection."""

    credibility: float | None = None
    calibrated: float | None = None
    tokens: int = 0
    deviations: int = 0
    """Tokens beyond the tolerance (scored with the calibrated rule only)."""
    rejection: Rejection | None = None
    detail: str = ""

    @classmethod
    def reject(cls, rejection: Rejection, detail: str) -> Verdict:
        return cls(rejection=rejection, detail=detail)

    @classmethod
    def scored(cls, scores: TokenScores, tolerance: float = TOLERANCE) -> Verdict:
        """The paper's credibility, and the calibrated one with its deviations when `scores` has
        shortfalls."""
        if scores.shortfalls is None:
            return cls(credibility(scores.logprobs), None, len(scores.logprobs))
        return cls(credibility(scores.logprobs), choice_credibility(scores.shortfalls, tolerance),
                   len(scores.logprobs), deviations(scores.shortfalls, tolerance))

    @property
    def ok(self) -> bool:
        return self.rejection is None

    @property
    def credibility_ppm(self) -> int | None:
        return None if self.credibility is None else to_ppm(self.credibility)

    @property
    def calibrated_ppm(self) -> int | None:
        return None if self.calibrated is None else to_ppm(self.calibrated)


@dataclass(frozen=True)
class Answer:
    """A signed response and what the verifier expects of it: the challenge prompt (as the model reads
    it, i.e. the text whose hash the node signs) and, when known, the challenged node's key."""

    response: SignedResponse
    prompt: str
    node: bytes | None = None


class ReferenceModel:
    """The verifier's local copy of a model: checks responses that claim `model_id` and scores them.

    Empty response: a response without token ids is rejected (`empty_response`) rather than scored 0.
    Perplexity over no tokens is undefined, and no honest engine returns one: generation emits at least
    one token (a stop token ends a response and is part of it). The node signed it, so it is the node's
    fault.
    """

    def __init__(self, model_id: str, tokenizer: PreTrainedTokenizerBase, scorer: Scorer, *, vocab_size: int,
                 max_len: int, calibrated: bool = True, tolerance: float = TOLERANCE,
                 stop_ids: tuple[int, ...] = ()) -> None:
        self.model_id = model_id
        self.stop_ids = stop_ids
        """The ids that end a generation of this model (its generation config's EOS ids), as a model node
        serving it stops on them."""
        self.tokenizer = tokenizer
        self.scorer = scorer
        self.vocab_size = vocab_size
        self.max_len = max_len
        self.calibrated = calibrated
        self.tolerance = tolerance

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, scorer: Scorer | None = None, calibrated: bool = True,
                    model_id: str | None = None, tolerance: float = TOLERANCE
                    ) -> ReferenceModel:
        """A loaded model with the one-pass engine over it unless another scorer is given; `model_id`
        is the id nodes register and sign with, when it is not the checkpoint's own."""
        return cls(model_id or loaded.model_id, loaded.tokenizer, scorer or OnePassScorer(loaded.model),
                   vocab_size=int(loaded.model.get_input_embeddings().num_embeddings),
                   max_len=loaded.max_model_len, calibrated=calibrated, tolerance=tolerance,
                   stop_ids=loaded.stop_token_ids)

    def chat_prompt(self, question: str) -> str | None:
        """`question` as the one user message of a chat, rendered by the model's chat template as a model
        node renders it (and signs it); None for a model without a template."""
        if not getattr(self.tokenizer, "chat_template", None):
            return None
        return self.tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                                  add_generation_prompt=True)

    def encode(self, text: str) -> list[int]:
        """`text`'s token ids without special tokens: how a program spells a stop string as ids."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, prompt: str) -> list[int]:
        """The prompt's ids as the model node computed them (`models.prompts`)."""
        return list(self.tokenizer(prompt, add_special_tokens=adds_special_tokens(prompt, self.tokenizer))
                    ["input_ids"])

    def unanswerable(self, challenge: Challenge) -> str:
        """Why a node of this model could not answer `challenge` as it is sent, or could only answer
        another prompt (empty when it can): sealed so by a planner, it had the honest leader that sent it
        report the node. Its question must render as its committed prompt, the prompt fit
        `MAX_CHALLENGE_PROMPT_TOKENS` and, with the tokens asked, the context, and its stop ids the
        vocabulary."""
        if challenge.question and self.chat_prompt(challenge.question) != challenge.prompt:
            return "its question is not the committed prompt in this model's chat template"
        length = len(self.prompt_ids(challenge.prompt))
        if length > MAX_CHALLENGE_PROMPT_TOKENS:
            return f"its prompt has {length} tokens, more than a challenge's {MAX_CHALLENGE_PROMPT_TOKENS}"
        if length + challenge.max_tokens > self.max_len:
            return (f"its prompt of {length} tokens and {challenge.max_tokens} asked exceed the model's "
                    f"context of {self.max_len}")
        if (bad := next((t for t in challenge.stop_token_ids if t >= self.vocab_size), None)) is not None:
            return f"its stop token id {bad} is outside the vocabulary of {self.vocab_size}"
        return ""

    def ending(self, challenge: Challenge, response: SignedResponse) -> str:
        """Why `response` does not end where an answer to `challenge` must (empty when it does): at the
        token that completes its first stop string, with its text cut before that string; else at a stop
        token (the model's, or one of the challenge's stop token ids) or at the cap, with the whole text.
        Every token of a cut answer can be the honest choice, so only its end shows that the node stopped
        generating where the model would have gone on. Only the member that sent the challenge knows its
        stop strings, so it checks this; the scorers, who do not, accept a text cut short of its tokens'
        (`check`)."""
        ids = response.token_ids
        if any(not 0 <= token < self.vocab_size for token in ids):
            return ""  # scoring rejects the answer, and the node's signature stands behind that
        text = TextAssembler(self.tokenizer, challenge.stop)
        text.push(ids)
        text.finish()
        if text.stopped and text.consumed < len(ids):
            return f"the answer goes on for {len(ids) - text.consumed} tokens past its stop string"
        stops = {*self.stop_ids, *challenge.stop_token_ids}
        if not text.stopped and len(ids) < challenge.max_tokens and not (ids and ids[-1] in stops):
            ending = "a stop token or stop string" if challenge.stop else "a stop token"
            return (f"the answer stops after {len(ids)} of the {challenge.max_tokens} tokens asked, "
                    f"without {ending}")
        decoded = self.tokenizer.decode(ids, skip_special_tokens=True)
        if response.text != text.text and decoded.startswith(response.text):
            cut = "cut at its first stop string" if text.stopped else "whole"
            return (f"the signed text has {len(response.text)} characters where its tokens' text, {cut}, has "
                    f"{len(text.text)}")
        return ""

    def check(self, answer: Answer) -> Verdict | tuple[list[int], list[int]]:
        """A rejection, or the (prompt ids, response ids) to score. The checks run in this order, so the
        first failure is the one reported: whose response, signed, to which prompt, as which model, then
        the response's own content."""
        response = answer.response
        if answer.node is not None and response.node != answer.node:
            return Verdict.reject(Rejection.WRONG_NODE, f"signed by {response.node.hex()}, challenged "
                                                        f"{answer.node.hex()}")
        if not response_valid(response):
            return Verdict.reject(Rejection.BAD_SIGNATURE, "the signature does not verify under its key")
        if response.prompt_hash != prompt_hash(answer.prompt):
            return Verdict.reject(Rejection.WRONG_PROMPT, "the node signed an answer to a different prompt")
        if response.model_id != self.model_id:
            return Verdict.reject(Rejection.WRONG_MODEL, f"answered as {response.model_id!r}, expected "
                                                         f"{self.model_id!r}")
        ids = list(response.token_ids)
        if not ids:
            return Verdict.reject(Rejection.EMPTY_RESPONSE, "the response has no tokens")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            return Verdict.reject(Rejection.INVALID_TOKEN_ID, f"token id {bad} is outside the vocabulary "
                                                              f"of {self.vocab_size}")
        decoded = self.tokenizer.decode(ids, skip_special_tokens=True)
        if not decoded.startswith(response.text):
            at = next((i for i, (a, b) in enumerate(zip(decoded, response.text, strict=False)) if a != b),
                      min(len(decoded), len(response.text)))
            return Verdict.reject(Rejection.TOKENIZATION_MISMATCH,
                                  f"the text is neither the detokenisation of the token ids nor a beginning "
                                  f"of it (first difference at character {at}: {len(response.text)} "
                                  f"characters sent, {len(decoded)} decoded)")
        prompt = self.prompt_ids(answer.prompt)
        if len(prompt) + len(ids) > self.max_len:
            return Verdict.reject(Rejection.TOO_LONG, f"{len(prompt)} prompt + {len(ids)} response tokens "
                                                      f"exceed the model's {self.max_len}")
        return prompt, ids

    def verify(self, answers: Sequence[Answer]) -> list[Verdict]:
        """A verdict per answer, in order; every answer that passes the checks is scored in one batch."""
        verdicts: list[Verdict | None] = []
        pending: list[tuple[int, tuple[list[int], list[int]]]] = []
        for index, answer in enumerate(answers):
            checked = self.check(answer)
            if isinstance(checked, Verdict):
                verdicts.append(checked)
            else:
                verdicts.append(None)
                pending.append((index, checked))
        if pending:
            batch = [pair for _, pair in pending]
            if self.calibrated:
                decodings = [decoding(answers[index].response, self.tolerance) for index, _ in pending]
                scores = self.scorer.score_choices(batch, decodings)
                scored = [Verdict.scored(s, self.tolerance) for s in scores]
            else:
                scored = [Verdict.scored(TokenScores(tuple(lp))) for lp in self.scorer.score(batch)]
            for (index, _), verdict in zip(pending, scored, strict=True):
                verdicts[index] = verdict
        return [v for v in verdicts if v is not None]

    def verify_one(self, response: SignedResponse, prompt: str, node: bytes | None = None) -> Verdict:
        return self.verify([Answer(response, prompt, node)])[0]
