"""What one `localnet up` runs, and where each part of it lives under the network's root:

    <root>/v<i>              validator v<i> (genesis.network)
    <root>/verifiers/v<i>    the verifier daemon beside validator v<i>
    <root>/nodes/<name>      a model node
    <root>/relays/relay<i>   a user relay
    <root>/relays/client     the client's relay
    <root>/dashboard         the dashboard
    <root>/keys/<org>.json   each organisation's key (registers its nodes)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from planetserve.chain.keys import KeySet
from planetserve.genesis.network import NetworkSpec, ValidatorInfo
from planetserve.localnet.config import LocalnetConfig
from planetserve.registry.genesis import GenesisOrganisation

VERIFIERS, NODES, RELAYS, KEYS = "verifiers", "nodes", "relays", "keys"
CLIENT = "client"
KINDS = {VERIFIERS: "verifier", NODES: "node", RELAYS: "relay"}
"""Directory of a role's homes → the name its process is recorded under."""
DASHBOARD = "dashboard"
"""The dashboard's home (directly under the root) and the name its process is recorded under."""


def org_key_path(root: Path, org_id: str) -> Path:
    return root / KEYS / f"{org_id}.json"


def organisation_keys(root: Path, config: LocalnetConfig) -> dict[str, KeySet]:
    """The key of each organisation `config` names (org id → key), each made the first time it is needed."""
    keys = {}
    for org_id in sorted({node.org_id for node in config.nodes}):
        path = org_key_path(root, org_id)
        if path.exists():
            keys[org_id] = KeySet.load(path)
        else:
            keys[org_id] = KeySet.generate()
            path.parent.mkdir(parents=True, exist_ok=True)
            keys[org_id].save(path)
    return keys


def genesis_organisations(keys: Mapping[str, KeySet]) -> list[GenesisOrganisation]:
    """The organisations of `organisation_keys`, as a genesis or a registration declares them."""
    return [GenesisOrganisation(org_id, org_id, key.public) for org_id, key in keys.items()]


@dataclass(frozen=True)
class Plan:
    """One `up`'s network, organisation keys and role homes, read or made once and handed to each step
    (genesis, registration, role starters), so that no step reads a key or places a home again and all of
    them work from the same ones."""

    root: Path
    config: LocalnetConfig
    spec: NetworkSpec
    org_keys: Mapping[str, KeySet]
    """Organisation id → its key, for every organisation the configuration names."""

    @property
    def organisations(self) -> list[GenesisOrganisation]:
        return genesis_organisations(self.org_keys)

    @property
    def family_dir(self) -> Path:
        return self.config.family_dir(self.root)

    @property
    def relay_names(self) -> list[str]:
        """The user relays, the client's first."""
        return ([CLIENT] if self.config.has_client else []) + [f"relay{i}" for i in range(self.config.relays)]

    def org_key_path(self, org_id: str) -> Path:
        return org_key_path(self.root, org_id)

    def node_home(self, name: str) -> Path:
        return self.root / NODES / name

    def relay_home(self, name: str) -> Path:
        return self.root / RELAYS / name

    def verifier_home(self, validator: ValidatorInfo) -> Path:
        return self.root / VERIFIERS / validator.moniker

    @property
    def dashboard_home(self) -> Path:
        return self.root / DASHBOARD

    def validator(self, index: int) -> ValidatorInfo:
        """The validator whose RPC the `index`-th node or relay reads: each in turn."""
        return self.spec.validators[index % len(self.spec.validators)]


def existing_homes(root: Path) -> list[tuple[str, Path]]:
    """Every role home under `root` (kind, home), whatever the configuration says now."""
    homes = [(kind, home) for directory, kind in KINDS.items()
             for home in sorted((root / directory).glob("*")) if home.is_dir()]
    if (root / DASHBOARD).is_dir():
        homes.append((DASHBOARD, root / DASHBOARD))
    return homes
