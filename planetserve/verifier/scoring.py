"""Scoring engines: the reference model's log-probability of every token of a model node's response.

The interface, `Scorer`, is synchronous:

    score(batch) -> list[list[float]]
        batch: a sequence of (prompt ids, response ids); the result holds, for each item, one natural
        log-probability per response token, log p(r_k | prompt + r_<k), in response order. Nothing is
        inserted between prompt and response (no BOS), and every response token is scored, a final stop
        token included. An empty response scores [].
    score_choices(batch, decodings) -> list[TokenScores]
        the same log-probabilities plus, per token, its shortfall under the decoding the node signed
        (temperature and seed, `planetserve.sampling.shortfalls`): how far it falls short of what an
        honest engine holding the reference emits there, 0 for the honest choice.

They are two methods rather than one because they cost differently on a serving engine: the
log-probability of the given token is one number per position (vLLM's `prompt_logprobs=0`), a sampled
token's shortfall needs the whole distribution, since the noise can lift any token to the top. Blocking
suits the built-in engines,
which keep the CPU or GPU busy; a caller on an event loop runs `score` with `asyncio.to_thread`, and a
scorer backed by an OpenAI-compatible server implements the same method, sending its requests
concurrently inside it.

Two built-in engines over the same in-process transformers causal LM:

- `OnePassScorer`: teacher forcing, one forward pass per response, responses batched with left padding;
- `Algorithm3Scorer`: the paper's Algorithm 3, one next-token call per response token with a context that
  grows by that token; kept as the reference the one-pass engine is checked against, and to measure
  what one pass saves.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from planetserve.sampling import shortfalls

if TYPE_CHECKING:
    from transformers import PreTrainedModel

Pair = tuple[Sequence[int], Sequence[int]]
"""(prompt ids, response ids)."""


@dataclass(frozen=True)
class Decoding:
    """How a node signed it decoded an answer: its temperature (0 is greedy), its noise's seed and its
    nucleus; `margin` is how far apart (nats) the verifier lets an honest engine's log-probabilities lie
    from the reference's when it bounds that engine's nucleus (planetserve.sampling.shortfalls)."""

    temperature: float
    seed: int
    top_p: float = 1.0
    margin: float = 0.0


@dataclass(frozen=True)
class TokenScores:
    """Per response token: the reference's log-probability of it and, when asked for, its shortfall
    (nats) under the node's decoding."""

    logprobs: tuple[float, ...]
    shortfalls: tuple[float, ...] | None = None


class Scorer(Protocol):
    def score(self, batch: Sequence[Pair]) -> list[list[float]]: ...

    def score_choices(self, batch: Sequence[Pair], decodings: Sequence[Decoding]) -> list[TokenScores]: ...


def _position_scores(logits: torch.Tensor, targets: list[int], decoding: Decoding | None) -> TokenScores:
    """Scores from the logits of the positions that predict `targets`, one row each, in float32 so a
    half-precision model loses nothing more in the softmax."""
    logprobs = logits.float().log_softmax(-1)
    index = torch.tensor(targets, dtype=torch.long, device=logits.device)
    picked = logprobs.gather(-1, index[:, None])[:, 0]
    if decoding is None:
        return TokenScores(tuple(picked.tolist()))
    short = shortfalls(logprobs, index, decoding.temperature, decoding.seed, decoding.top_p, decoding.margin)
    return TokenScores(tuple(picked.tolist()), tuple(short.tolist()))


class TorchScorer(ABC):
    """What both built-in engines share: input checks and the model's device."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def score(self, batch: Sequence[Pair]) -> list[list[float]]:
        return [list(s.logprobs) for s in self._score(self._checked(batch), [None] * len(batch))]

    def score_choices(self, batch: Sequence[Pair], decodings: Sequence[Decoding]) -> list[TokenScores]:
        if len(decodings) != len(batch):
            raise ValueError(f"{len(decodings)} decodings for {len(batch)} items")
        return self._score(self._checked(batch), list(decodings))

    def _checked(self, batch: Sequence[Pair]) -> list[tuple[list[int], list[int]]]:
        """Plain int lists; an empty prompt (the first token would have no context) or an id outside the
        embedding table is a caller's error, refused before it reaches the model."""
        items = []
        for n, (prompt, response) in enumerate(batch):
            prompt_ids, response_ids = [int(t) for t in prompt], [int(t) for t in response]
            if not prompt_ids:
                raise ValueError(f"item {n}: the prompt is empty")
            if any(not 0 <= t < self.vocab_size for t in prompt_ids + response_ids):
                raise ValueError(f"item {n}: token ids must lie in [0, {self.vocab_size})")
            items.append((prompt_ids, response_ids))
        return items

    @abstractmethod
    def _score(self, items: list[tuple[list[int], list[int]]], decodings: list[Decoding | None]
               ) -> list[TokenScores]: ...


