"""Training data and the training loop, both deterministic: fixed seeds, a fixed thread count,
`torch.use_deterministic_algorithms(True)` and a data order drawn from the recipe's own generator.

Same code, recipe, corpus and library versions on the same kind of CPU give bit-identical weights.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from planetserve.models.corpus import Corpus
from planetserve.models.recipes import TRAIN_THREADS, Preset, TrainedRecipe
from planetserve.models.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    document_messages,
    render_chat,
    render_document,
)

StepCallback = Callable[[int, float], None]
"""Called after every optimizer step with (step, training loss)."""


@dataclass(frozen=True)
class TrainingData:
    train_blocks: torch.Tensor
    """(n, seq_len) int64: the training split rendered, packed back to back, cut into blocks."""
    eval_blocks: torch.Tensor
    """The same for the held-out split, at most `preset.eval_blocks` of them."""
    sample_prompts: tuple[torch.Tensor, ...]
    """Chat prompts (held-out questions) that gt samples continuations from."""

    @property
    def train_tokens(self) -> int:
        return self.train_blocks.numel()


@dataclass(frozen=True)
class TrainStats:
    steps: int
    tokens: int
    final_loss: float
    """Mean training loss over the last tenth of the steps."""
    seconds: float
    cpu_seconds: float
    """Process CPU time: on a shared machine a fairer measure of cost than wall time."""


@contextmanager
def deterministic(seed: int) -> Iterator[None]:
    """Seeded, deterministic torch inside; the caller's RNG, threads and algorithm settings return after."""
    threads = torch.get_num_threads()
    strict = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.set_num_threads(TRAIN_THREADS)
    torch.use_deterministic_algorithms(True)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            yield
    finally:
        torch.use_deterministic_algorithms(strict, warn_only=warn_only)
        torch.set_num_threads(threads)


def _pack(tokenizer: Tokenizer, texts: list[str], seq_len: int) -> torch.Tensor:
    ids = [i for enc in tokenizer.encode_batch(texts, add_special_tokens=False) for i in enc.ids]
    usable = len(ids) // seq_len * seq_len
    return torch.tensor(ids[:usable], dtype=torch.long).view(-1, seq_len)


def prepare_data(corpus: Corpus, tokenizer: Tokenizer, preset: Preset) -> TrainingData:
    train = _pack(tokenizer, [render_document(d) for d in corpus.train], preset.seq_len)
    held_out = _pack(tokenizer, [render_document(d) for d in corpus.held_out], preset.seq_len)
    questions = [
        render_chat(document_messages(d)[:1], add_generation_prompt=True)
        for d in corpus.held_out[: preset.sample_prompts]
    ]
    prompts = tuple(
        torch.tensor(enc.ids, dtype=torch.long)
        for enc in tokenizer.encode_batch(questions, add_special_tokens=False)
    )
    return TrainingData(train, held_out[: preset.eval_blocks], prompts)


def llama_config(preset: Preset, recipe: TrainedRecipe) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=preset.vocab_size,
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.layers,
        num_attention_heads=recipe.heads,
        num_key_value_heads=recipe.kv_heads,
        head_dim=recipe.head_dim,
        max_position_embeddings=preset.max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )


def batch_order(blocks: int, batch_size: int, steps: int, seed: int) -> Iterator[torch.Tensor]:
    """Block indices per step: a fresh permutation per pass over the data, drawn from `seed` alone."""
    generator = torch.Generator().manual_seed(seed)
    pending = torch.empty(0, dtype=torch.long)
    for _ in range(steps):
        while pending.numel() < batch_size:
            pending = torch.cat([pending, torch.randperm(blocks, generator=generator)])
        yield pending[:batch_size]
        pending = pending[batch_size:]


def lr_factor(step: int, recipe: TrainedRecipe) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < recipe.warmup:
        return (step + 1) / recipe.warmup
    progress = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


def train_model(
    preset: Preset, recipe: TrainedRecipe, data: TrainingData, on_step: StepCallback | None = None
) -> tuple[LlamaForCausalLM, TrainStats]:
    started, started_cpu = time.monotonic(), time.process_time()
    losses: list[float] = []
    with deterministic(recipe.seed):
        model = LlamaForCausalLM(llama_config(preset, recipe))
        model.train()
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=recipe.lr, betas=(0.9, 0.95), weight_decay=recipe.weight_decay
        )
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, recipe))
        order = batch_order(len(data.train_blocks), preset.batch_size, recipe.steps, recipe.seed)
        for step, indices in enumerate(order, start=1):
            batch = data.train_blocks[indices]
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if on_step is not None:
                on_step(step, losses[-1])
    model.eval()
    tail = losses[-max(1, len(losses) // 10) :]
    stats = TrainStats(
        steps=recipe.steps,
        tokens=recipe.steps * preset.batch_size * preset.seq_len,
        final_loss=sum(tail) / len(tail),
        seconds=time.monotonic() - started,
        cpu_seconds=time.process_time() - started_cpu,
    )
    return model, stats
