"""Loading a model for serving or scoring: a family name resolves to its directory in the data
directory, anything else must be a Hugging Face checkpoint directory. Both go through the same
`from_pretrained` path with `local_files_only=True`: nothing is ever fetched from a hub.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planetserve.models import layout, recipes
from planetserve.models.layout import DATA_ENV, read_stamp
from planetserve.models.recipes import NAMES, ORG

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


class ModelError(Exception):
    """A model that cannot be served; the message says what to do."""


class ModelNotFound(ModelError, LookupError):
    pass


class CheckpointError(ModelError):
    """The directory exists but is not a loadable checkpoint (missing or corrupt files)."""


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    model_id: str
    path: Path
    stamp: dict[str, Any] | None = field(default=None, repr=False)
    """The family's planetserve.json (recipe, measurements), None for outside checkpoints."""

    @property
    def max_model_len(self) -> int:
        return int(self.model.config.max_position_embeddings)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The generation config's EOS ids (a chat model often has several), else the tokenizer's."""
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        ids = eos if isinstance(eos, list | tuple) else [eos]
        return tuple(int(i) for i in ids if i is not None)

    @property
    def quantization(self) -> dict[str, Any] | None:
        return getattr(self.model.config, "planetserve_quantization", None)


def train_hint(data: Path) -> str:
    default = data == layout.data_dir(None)
    return "run `planetserve models train`" + ("" if default else f" --data-dir {data}")


def resolve(
    name_or_path: str | os.PathLike[str], data: str | os.PathLike[str] | None = None
) -> tuple[str, Path]:
    """(model id, checkpoint directory). Family names (`gt`) and ids (`planetserve/gt`) come first, so
    a family model is never shadowed by a directory of the same name in the working directory."""
    text = os.fspath(name_or_path)
    name = text.removeprefix(f"{ORG}/")
    if name in NAMES:
        directory = layout.model_dir(name, data)
        if not directory.is_dir():
            raise ModelNotFound(
                f"model {recipes.model_id(name)} is not trained in {layout.data_dir(data)} "
                f"({DATA_ENV} or --data-dir picks the data directory); {train_hint(layout.data_dir(data))}"
            )
        return recipes.model_id(name), directory
    path = Path(text).expanduser()
    if path.is_dir():
        stamp = read_stamp(path)
        return (stamp or {}).get("model_id") or path.resolve().name, path
    raise ModelNotFound(
        f"unknown model {text!r}: neither a family model ({', '.join(NAMES)}, or {ORG}/<name>) nor a "
        f"checkpoint directory; {train_hint(layout.data_dir(data))} to build the family"
    )


def check_files(directory: Path) -> None:
    missing = []
    if not (directory / "config.json").is_file():
        missing.append("config.json")
    if not any((directory / f).is_file() for f in WEIGHT_FILES):
        missing.append(" or ".join(WEIGHT_FILES[:2]))
    if not any((directory / f).is_file() for f in TOKENIZER_FILES):
        missing.append(" or ".join(TOKENIZER_FILES))
    if missing:
        raise CheckpointError(f"{directory} is not a complete checkpoint: missing {', '.join(missing)}")


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """No per-shard progress bars from transformers while we load or save (restored afterwards)."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def load(
    name_or_path: str | os.PathLike[str],
    data_dir: str | os.PathLike[str] | None = None,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    model_id: str | None = None,
) -> LoadedModel:
    """Load a model and its tokenizer for inference (eval mode).

    `dtype` None keeps the checkpoint's own dtype. `model_id` overrides the id reported for an
    outside checkpoint directory (default: its stamp's id, else the directory name).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    resolved_id, directory = resolve(name_or_path, data_dir)
    check_files(directory)
    try:
        with quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(
                str(directory), local_files_only=True, trust_remote_code=False, dtype=dtype or "auto"
            )
    except Exception as exc:  # transformers, safetensors and tokenizers each raise their own types
        raise CheckpointError(
            f"cannot load the checkpoint in {directory}: {type(exc).__name__}: {exc}"
        ) from exc
    model.to(device)
    model.eval()
    return LoadedModel(model, tokenizer, model_id or resolved_id, directory, read_stamp(directory))