class OnePassScorer(TorchScorer):
    """Teacher forcing: prompt + response in one forward pass gives the distribution at every position.

    Responses are grouped longest first into batches of at most `max_batch_tokens` padded tokens and
    `max_scored_tokens` positions whose logits are kept (logits are batch x positions x vocabulary, the
    largest tensor by far for a big vocabulary). Padding is on the left, with an attention mask and
    position ids counting from each sequence's first real token, so every item is computed as if alone;
    left padding puts every response at the end of its row, so only the last (longest response + 1)
    positions need logits (`logits_to_keep`).
    """

    def __init__(self, model: PreTrainedModel, max_batch_tokens: int = 16384, max_scored_tokens: int = 4096
                 ) -> None:
        super().__init__(model)
        self.max_batch_tokens = max_batch_tokens
        self.max_scored_tokens = max_scored_tokens

    def _score(self, items: list[tuple[list[int], list[int]]], decodings: list[Decoding | None]
               ) -> list[TokenScores]:
        results: dict[int, TokenScores] = {}
        for group in self._groups(items):
            scored = self._forward([items[i] for i in group], [decodings[i] for i in group])
            for index, scores in zip(group, scored, strict=True):
                results[index] = scores
        return [results[i] for i in range(len(items))]

    def _groups(self, items: list[tuple[list[int], list[int]]]) -> list[list[int]]:
        """Indices of `items` per forward pass, longest first, each pass within both budgets (a single
        item over them still gets a pass of its own)."""
        order = sorted(range(len(items)), key=lambda i: len(items[i][0]) + len(items[i][1]), reverse=True)
        groups: list[list[int]] = []
        width = keep = 0
        for i in order:
            prompt, response = items[i]
            width, keep = max(width, len(prompt) + len(response)), max(keep, len(response) + 1)
            rows = len(groups[-1]) + 1 if groups else 0
            if rows and rows * width <= self.max_batch_tokens and rows * keep <= self.max_scored_tokens:
                groups[-1].append(i)
            else:
                groups.append([i])
                width, keep = len(prompt) + len(response), len(response) + 1
        return groups

    @torch.inference_mode()
    def _forward(self, items: list[tuple[list[int], list[int]]], decodings: list[Decoding | None]
                 ) -> list[TokenScores]:
        width = max(len(p) + len(r) for p, r in items)
        keep = max(len(r) for _, r in items) + 1
        ids = torch.zeros((len(items), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (prompt, response) in enumerate(items):
            sequence = prompt + response
            ids[row, width - len(sequence):] = torch.tensor(sequence)
            mask[row, width - len(sequence):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        device = self.device
        logits = self.model(input_ids=ids.to(device), attention_mask=mask.to(device),
                            position_ids=positions.to(device), logits_to_keep=keep, use_cache=False).logits
        # Kept column j is sequence column width - keep + j; response token k of an n-token response sits
        # at width - n + k and is predicted by the column before it, so kept columns keep-1-n .. keep-2.
        return [_position_scores(logits[row, keep - 1 - len(response): keep - 1], response, decoding)
                for row, ((_, response), decoding) in enumerate(zip(items, decodings, strict=True))]


class Algorithm3Scorer(TorchScorer):
    """The paper's Algorithm 3: for each response token, a separate next-token call on the prompt plus the
    response so far, reading the probability of the token the node sent; then the context grows by that
    token. Each call recomputes its whole context, as a stateless next-token API call does, one response
    after another: it is the specification the one-pass engine must agree with, not a fast path."""

    @torch.inference_mode()
    def _score(self, items: list[tuple[list[int], list[int]]], decodings: list[Decoding | None]
               ) -> list[TokenScores]:
        results = []
        device = self.device
        for (prompt, response), decoding in zip(items, decodings, strict=True):
            sequence = torch.tensor([prompt + response], device=device)
            rows = [self.model(input_ids=sequence[:, : len(prompt) + k], logits_to_keep=1,
                               use_cache=False).logits[0, -1] for k in range(len(response))]
            if not rows:
                results.append(TokenScores((), () if decoding is not None else None))
                continue
            results.append(_position_scores(torch.stack(rows), response, decoding))
        return results
