"""The vLLM-free half of planetserve's vLLM logits processor (`vllm_processor.py`): the request
parameters it reads, what it refuses, and which batch row carries which request.

A model node backed by `vllm serve` sends each sampled request to vLLM at temperature 0, with the
protocol's temperature and seed as `vllm_xargs` (`SamplingParams.extra_args` inside vLLM):

    {"temperature": 0, "vllm_xargs": {"planetserve_temperature": 0.7, "planetserve_seed": 12345}}

and, for nucleus sampling, "planetserve_top_p" beside them (vLLM's own top_p stays 1). The processor
writes logits / T + g(seed, position, token) into those requests' rows, -inf outside the nucleus, so
that vLLM's greedy argmax picks the protocol's token (`planetserve.sampling`); position is the number of
tokens the request has generated so far. Everything here works on objects shaped like vLLM's
(`SamplingParams`, `BatchUpdate` and its added, removed and moved entries) by attribute and position
only, so it runs, and is tested, without vLLM installed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence, Sized
from dataclasses import dataclass
from typing import Any

import torch

from planetserve.sampling import SEED_LIMIT, noise_rows_

XARG_TEMPERATURE = "planetserve_temperature"
XARG_SEED = "planetserve_seed"
XARG_TOP_P = "planetserve_top_p"
GREEDY_LIMIT = 1e-5
"""vLLM samples greedily below this temperature (its _SAMPLING_EPS); the protocol needs it greedy."""


@dataclass(frozen=True)
class Decoding:
    """The protocol's parameters of one request."""

    temperature: float
    seed: int
    top_p: float = 1.0


def protocol_decoding(extra_args: Mapping[str, Any] | None) -> Decoding | None:
    """The request's protocol parameters from its `extra_args`, or None when it carries neither.
    ValueError (vLLM answers it as HTTP 400) when they are half there or malformed."""
    if not extra_args or (XARG_TEMPERATURE not in extra_args and XARG_SEED not in extra_args):
        return None
    if XARG_TEMPERATURE not in extra_args or XARG_SEED not in extra_args:
        missing = XARG_SEED if XARG_TEMPERATURE in extra_args else XARG_TEMPERATURE
        raise ValueError(f"planetserve sampling needs both {XARG_TEMPERATURE} and {XARG_SEED} in vllm_xargs; "
                         f"{missing} is missing")
    temperature, seed = extra_args[XARG_TEMPERATURE], extra_args[XARG_SEED]
    if isinstance(temperature, bool) or not isinstance(temperature, int | float) \
            or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"{XARG_TEMPERATURE} must be a finite number of at least 0, got {temperature!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"{XARG_SEED} must be an integer in [0, 2**64), got {seed!r}")
    top_p = extra_args.get(XARG_TOP_P, 1.0)
    if isinstance(top_p, bool) or not isinstance(top_p, int | float) or not (math.isfinite(top_p)
                                                                             and 0 <= top_p <= 1):
        raise ValueError(f"{XARG_TOP_P} must be a number in [0, 1], got {top_p!r}")
    return Decoding(float(temperature), seed, float(top_p))


# (attribute of SamplingParams, the values that leave the model's logits alone, why a value other than
# those cannot go with the protocol's sampling)
_NEUTRAL: tuple[tuple[str, tuple[Any, ...], str], ...] = (
    ("presence_penalty", (0, 0.0, None), "vLLM applies penalties after this processor"),
    ("frequency_penalty", (0, 0.0, None), "vLLM applies penalties after this processor"),
    ("repetition_penalty", (1, 1.0, None), "vLLM applies penalties after this processor"),
    ("top_p", (1, 1.0, None), f"send it as {XARG_TOP_P}, which this processor applies"),
    ("top_k", (0, -1, None), "the protocol samples from the whole vocabulary"),
    ("min_p", (0, 0.0, None), "the protocol samples from the whole vocabulary"),
    ("min_tokens", (0, None), "it hides the stop tokens from the argmax"),
    ("logit_bias", (None,), "it changes the model's logits"),
    ("allowed_token_ids", (None,), "it changes the model's logits"),
    ("bad_words", (None,), "it changes the model's logits"),
    ("structured_outputs", (None,), "it masks the model's logits"),
    ("guided_decoding", (None,), "it masks the model's logits"),
    ("n", (1, None), "every answer would share one seed"),
    ("best_of", (1, None), "every answer would share one seed"),
)


