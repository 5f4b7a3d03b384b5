"""Role home directories: each role keeps one JSON configuration in its home, loaded strictly so that
a misspelt setting is an error rather than silently ignored."""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from pathlib import Path
from typing import ClassVar, Self


class HomeError(Exception):
    """The home directory is missing, incomplete or its configuration is malformed."""


class HomeConfig:
    """Loading and saving a role's JSON configuration (a dataclass); unknown settings are errors."""

    FILE: ClassVar[str]
    INIT: ClassVar[str]
    """The `planetserve` command that creates the home, for the error a missing one gets."""

    @classmethod
    def load(cls, home: Path) -> Self:
        path = home / cls.FILE
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise HomeError(f"no {cls.FILE} in {home}: run `planetserve {cls.INIT} --home {home}`") from exc
        except json.JSONDecodeError as exc:
            raise HomeError(f"{path} is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise HomeError(f"{path} must hold a JSON object")
        unknown = sorted(set(raw) - {f.name for f in fields(cls)})  # type: ignore[arg-type]
        if unknown:
            raise HomeError(f"{path}: unknown settings {', '.join(unknown)}")
        try:
            config = cls(**raw)
        except (TypeError, ValueError) as exc:
            raise HomeError(f"{path}: {exc}") from exc
        config.check()
        return config

    def check(self) -> None:
        """Raise HomeError for settings that are present but unusable."""

    def save(self, home: Path) -> None:
        home.mkdir(parents=True, exist_ok=True)
        (home / self.FILE).write_text(json.dumps(asdict(self), indent=2, sort_keys=True) + "\n")  # type: ignore[call-overload]
