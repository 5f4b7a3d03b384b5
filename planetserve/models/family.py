"""Training the family into a data directory: corpus, tokenizer, then each model in family order
(gt before what derives from it), skipping every model whose stamp already carries its recipe hash."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import tokenizers
import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from planetserve.models import layout
from planetserve.models.corpus import Corpus, build_corpus
from planetserve.models.evaluate import (
    Sample,
    continuation_loss,
    held_out_loss,
    perplexity,
    sample_continuations,
)
from planetserve.models.layout import state
from planetserve.models.loading import quiet_transformers
from planetserve.models.quantize import quantize_model
from planetserve.models.recipes import (
    DEFAULT_PRESET,
    PRESETS,
    Preset,
    QuantizedRecipe,
    TrainedRecipe,
    model_id,
    param_count,
    recipe_hash,
)
from planetserve.models.tokenizer import BOS_ID, PAD_ID, STOP_IDS, save_tokenizer, train_tokenizer
from planetserve.models.train import StepCallback, TrainingData, prepare_data, train_model

REFERENCE = "gt"


class Reporter(Protocol):
    def note(self, message: str) -> None: ...

    def begin(self, name: str, steps: int) -> StepCallback: ...

    def end(self, report: ModelReport) -> None: ...


@dataclass(frozen=True)
class ModelReport:
    name: str
    action: str
    """trained, quantized, or cached (the stamp already matched the recipe)."""
    path: Path
    stamp: dict[str, Any]


class _Silent:
    def note(self, message: str) -> None:
        pass

    def begin(self, name: str, steps: int) -> StepCallback:
        return lambda step, loss: None

    def end(self, report: ModelReport) -> None:
        pass


def preset_of(preset: str | Preset) -> Preset:
    if isinstance(preset, Preset):
        return preset
    try:
        return PRESETS[preset]
    except KeyError:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}") from None


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 over parameter names and bytes in name order: equal digests mean identical weights."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode() + b"\0" + str(tensor.dtype).encode() + b"\0")
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


@functools.lru_cache(maxsize=2)
def materials(preset: Preset) -> tuple[Corpus, tokenizers.Tokenizer, TrainingData]:
    """Corpus, tokenizer and packed data of a preset, built once per process (they are deterministic,
    so a second build could only repeat the first)."""
    corpus = build_corpus()
    tokenizer = train_tokenizer(corpus.train, preset.vocab_size)
    return corpus, tokenizer, prepare_data(corpus, tokenizer, preset)


def _plan(preset: Preset, only: Iterable[str], force: bool, data: str | os.PathLike[str] | None) -> list[str]:
    """The models to build, in family order; a quantized model's source joins when it is not current."""
    wanted = set(only) or set(preset.names)
    unknown = wanted - set(preset.names)
    if unknown:
        raise ValueError(
            f"unknown model(s) {', '.join(sorted(unknown))}; the family is {', '.join(preset.names)}"
        )
    todo = {n for n in wanted if force or state(preset, n, data) != "current"}
    for name in list(todo):
        recipe = preset.recipe(name)
        if isinstance(recipe, QuantizedRecipe) and state(preset, recipe.source, data) != "current":
            todo.add(recipe.source)
    return [n for n in preset.names if n in todo]


def train_family(
    preset: str | Preset = DEFAULT_PRESET,
    data: str | os.PathLike[str] | None = None,
    only: Iterable[str] = (),
    force: bool = False,
    reporter: Reporter | None = None,
) -> list[ModelReport]:
    """Build the selected models (default: all) that are missing or made by another recipe."""
    preset = preset_of(preset)
    reporter = reporter or _Silent()
    selected = list(only) or list(preset.names)
    with layout.training_lock(data):
        todo = _plan(preset, selected, force, data)
        builder = None
        if todo:
            reporter.note("reading the standard library's documentation, training the tokenizer")
            corpus, tokenizer, training = materials(preset)
            reporter.note(
                f"corpus: {len(corpus.documents)} documents, {corpus.stats()['chars']} characters; "
                f"vocabulary {tokenizer.get_vocab_size()}, {training.train_tokens} training tokens"
            )
            builder = _Builder(preset, data, corpus.stats(), tokenizer, training, reporter)
        reports = []
        for name in preset.names:
            if builder is not None and name in todo:
                reports.append(builder.build(name))
            elif name in selected:
                directory = layout.model_dir(name, data)
                reports.append(ModelReport(name, "cached", directory, layout.read_stamp(directory) or {}))
                reporter.end(reports[-1])
    return reports


