"""The project's own small model family (see docs/models.md): no weights are downloaded, the family is
trained from the standard library's documentation and cached under the data directory."""

from planetserve.models.layout import DATA_ENV, data_dir, model_dir
from planetserve.models.loading import CheckpointError, LoadedModel, ModelError, ModelNotFound, load, resolve
from planetserve.models.recipes import NAMES, PRESETS, model_id

__all__ = [
    "DATA_ENV",
    "NAMES",
    "PRESETS",
    "CheckpointError",
    "LoadedModel",
    "ModelError",
    "ModelNotFound",
    "data_dir",
    "load",
    "model_dir",
    "model_id",
    "resolve",
]
