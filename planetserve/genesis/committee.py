"""The genesis app_state of a planetserve network: every genesis validator is a committee member."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from planetserve.genesis.network import ValidatorInfo
from planetserve.registry.entities import Member, Model
from planetserve.registry.genesis import (
    AppState,
    GenesisOrganisation,
    model_json,
    parse_models,
    parse_organisations,
)
from planetserve.registry.params import Params

ModelSpec = tuple[str, str] | tuple[str, str, int, int]
"""(model_id, name) or (model_id, name, layers, layer_mib)."""


def app_state_builder(
    models: Sequence[ModelSpec] = (),
    params: Params | None = None,
    credential: str = "{moniker}: founding committee member",
    organisations: Sequence[GenesisOrganisation] = (),
    exported: tuple[tuple[bytes, bytes], ...] = (),
) -> Callable[[list[ValidatorInfo]], dict]:
    """A function from the validators `build_network` created to the genesis app_state.

    `exported`: registry entries another chain exported (genesis/export.py `registry_of`), loaded first.
    Models and organisations are validated here, by the rules InitChain applies, so that a bad one
    raises a RegistryError (InvalidField, AlreadyExists) before any validator home is created."""
    checked_models = parse_models([model_json(Model(spec[0], spec[1], 0, *spec[2:])) for spec in models])
    checked_orgs = parse_organisations([o.to_json() for o in organisations])

    def build(infos: list[ValidatorInfo]) -> dict:
        committee = tuple(
            Member(
                operator=bytes.fromhex(info.keys["identity"]),
                consensus_key=info.pub_key,
                vrf_key=bytes.fromhex(info.keys["vrf"]),
                x25519_key=bytes.fromhex(info.keys["x25519"]),
                credential=credential.format(moniker=info.moniker),
                power=info.power,
            )
            for info in infos
            if info.power > 0
        )
        return AppState(
            params=params or Params(),
            committee=committee,
            models=checked_models,
            organisations=checked_orgs,
            exported=exported,
        ).to_json()

    return build

