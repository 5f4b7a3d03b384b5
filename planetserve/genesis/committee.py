"""The genesis app_state of a planetserve network: every genesis validator is a committee member."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from planetserve.genesis.network import ValidatorInfo
from planetserve.registry.entities import Member, Model
from planetserve.registry.genesis import AppState
from planetserve.registry.params import Params


def app_state_builder(
    models: Sequence[tuple[str, str]] = (),
    params: Params | None = None,
    credential: str = "{moniker}: founding committee member",
) -> Callable[[list[ValidatorInfo]], dict]:
    """A function from the validators `build_network` created to the genesis app_state."""

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
            models=tuple(Model(model_id, name, 0) for model_id, name in models),
        ).to_json()

    return build
