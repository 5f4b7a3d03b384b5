"""How good a model is, in the two measures the family is built to separate: mean next-token loss on
the held-out split, and loss on text that gt itself sampled (what a node claiming gt would have to
match). Perplexity is exp(loss)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from planetserve.models.tokenizer import PAD_ID, STOP_IDS
from planetserve.models.train import deterministic

SAMPLE_SEED = 1234


@dataclass(frozen=True)
class Sample:
    prompt: torch.Tensor
    continuation: torch.Tensor


def perplexity(loss: float) -> float:
    return math.exp(loss)


@torch.inference_mode()
def held_out_loss(model: torch.nn.Module, blocks: torch.Tensor, batch_size: int = 8) -> float:
    total, count = 0.0, 0
    with deterministic(0):  # the same kernels as training, so the numbers repeat
        for start in range(0, len(blocks), batch_size):
            batch = blocks[start : start + batch_size]
            logits = model(input_ids=batch).logits[:, :-1].float()
            targets = batch[:, 1:]
            total += F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
            ).item()
            count += targets.numel()
    return total / count


@torch.inference_mode()
def sample_continuations(
    model: torch.nn.Module, prompts: tuple[torch.Tensor, ...], tokens: int
) -> list[Sample]:
    """Temperature-1 samples of exactly `tokens` tokens, seeded per prompt. The stop ids are passed
    explicitly (and suppressed by min_new_tokens) so a fresh model and its saved checkpoint, which
    carries a generation config, sample the same text."""
    samples = []
    for i, prompt in enumerate(prompts):
        with deterministic(SAMPLE_SEED + i):
            out = model.generate(
                prompt[None],
                attention_mask=torch.ones_like(prompt[None]),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                eos_token_id=list(STOP_IDS),
                pad_token_id=PAD_ID,
            )
        samples.append(Sample(prompt, out[0, len(prompt) :]))
    return samples


@torch.inference_mode()
def continuation_loss(model: torch.nn.Module, samples: list[Sample]) -> float:
    total, count = 0.0, 0
    with deterministic(0):  # the same kernels as training, so the numbers repeat
        for sample in samples:
            ids = torch.cat([sample.prompt, sample.continuation])[None]
            logits = model(input_ids=ids).logits[0, len(sample.prompt) - 1 : -1].float()
            total += F.cross_entropy(logits, sample.continuation, reduction="sum").item()
            count += len(sample.continuation)
    return total / count