class _Builder:
    def __init__(
        self,
        preset: Preset,
        data: str | os.PathLike[str] | None,
        corpus_stats: dict[str, int | str],
        tokenizer: tokenizers.Tokenizer,
        training: TrainingData,
        reporter: Reporter,
    ) -> None:
        self.preset = preset
        self.data = data
        self.corpus_stats = corpus_stats
        self.tokenizer = tokenizer
        self.training = training
        self.reporter = reporter
        self._samples: list[Sample] | None = None

    def build(self, name: str) -> ModelReport:
        recipe = self.preset.recipe(name)
        if isinstance(recipe, TrainedRecipe):
            model, stats = train_model(
                self.preset, recipe, self.training, self.reporter.begin(name, recipe.steps)
            )
            action, extra = "trained", {"training": asdict(stats), "quantization": None}
        else:
            self.reporter.begin(name, 0)
            model = self._load(recipe.source)
            quantization = quantize_model(model, recipe.bits)
            model.config.planetserve_quantization = quantization
            action, extra = (
                "quantized",
                {"training": None, "quantization": quantization, "source": model_id(recipe.source)},
            )
        if name == REFERENCE:
            self._samples = sample_continuations(
                model, self.training.sample_prompts, self.preset.sample_tokens
            )
        stamp = self._stamp(name, model) | extra | {"eval": self._evaluate(model)}
        directory = self._save(name, model, stamp)
        report = ModelReport(name, action, directory, stamp)
        self.reporter.end(report)
        return report

    def _load(self, name: str) -> PreTrainedModel:
        with quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(
                str(layout.model_dir(name, self.data)), local_files_only=True
            )
        return model.eval()

    def _reference_samples(self) -> list[Sample] | None:
        """gt's samples, from the gt of this recipe only (another recipe's gt has another tokenizer)."""
        if self._samples is None and state(self.preset, REFERENCE, self.data) == "current":
            gt = self._load(REFERENCE)
            self._samples = sample_continuations(gt, self.training.sample_prompts, self.preset.sample_tokens)
        return self._samples

    def _evaluate(self, model: torch.nn.Module) -> dict[str, float | int | None]:
        loss = held_out_loss(model, self.training.eval_blocks)
        scores: dict[str, float | int | None] = {
            "held_out_loss": loss,
            "held_out_ppl": perplexity(loss),
            "held_out_tokens": self.training.eval_blocks.numel(),
            "gt_sample_loss": None,
            "gt_sample_ppl": None,
            "gt_sample_tokens": 0,
        }
        samples = self._reference_samples()
        if samples:
            sample_loss = continuation_loss(model, samples)
            scores |= {
                "gt_sample_loss": sample_loss,
                "gt_sample_ppl": perplexity(sample_loss),
                "gt_sample_tokens": sum(len(s.continuation) for s in samples),
            }
        return scores

    def _stamp(self, name: str, model: torch.nn.Module) -> dict[str, Any]:
        return {
            "name": name,
            "model_id": model_id(name),
            "role": self.preset.recipe(name).role,
            "preset": self.preset.name,
            "recipe_hash": recipe_hash(self.preset, name),
            "recipe": asdict(self.preset.recipe(name)),
            "params": param_count(self.preset, name),
            "weights_sha256": weights_digest(model),
            "corpus": self.corpus_stats,
            "tokenizer": {
                "vocab_size": self.tokenizer.get_vocab_size(),
                "sha256": hashlib.sha256(self.tokenizer.to_str().encode()).hexdigest(),
            },
            "versions": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "tokenizers": tokenizers.__version__,
                "machine": platform.machine(),
            },
        }

    def _save(self, name: str, model: PreTrainedModel, stamp: dict[str, Any]) -> Path:
        final = layout.model_dir(name, self.data)
        model.generation_config = GenerationConfig(
            bos_token_id=BOS_ID, eos_token_id=list(STOP_IDS), pad_token_id=PAD_ID, do_sample=False
        )
        with layout.staged(final) as staging:
            with quiet_transformers():
                model.save_pretrained(str(staging))
            save_tokenizer(self.tokenizer, staging, self.preset.max_position_embeddings)
            layout.write_stamp(staging, stamp)
        return final
