"""planetserve's verifiable sampling inside `vllm serve`: a logits processor for vLLM's V1 model runner
(`vllm.v1.sample.logits_processor.LogitsProcessor`, vLLM 0.33.0 as pinned by the `gpu` extra, with
VLLM_USE_V2_MODEL_RUNNER=0).

    VLLM_USE_V2_MODEL_RUNNER=0 vllm serve MODEL \\
        --logits-processors planetserve.node.engine.vllm_processor:PlanetServeSampling

A request that carries `vllm_xargs` {"planetserve_temperature": T, "planetserve_seed": s} and asks vLLM
for temperature 0 gets, in its row of the logits, logits / T + g(s, position, token), position being
the number of tokens it has generated so far; vLLM's greedy argmax then picks the protocol's token
(`planetserve.sampling`), which a committee member recomputes from the reference model's logits.
Requests without those arguments pass untouched. What cannot go with them (penalties, top-k, top-p,
min-p, logit bias, ..., a temperature other than 0) is refused with HTTP 400 before the request runs.

This module is loaded by vLLM only: nothing in planetserve imports it, so planetserve needs no vLLM.
The logic lives in `vllm_sampling.py` (parameters, refusals, batch rows) and `planetserve.sampling` (the
tensors), which the tests drive without vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from planetserve.node.engine.vllm_sampling import RowTable, check_params

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.config import VllmConfig


class PlanetServeSampling(LogitsProcessor):
    """The protocol's Gumbel-max sampling for the rows whose requests ask for it."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        check_params(sampling_params)

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        if getattr(vllm_config, "speculative_config", None) is not None:
            raise ValueError("planetserve sampling does not support speculative decoding: draft rows would "
                             "take the noise of positions they do not hold")
        self.device = device
        self.table = RowTable()

    def is_argmax_invariant(self) -> bool:
        """False: the noise changes the argmax; vLLM then runs this processor before greedy sampling."""
        return False

    def needs_output_token_ids(self) -> bool:
        """While sampled rows are in the batch, ask vLLM to keep their output id lists current (under
        async scheduling they may otherwise hold placeholders): a row's position is its list's length."""
        return bool(self.table.rows)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        self.table.update(batch_update)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return self.table.apply(logits)
