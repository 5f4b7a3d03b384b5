"""A pipeline stage that skips its layers: it answers every step with the hidden states it was sent, so it
computes nothing and still counts as a stage of its deployment. The pipeline then serves a shallower
model than the one registered. Its entry node signs the answers, and the committee scores the entry's
answer against the whole model: the skip is caught there. Every stage of the pipeline shares that verdict
(`finalization.to_pipelines`, tests/test_epochs.py). The same pipeline with an honest middle stage passes.
"""

from __future__ import annotations

import time

import pytest
import torch
from stagecluster import cluster
from waiting import run

from planetserve.chain.challenge import sign_response
from planetserve.chain.keys import KeySet
from planetserve.models import LoadedModel
from planetserve.node.pipeline.stages import StageModel
from planetserve.registry.epochs import milli
from planetserve.registry.params import Params
from planetserve.verifier import ReferenceModel
from planetserve.verifier.credibility import Verdict

PROMPTS = ("Return a new list of the", "The json module", "Write a function that", "def parse(")
"""Greedy, quick gt answers some prompts alike with the middle layers skipped or not (trained on some CPUs
it answers most with newlines alone): the first prompt whose answer the skip changes is the one scored."""
THREE = {"a": (0, 2), "b": (2, 4), "c": (4, 6)}
TOKENS = 64
TAU = Params().untrusted_threshold_ppm
"""The trust threshold: a node whose answers score below it cannot stay trusted."""


class SkippingStage(StageModel):
    """Holds its layers and runs none. It counts the positions it was sent, so its replies follow the
    request's order like an honest stage's."""

    def new_cache(self) -> list[int]:  # type: ignore[override]
        return [0]

    def length(self, cache: list[int], start: int) -> int:  # type: ignore[override]
        return cache[0]

    def forward(self, inputs: torch.Tensor, cache: list[int], start: int, end: int  # type: ignore[override]
                ) -> torch.Tensor:
        cache[0] += inputs.shape[0]
        return inputs.to(self.dtype)


def answer(deep_gt: LoadedModel, kinds: dict[str, type[StageModel]], prompt: str, temperature: float,
           seed: int, entry: KeySet) -> tuple[tuple[int, ...], Verdict]:
    """The pipeline's answer to `prompt`, signed by its entry as a model node signs a challenge's answer,
    and the committee's verdict on it against the whole model."""

    async def main():
        c = await cluster(deep_gt, THREE, kinds=kinds)
        try:
            return await c.client.complete(prompt, TOKENS, temperature=temperature, seed=seed)
        finally:
            await c.close()

    out = run(main(), 60)
    assert len(out.token_ids) == TOKENS
    response = sign_response(entry, prompt, list(out.token_ids), out.text, "gt", int(time.time()), "h:1",
                             milli(temperature), seed)
    reference = ReferenceModel.from_loaded(deep_gt, model_id="gt")
    return tuple(out.token_ids), reference.verify_one(response, prompt, entry.public)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_stage_that_skips_its_layers_is_caught_by_the_entrys_score(deep_gt: LoadedModel, temperature):
    """Sampled, the skip shows in one answer: several tokens deviate and its C falls below τ. Greedy, this
    small model's answer drifts off the whole model's once and then repeats itself as the whole model
    would: one deviating token, which the ledger's evidence accumulates epoch after epoch as it does a
    quantised copy's (tests/adversaries/test_quantised_node.py)."""
    entry = KeySet.generate()
    for prompt in PROMPTS:
        honest_ids, honest = answer(deep_gt, {}, prompt, temperature, 11, entry)
        assert honest.ok and honest.deviations == 0 and honest.calibrated_ppm == 1_000_000, honest
        skipping_ids, skipping = answer(deep_gt, {"b": SkippingStage}, prompt, temperature, 11, entry)
        assert skipping.ok, skipping  # a well-formed answer, signed by the entry: only its tokens give it away
        if skipping_ids != honest_ids:
            break
    else:
        pytest.fail(f"skipping the middle layers changed the answer to none of {len(PROMPTS)} prompts")
    assert skipping.deviations >= 1, skipping
    if temperature:
        assert skipping.deviations > 1 and skipping.calibrated_ppm < TAU, skipping