def refusals(params: Any) -> list[str]:
    """What in `params` (a vLLM SamplingParams) cannot go with the protocol's parameters, one line
    each; empty when the request carries none of them or nothing is in the way."""
    decoding = protocol_decoding(getattr(params, "extra_args", None))
    if decoding is None:
        return []
    found = []
    temperature = getattr(params, "temperature", None)
    if temperature is None or temperature >= GREEDY_LIMIT:
        found.append(f"temperature={temperature!r}: send temperature 0 and the real one as "
                     f"{XARG_TEMPERATURE}, since vLLM must take the argmax of what this processor writes")
    for name, neutral, why in _NEUTRAL:
        value = getattr(params, name, None)
        if not _is_neutral(value, neutral):
            found.append(f"{name}={value!r}: {why}")
    return found


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    if value is None or (isinstance(value, Sized) and not isinstance(value, str) and len(value) == 0):
        return None in neutral  # absent, or an empty list or dict: asks for nothing
    return not isinstance(value, bool) and any(v is not None and value == v for v in neutral)


def check_params(params: Any) -> None:
    """`validate_params`: ValueError (HTTP 400 from vLLM's server) naming every parameter that cannot go
    with the protocol's sampling, before the request reaches the batch."""
    found = refusals(params)
    if found:
        raise ValueError("planetserve sampling (vllm_xargs planetserve_temperature, planetserve_seed) "
                         "picks argmax(logits/T + g) of the model's own logits over the whole vocabulary, "
                         "which a verifier recomputes; this request also asks for " + "; ".join(found))


@dataclass
class Row:
    """A request in the batch that the processor samples: its parameters and vLLM's live list of its
    output token ids (vLLM appends to that very list as the request generates)."""

    temperature: float
    seed: int
    output_ids: Sequence[int]
    top_p: float = 1.0

    @property
    def position(self) -> int:
        """The index in the response of the token about to be sampled."""
        return len(self.output_ids)


class RowTable:
    """Batch slot -> Row for the requests that carry protocol parameters at a temperature above 0,
    kept in step with vLLM's persistent batch through its BatchUpdates: removed slots, then added
    requests (a slot may be reused), then moves (one-way or swaps), in the order vLLM documents."""

    def __init__(self) -> None:
        self.rows: dict[int, Row] = {}

    def update(self, batch_update: Any) -> None:
        """Apply one vLLM BatchUpdate (None: the batch did not change)."""
        if batch_update is None:
            return
        for slot in batch_update.removed:
            self.rows.pop(slot, None)
        for slot, params, _prompt_ids, output_ids in batch_update.added:
            decoding = protocol_decoding(getattr(params, "extra_args", None))
            if decoding is None or decoding.temperature == 0:
                self.rows.pop(slot, None)
            else:
                self.rows[slot] = Row(decoding.temperature, decoding.seed, output_ids, decoding.top_p)
        for a, b, direction in batch_update.moved:
            row_a, row_b = self.rows.pop(a, None), self.rows.pop(b, None)
            if row_a is not None:
                self.rows[b] = row_a
            if row_b is not None and _is_swap(direction):
                self.rows[a] = row_b
        stray = [slot for slot in self.rows if slot >= batch_update.batch_size]
        if stray:
            raise RuntimeError(f"planetserve sampling: slots {sorted(stray)} lie outside a batch of "
                               f"{batch_update.batch_size}; the batch updates were not followed")

    def batch(self) -> tuple[list[int], list[float], list[int], list[int], list[float]]:
        """The sampled rows in slot order: slots, temperatures, seeds, positions, top_ps."""
        slots = sorted(self.rows)
        rows = [self.rows[s] for s in slots]
        return (slots, [r.temperature for r in rows], [r.seed for r in rows], [r.position for r in rows],
                [r.top_p for r in rows])

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """vLLM's `apply`: the sampled rows of `logits` ([batch, vocab]) become logits / T + g, in place;
        the other rows stay as they are."""
        if not self.rows:
            return logits
        slots, temperatures, seeds, positions, top_ps = self.batch()
        outside = [s for s in slots if s >= logits.shape[0]]
        if outside:
            raise RuntimeError(f"planetserve sampling: slots {outside} lie outside logits of "
                               f"{logits.shape[0]} rows (speculative decoding is not supported)")
        return noise_rows_(logits, slots, temperatures, seeds, positions, top_ps)


def _is_swap(direction: Any) -> bool:
    """vLLM's MoveDirectionality.SWAP (by name, so that no vLLM import is needed)."""
    return getattr(direction, "name", direction) == "SWAP"

