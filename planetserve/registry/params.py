"""Chain parameters, fixed in the genesis file's app_state."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Self

from planetserve.registry.entities import Record
from planetserve.registry.errors import InvalidField


@dataclass(frozen=True)
class Params(Record):
    max_tx_bytes: int = 16_384
    user_ttl_seconds: int = 600
    proposal_ttl_blocks: int = 1_000
    max_query_entries: int = 20_000

    @classmethod
    def from_genesis(cls, raw: dict[str, Any] | None) -> Self:
        """Read parameters from genesis JSON; absent ones take their defaults, unknown ones are errors."""
        raw = raw or {}
        known = {f.name for f in fields(cls)}
        for name, value in raw.items():
            if name not in known:
                raise InvalidField(name, "unknown parameter")
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidField(name, "must be a positive integer")
        return cls(**raw)
