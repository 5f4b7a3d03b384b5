"""The genesis `app_state`: parameters, the initial committee, the initially registered models and the
organisations that exist from the start, with their credit endowment.

    {"params": {...},
     "committee": [{"operator": hex, "consensus_key": hex, "vrf_key": hex, "x25519_key": hex,
                    "credential": str, "power": int, "expires_at": int}, ...],
                                        ("expires_at" optional: genesis time + credential_ttl_seconds)
     "models": [{"model_id": str, "name": str, "layers": int, "layer_mib": int}, ...],
     "organisations": [{"org_id": str, "name": str, "owner": hex, "credits": int}, ...],
     "prices": {hardware class: credits per server-hour, ...},    (default: credits.DEFAULT_PRICES)
     "exported": [[key, base64 value], ...]}    (optional: a state `planetserve chain export` wrote)

A model's "layers" and "layer_mib" are optional but come together (the same limits as the
register-model transaction); a model without them does not declare its size. "organisations" is
optional; each is owned by the 64-hex public key "owner" as if that key had sent register-org at
genesis, and starts with "credits" credit-seconds (optional, default 0; credits.CREDIT_SECONDS per
credit), as if it had earned them.

"exported" holds state entries in strictly increasing key order, loaded before the rest. A genesis
that continues a chain (initial height above 1) holds its whole state, committee included; one that
starts a new chain from another's registry holds only the registry's families (chain/layout.py
`REGISTRY_PREFIXES`), and its committee and epochs begin afresh.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

from planetserve.registry import fields
from planetserve.registry.credits import DEFAULT_PRICES
from planetserve.registry.entities import Member, Model, Organisation
from planetserve.registry.errors import AlreadyExists, InvalidField
from planetserve.registry.params import Params

_MEMBER_KEYS = ("operator", "consensus_key", "vrf_key", "x25519_key")
MAX_GENESIS_CREDITS = 10**15
"""The most credit-seconds one organisation may be given at genesis (about 2.8 * 10**11 credits)."""


@dataclass(frozen=True)
class GenesisOrganisation:
    """An organisation that exists from genesis, with its initial balance in credit-seconds."""

    org_id: str
    name: str
    owner: bytes
    credits: int = 0

    def organisation(self, registered_at: int) -> Organisation:
        return Organisation(self.org_id, self.name, self.owner, registered_at)

    def to_json(self) -> dict[str, Any]:
        return {"org_id": self.org_id, "name": self.name, "owner": self.owner.hex(), "credits": self.credits}


@dataclass(frozen=True)
class AppState:
    params: Params
    committee: tuple[Member, ...]
    models: tuple[Model, ...]
    prices: tuple[tuple[str, int], ...] = tuple(sorted(DEFAULT_PRICES.items()))
    organisations: tuple[GenesisOrganisation, ...] = ()
    exported: tuple[tuple[bytes, bytes], ...] = ()

    def to_json(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "params": self.params.to_record(),
            "committee": [
                {**{k: getattr(m, k).hex() for k in _MEMBER_KEYS}, "credential": m.credential,
                 "power": m.power, **({"expires_at": m.expires_at} if m.expires_at else {})}
                for m in self.committee
            ],
            "models": [model_json(m) for m in self.models],
            "prices": dict(self.prices),
        }
        if self.organisations:
            state["organisations"] = [o.to_json() for o in self.organisations]
        if self.exported:
            state["exported"] = [[k.decode("ascii"), base64.b64encode(v).decode()] for k, v in self.exported]
        return state


def model_json(model: Model) -> dict[str, Any]:
    """A genesis model entry: the size only for a model that declares one."""
    entry: dict[str, Any] = {"model_id": model.model_id, "name": model.name}
    if model.layers or model.layer_mib:
        entry.update(layers=model.layers, layer_mib=model.layer_mib)
    return entry


def _hex32(raw: dict[str, Any], name: str) -> bytes:
    try:
        value = bytes.fromhex(raw[name])
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidField(name, "must be 64 hex characters") from exc
    return fields.key32({name: value}, name)


def _entries(raw: Any, name: str) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not all(isinstance(entry, dict) for entry in raw):
        raise InvalidField(name, "must be a list of JSON objects")
    return raw


def parse_app_state(raw: dict[str, Any]) -> AppState:
    """Validate genesis app_state; an invalid genesis stops the chain from starting, with the reason."""
    if not isinstance(raw, dict):
        raise InvalidField("app_state", "must be a JSON object")
    fields.check_keys(raw, {"committee"},
                      frozenset({"params", "models", "organisations", "prices", "exported"}))
    params = Params.from_genesis(raw.get("params"))
    committee: list[Member] = []
    for entry in _entries(raw["committee"], "committee"):
        fields.check_keys(entry, {*_MEMBER_KEYS, "credential", "power"}, frozenset({"expires_at"}))
        member = Member(
            **{k: _hex32(entry, k) for k in _MEMBER_KEYS},
            credential=fields.text(entry, "credential", 1024),
            power=fields.integer(entry, "power", 1, 1_000_000),
            expires_at=fields.integer(entry, "expires_at", 0, 2**62) if "expires_at" in entry else 0,
        )
        if any(m.operator == member.operator or m.consensus_key == member.consensus_key
               for m in committee):
            raise AlreadyExists("duplicate committee member in genesis")
        committee.append(member)
    if not committee:
        raise InvalidField("committee", "must not be empty")
    return AppState(
        params, tuple(committee), parse_models(raw.get("models", [])),
        _prices(raw.get("prices", DEFAULT_PRICES)), parse_organisations(raw.get("organisations", [])),
        parse_exported(raw.get("exported", [])),
    )


def parse_exported(raw: Any) -> tuple[tuple[bytes, bytes], ...]:
    """The "exported" entries: [ASCII key, base64 value] pairs in strictly increasing key order."""
    if not isinstance(raw, list):
        raise InvalidField("exported", "must be a list of [key, base64 value] pairs")
    out: list[tuple[bytes, bytes]] = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 2 and all(isinstance(x, str) for x in item)):
            raise InvalidField("exported", "must be a list of [key, base64 value] pairs")
        if not item[0].isascii() or not 0 < len(item[0]) <= 1024:
            raise InvalidField("exported", f"key {item[0][:80]!r} is not an ASCII state key")
        key = item[0].encode("ascii")
        if out and key <= out[-1][0]:
            raise InvalidField("exported", f"keys out of order at {item[0][:80]!r}")
        try:
            out.append((key, base64.b64decode(item[1], validate=True)))
        except binascii.Error:
            raise InvalidField("exported", f"the value of {item[0][:80]!r} is not base64") from None
    return tuple(out)


def parse_models(raw: Any) -> tuple[Model, ...]:
    """The genesis "models" list; registered at time 0. Raises InvalidField or AlreadyExists."""
    models: list[Model] = []
    for entry in _entries(raw, "models"):
        fields.check_keys(entry, {"model_id", "name"}, frozenset({"layers", "layer_mib"}))
        model_id = fields.ident(entry, "model_id")
        name = fields.text(entry, "name", 128)
        try:
            layers, layer_mib = fields.model_size(entry)
        except InvalidField as exc:
            raise InvalidField(exc.field, f"model {model_id!r}: {exc.reason}") from exc
        if any(m.model_id == model_id for m in models):
            raise AlreadyExists(f"duplicate model {model_id!r} in genesis")
        models.append(Model(model_id, name, 0, layers, layer_mib))
    return tuple(models)


def parse_organisations(raw: Any) -> tuple[GenesisOrganisation, ...]:
    """The genesis "organisations" list. Raises InvalidField or AlreadyExists."""
    orgs: list[GenesisOrganisation] = []
    for entry in _entries(raw, "organisations"):
        fields.check_keys(entry, {"org_id", "name", "owner"}, frozenset({"credits"}))
        org_id = fields.ident(entry, "org_id")
        org = GenesisOrganisation(
            org_id=org_id,
            name=fields.text(entry, "name", 128),
            owner=_hex32(entry, "owner"),
            credits=fields.integer(entry, "credits", 0, MAX_GENESIS_CREDITS) if "credits" in entry else 0,
        )
        if any(o.org_id == org_id for o in orgs):
            raise AlreadyExists(f"duplicate organisation {org_id!r} in genesis")
        orgs.append(org)
    return tuple(orgs)


def _prices(raw: Any) -> tuple[tuple[str, int], ...]:
    if not isinstance(raw, dict):
        raise InvalidField("prices", "must map hardware classes to credits per server-hour")
    for hardware, rate in raw.items():
        fields.hardware({"hardware": hardware})
        fields.integer({"prices": rate}, "prices", 1, 10**9)
    return tuple(sorted(raw.items()))
