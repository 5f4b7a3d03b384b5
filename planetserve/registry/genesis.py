"""The genesis `app_state`: parameters, the initial committee and the initially registered models.

    {"params": {...},
     "committee": [{"operator": hex, "consensus_key": hex, "vrf_key": hex, "x25519_key": hex,
                    "credential": str, "power": int}, ...],
     "models": [{"model_id": str, "name": str}, ...],
     "prices": {hardware class: credits per server-hour, ...}}     (default: credits.DEFAULT_PRICES)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from planetserve.registry import fields
from planetserve.registry.credits import DEFAULT_PRICES
from planetserve.registry.entities import Member, Model
from planetserve.registry.errors import AlreadyExists, InvalidField
from planetserve.registry.params import Params

_MEMBER_KEYS = ("operator", "consensus_key", "vrf_key", "x25519_key")


@dataclass(frozen=True)
class AppState:
    params: Params
    committee: tuple[Member, ...]
    models: tuple[Model, ...]
    prices: tuple[tuple[str, int], ...] = tuple(sorted(DEFAULT_PRICES.items()))

    def to_json(self) -> dict[str, Any]:
        return {
            "params": self.params.to_record(),
            "committee": [
                {**{k: getattr(m, k).hex() for k in _MEMBER_KEYS}, "credential": m.credential,
                 "power": m.power}
                for m in self.committee
            ],
            "models": [{"model_id": m.model_id, "name": m.name} for m in self.models],
            "prices": dict(self.prices),
        }


def _hex32(raw: dict[str, Any], name: str) -> bytes:
    try:
        value = bytes.fromhex(raw[name])
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidField(name, "must be 64 hex characters") from exc
    return fields.key32({name: value}, name)


def parse_app_state(raw: dict[str, Any]) -> AppState:
    """Validate genesis app_state; an invalid genesis stops the chain from starting, with the reason."""
    if not isinstance(raw, dict):
        raise InvalidField("app_state", "must be a JSON object")
    fields.check_keys(raw, {"committee"}, frozenset({"params", "models", "prices"}))
    params = Params.from_genesis(raw.get("params"))
    committee: list[Member] = []
    for entry in raw["committee"]:
        fields.check_keys(entry, {*_MEMBER_KEYS, "credential", "power"})
        member = Member(
            **{k: _hex32(entry, k) for k in _MEMBER_KEYS},
            credential=fields.text(entry, "credential", 1024),
            power=fields.integer(entry, "power", 1, 1_000_000),
        )
        if any(m.operator == member.operator or m.consensus_key == member.consensus_key
               for m in committee):
            raise AlreadyExists("duplicate committee member in genesis")
        committee.append(member)
    if not committee:
        raise InvalidField("committee", "must not be empty")
    models = []
    for entry in raw.get("models", []):
        fields.check_keys(entry, {"model_id", "name"})
        models.append(Model(fields.ident(entry, "model_id"), fields.text(entry, "name", 128), 0))
    if len({m.model_id for m in models}) != len(models):
        raise AlreadyExists("duplicate model in genesis")
    return AppState(params, tuple(committee), tuple(models), _prices(raw.get("prices", DEFAULT_PRICES)))


def _prices(raw: Any) -> tuple[tuple[str, int], ...]:
    if not isinstance(raw, dict):
        raise InvalidField("prices", "must map hardware classes to credits per server-hour")
    for hardware, rate in raw.items():
        fields.hardware({"hardware": hardware})
        fields.integer({"prices": rate}, "prices", 1, 10**9)
    return tuple(sorted(raw.items()))
