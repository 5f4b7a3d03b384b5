"""A real planetserve network for tests: N validators (cometbft + the ABCI app) on free ports."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from harness import relaxed

from planetserve.chain.client import LedgerClient
from planetserve.chain.keys import KeySet
from planetserve.chain.lightclient import LightClient
from planetserve.chain.rpc import RpcClient
from planetserve.genesis.committee import app_state_builder
from planetserve.genesis.network import KEYS_FILE, build_network
from planetserve.localnet.cluster import Cluster
from planetserve.localnet.net import cluster_app
from planetserve.registry.genesis import GenesisOrganisation
from planetserve.registry.params import Params

MODELS = (("gt", "reference model"), ("small", "smaller model"))
LISTED_AT_ONCE = Params(probation_epochs=0)
"""The default genesis parameters of test networks: nodes are listed from registration, since these
tests are about the ledger, the overlay and the committee, not probation (which the harness tests:
tests/adversaries/test_whitewashing_node.py)."""
SHORT_EPOCHS = dataclasses.replace(LISTED_AT_ONCE, epoch_blocks=20, results_blocks=8, vrf_window_blocks=4,
                                   plan_window_blocks=4)
"""Epochs of 20 blocks (about 7 s at the default pace): what takes effect at the next epoch's first block,
a key rotation for one, does within a test's patience."""
FAST_P2P = {"p2p": {"flush_throttle_timeout": "10ms"}, "consensus": {"peer_gossip_sleep_duration": "10ms"}}
"""config.toml settings of test networks: CometBFT flushes a connection's messages every 100 ms by
default and its gossip routines sleep 100 ms between rounds, and a height takes several of them. Four
validators on one machine make, by default and with these: 1.6 and 2.8 blocks a second with a 300 ms
timeout_commit, 2.1 and 5 with 150 ms, 2.5 and 15 with 10 ms."""


def merge_config(*configs: dict[str, dict] | None) -> dict[str, dict]:
    """config.toml edits (section -> keys), each merged over the ones before it, key by key."""
    merged: dict[str, dict] = {}
    for config in configs:
        for section, keys in (config or {}).items():
            merged.setdefault(section, {}).update(keys)
    return merged


def fast_config(*configs: dict[str, dict] | None) -> dict[str, dict]:
    """FAST_P2P with `configs` merged over it."""
    return merge_config(FAST_P2P, *configs)


def start_network(root: Path, n: int = 4, db_urls: Sequence[str] | None = None,
                  timeout_commit: str = "300ms", params: Params | None = None, models: Sequence = MODELS,
                  organisations: Sequence[GenesisOrganisation] = (), timeout_propose: str | None = None,
                  limits: bool = False, extra_config: dict[str, dict] | None = None,
                  fast_p2p: bool = True) -> Cluster:
    """`timeout_propose` (CometBFT's default: 3 s) bounds a height whose proposer is down: networks
    whose tests stop validators set it lower. `extra_config`: more config.toml sections (mempool, rpc).
    `fast_p2p`: FAST_P2P's settings (off: CometBFT's defaults, for tests whose windows in blocks are
    sized for its default pace)."""
    propose = {"consensus": {"timeout_propose": timeout_propose}} if timeout_propose else {}
    params = params or LISTED_AT_ONCE
    params = params if limits else relaxed(params)
    spec = build_network(root, n, "planetserve-test",
                         app_state_builder(models, params, organisations=organisations),
                         timeout_commit=timeout_commit, db_urls=db_urls,
                         extra_config=merge_config(FAST_P2P if fast_p2p else None, propose, extra_config))
    cluster = Cluster(spec, cluster_app, start_timeout=60.0)
    cluster.start()
    cluster.wait_for_height(2, timeout=60.0)
    return cluster


def ledger(cluster: Cluster, i: int = 0, url: str | None = None) -> LedgerClient:
    rpc = RpcClient(url or cluster.rpc_url(i))
    return LedgerClient(rpc, LightClient.from_genesis_file(cluster.spec.genesis_path, rpc))


def member_keys(cluster: Cluster, i: int) -> KeySet:
    return KeySet.load(cluster.spec.validators[i].home / "config" / KEYS_FILE)


def assert_same_app_hashes(cluster: Cluster, up_to: int, validators: Sequence[int] | None = None) -> None:
    """Every listed validator has the same app hash at every height 1..up_to."""
    for height in range(1, up_to + 1):
        hashes = cluster.app_hashes(height, validators)
        assert len(set(hashes.values())) == 1, f"app hashes differ at height {height}: {hashes}"
