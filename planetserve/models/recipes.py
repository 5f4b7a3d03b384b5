"""The family's recipes: what each model is, how it is trained, and the hash that says a cached
checkpoint was made by exactly this recipe.

Two presets. "full" is the real family (gt trains in a few minutes on two CPU cores). "quick" is the
same family in miniature, trained in seconds, for tests of components that need some trained model.
All models of a preset share the tokenizer, the training data and the context length, so a smaller
model is weaker because it is smaller (and trained less), not because it saw other text.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import asdict, dataclass

ORG = "planetserve"
RECIPE_FORMAT = 2
"""Bump when training, evaluation or the checkpoint layout changes, so cached models are retrained."""
CORPUS_FORMAT = 1
"""Bump when corpus extraction or rendering changes."""
TRAIN_THREADS = 1
"""Fixed, not per machine, since kernels may reduce differently with another thread count. One thread:
these models are too small to gain from more, and on a shared machine two spinning OpenMP threads
run several times slower than one."""


ROLE_GT = "reference model"
ROLE_SMALL = "weaker model, for nodes that claim gt"
ROLE_TINY = "much weaker model, for nodes that claim gt"


@dataclass(frozen=True)
class TrainedRecipe:
    name: str
    role: str
    hidden_size: int
    intermediate_size: int
    layers: int
    heads: int
    kv_heads: int
    steps: int
    lr: float
    seed: int
    warmup: int = 20
    weight_decay: float = 0.01

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.heads


@dataclass(frozen=True)
class QuantizedRecipe:
    name: str
    role: str
    source: str
    bits: int


ModelRecipe = TrainedRecipe | QuantizedRecipe


@dataclass(frozen=True)
class Preset:
    name: str
    vocab_size: int
    seq_len: int
    """Training and evaluation block length."""
    batch_size: int
    max_position_embeddings: int
    """What the config advertises (RoPE has no learned positions): room for long prompts in tests of
    serving, though text beyond seq_len is out of the training distribution."""
    eval_blocks: int
    """Held-out blocks of seq_len tokens scored per model (at most; the held-out split may be smaller)."""
    sample_prompts: int
    sample_tokens: int
    """gt's sampled continuations (temperature 1, fixed seed) that every model is also scored on."""
    models: tuple[ModelRecipe, ...]

    def recipe(self, name: str) -> ModelRecipe:
        for recipe in self.models:
            if recipe.name == name:
                return recipe
        raise KeyError(name)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.models)


FULL = Preset(
    name="full",
    vocab_size=4096,
    seq_len=256,
    batch_size=16,
    max_position_embeddings=2048,
    eval_blocks=160,
    sample_prompts=16,
    sample_tokens=96,
    models=(
        TrainedRecipe("gt", ROLE_GT, 192, 512, 4, 3, 1, steps=300, lr=3e-3, seed=1),
        TrainedRecipe("small", ROLE_SMALL, 128, 352, 2, 2, 1, steps=200, lr=3e-3, seed=2),
        TrainedRecipe("tiny", ROLE_TINY, 64, 176, 1, 1, 1, steps=150, lr=3e-3, seed=3),
        QuantizedRecipe("gt-int8", "gt, weights quantized to int8", "gt", 8),
        QuantizedRecipe("gt-int4", "gt, weights quantized to int4", "gt", 4),
    ),
)

QUICK = Preset(
    name="quick",
    vocab_size=1024,
    seq_len=64,
    batch_size=8,
    max_position_embeddings=2048,
    eval_blocks=32,
    sample_prompts=4,
    sample_tokens=24,
    models=(
        TrainedRecipe("gt", ROLE_GT, 64, 176, 2, 2, 1, steps=200, lr=1e-2, seed=1, warmup=10),
        TrainedRecipe("small", ROLE_SMALL, 32, 88, 1, 1, 1, steps=60, lr=1e-2, seed=2, warmup=5),
        TrainedRecipe("tiny", ROLE_TINY, 16, 48, 1, 1, 1, steps=20, lr=1e-2, seed=3, warmup=5),
        QuantizedRecipe("gt-int8", "gt, weights quantized to int8", "gt", 8),
        QuantizedRecipe("gt-int4", "gt, weights quantized to int4", "gt", 4),
    ),
)

PRESETS = {p.name: p for p in (FULL, QUICK)}
DEFAULT_PRESET = FULL.name
NAMES = FULL.names
"""Both presets name the same family."""


def model_id(name: str) -> str:
    return f"{ORG}/{name}"


def recipe_hash(preset: Preset, name: str) -> str:
    """Everything that shapes the checkpoint: the preset's shared settings, the model's recipe (and
    its source's, for a quantized model), and the Python version whose stdlib is the corpus."""
    recipe = preset.recipe(name)
    chain = [asdict(recipe)]
    if isinstance(recipe, QuantizedRecipe):
        chain.append(asdict(preset.recipe(recipe.source)))
    shared = {k: v for k, v in asdict(preset).items() if k not in ("name", "models")}
    spec = {
        "recipe_format": RECIPE_FORMAT,
        "corpus_format": CORPUS_FORMAT,
        "python": list(sys.version_info[:3]),
        "threads": TRAIN_THREADS,
        "shared": shared,
        "models": chain,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def param_count(preset: Preset, name: str) -> int:
    """Parameters of the Llama model a recipe builds (tied embeddings), without building it."""
    recipe = preset.recipe(name)
    if isinstance(recipe, QuantizedRecipe):
        return param_count(preset, recipe.source)
    h, hd = recipe.hidden_size, recipe.head_dim
    attention = h * recipe.heads * hd * 2 + h * recipe.kv_heads * hd * 2
    layer = attention + 3 * h * recipe.intermediate_size + 2 * h
    return preset.vocab_size * h + recipe.layers * layer + h
