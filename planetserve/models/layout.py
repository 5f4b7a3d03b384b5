"""Where the family lives on disk: `<data>/models/<name>/`, each a plain Hugging Face checkpoint
directory plus `planetserve.json`, the stamp that records the recipe hash and the measured numbers.

The data directory is `$PLANETSERVE_DATA`, else `~/.cache/planetserve`. A checkpoint is written into a
temporary sibling and renamed into place, so a directory that exists is complete.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from planetserve.models.recipes import Preset, recipe_hash

DATA_ENV = "PLANETSERVE_DATA"
STAMP_FILE = "planetserve.json"


def data_dir(path: str | os.PathLike[str] | None = None) -> Path:
    if path is not None:
        return Path(path).expanduser()
    env = os.environ.get(DATA_ENV, "").strip()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "planetserve"


def model_dir(name: str, data: str | os.PathLike[str] | None = None) -> Path:
    return data_dir(data) / "models" / name


@contextmanager
def training_lock(data: str | os.PathLike[str] | None = None) -> Iterator[None]:
    """One trainer per data directory at a time (parallel test workers may share one)."""
    root = data_dir(data)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".train.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def read_stamp(directory: Path) -> dict[str, Any] | None:
    """The stamp, or None where there is none or it is unreadable (then the model counts as untrained)."""
    try:
        stamp = json.loads((directory / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) else None


def write_stamp(directory: Path, stamp: dict[str, Any]) -> None:
    (directory / STAMP_FILE).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")


@contextmanager
def staged(final: Path) -> Iterator[Path]:
    """A fresh directory to write a checkpoint into; on success it replaces `final` (readers see the
    old directory or the new one, never a mix), on failure it is removed."""
    staging = final.with_name(f".{final.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    retired = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():
        final.rename(retired)
    staging.rename(final)
    shutil.rmtree(retired, ignore_errors=True)


def state(preset: Preset, name: str, data: str | os.PathLike[str] | None = None) -> str:
    """current (stamp matches this preset's recipe), stale (trained by another recipe) or missing."""
    stamp = read_stamp(model_dir(name, data))
    if stamp is None:
        return "missing"
    return "current" if stamp.get("recipe_hash") == recipe_hash(preset, name) else "stale"
