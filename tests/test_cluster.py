"""Building validator homes and running them: a real 4-validator cometbft network (kvstore app)."""

from __future__ import annotations

import base64
import json
import sys
import tomllib

import pytest
from chainnet import FAST_P2P

from planetserve.chain.keys import KeySet
from planetserve.genesis.network import (
    PORTS_ENV,
    NetworkBuildError,
    NetworkSpec,
    build_network,
    edit_toml,
    free_ports,
)
from planetserve.localnet.cluster import Cluster, ClusterError, stop_all


def test_edit_toml_replaces_in_section_and_adds_missing_keys() -> None:
    text = 'moniker = "a"\n\n[rpc]\n# the address\nladdr = "x"\n\n[p2p]\nladdr = "y"\npex = true\n'
    out = edit_toml(
        text,
        {
            "": {"moniker": "b", "log_level": "error"},
            "rpc": {"laddr": "tcp://127.0.0.1:1"},
            "p2p": {"pex": False, "allow_duplicate_ip": True},
            "consensus": {"timeout_commit": "1s"},
        },
    )
    parsed = tomllib.loads(out)
    assert parsed["moniker"] == "b" and parsed["log_level"] == "error"
    assert parsed["rpc"] == {"laddr": "tcp://127.0.0.1:1"}
    assert parsed["p2p"] == {"laddr": "y", "pex": False, "allow_duplicate_ip": True}
    assert parsed["consensus"] == {"timeout_commit": "1s"}
    assert "# the address" in out


def test_ports_are_drawn_from_the_configured_range(monkeypatch) -> None:
    monkeypatch.setenv(PORTS_ENV, "20000-20009")
    ports = free_ports(6)
    assert len(set(ports)) == 6 and all(20000 <= p <= 20009 for p in ports)
    with pytest.raises(NetworkBuildError, match=r"found only \d of 6 free ports in 20000..20009"):
        free_ports(6)  # the range holds ten, and one process never hands a port out twice
    for bad in ("20000", "20009-20000", "80-90", "a-b", "20000-70000"):
        monkeypatch.setenv(PORTS_ENV, bad)
        with pytest.raises(NetworkBuildError, match=f"{PORTS_ENV}=.*must be LOW-HIGH"):
            free_ports(1)


def test_build_with_app_state_and_failing_app(tmp_path) -> None:
    spec = build_network(
        tmp_path / "net",
        2,
        "app-chain",
        lambda infos: {"members": [i.keys["identity"] for i in infos]},
        db_urls=["postgresql://db/a", "postgresql://db/b"],
        genesis_time="2026-01-01T00:00:00Z",
    )
    assert not spec.kvstore
    v0 = spec.validators[0]
    genesis = json.loads(spec.genesis_path.read_text())
    assert genesis["app_state"] == {"members": [v.keys["identity"] for v in spec.validators]}
    assert genesis["genesis_time"] == "2026-01-01T00:00:00Z"
    config = tomllib.loads((v0.home / "config" / "config.toml").read_text())
    assert config["proxy_app"] == f"tcp://127.0.0.1:{v0.ports.abci}"
    app_cfg = json.loads((v0.home / "config" / "planetserve.json").read_text())
    assert app_cfg == {
        "abci_listen": f"127.0.0.1:{v0.ports.abci}",
        "db": "postgresql://db/a",
        "chain_id": "app-chain",
        "keep_heights": 0,
        "snapshot_interval": 1000,
        "snapshot_keep": 2,
        "retain_blocks": 0,
        "metrics_listen": f"127.0.0.1:{v0.ports.app_metrics}",
    }
    assert config["instrumentation"] == {
        **config["instrumentation"], "prometheus": True,
        "prometheus_listen_addr": f"127.0.0.1:{v0.ports.cometbft_metrics}"}
    with pytest.raises(ClusterError, match="expects an ABCI app"):
        Cluster(spec)
    failing = Cluster(spec, lambda info: [sys.executable, "-c", "import sys; sys.exit(3)"])
    with failing, pytest.raises(ClusterError, match="app exited with 3"):
        failing.start(0)
    with pytest.raises(NetworkBuildError, match="already exists"):
        build_network(tmp_path / "net", 2, "app-chain", None)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster")
    spec = build_network(root, 4, "cluster-test", None, timeout_commit="300ms", extra_config=FAST_P2P)
    c = Cluster(spec)
    try:
        c.start()
        c.wait_for_height(2, timeout=60)
        yield c
    finally:
        c.close()


@pytest.mark.network
def test_homes_share_one_genesis_and_match_running_nodes(cluster: Cluster) -> None:
    spec = cluster.spec
    assert NetworkSpec.load(spec.root) == spec
    texts = {(v.home / "config" / "genesis.json").read_text() for v in spec.validators}
    assert len(texts) == 1
    genesis = json.loads(texts.pop())
    assert genesis["chain_id"] == "cluster-test" and "app_state" not in genesis
    assert [g["address"] for g in genesis["validators"]] == [
        v.address.hex().upper() for v in spec.validators
    ]
    for v in spec.validators:
        config = tomllib.loads((v.home / "config" / "config.toml").read_text())
        assert config["proxy_app"] == "kvstore"
        assert config["rpc"]["laddr"] == f"tcp://127.0.0.1:{v.ports.rpc}"
        assert config["p2p"]["laddr"] == f"tcp://127.0.0.1:{v.ports.p2p}"
        peers = set(config["p2p"]["persistent_peers"].split(","))
        assert peers == {o.p2p_address for o in spec.validators if o.index != v.index}
        assert config["consensus"]["timeout_commit"] == "300ms"
        keys = KeySet.load(v.home / "config" / "planetserve_keys.json")
        assert keys.public_summary() == v.keys
        status = cluster.status(v.index)
        assert status["node_info"]["id"] == v.node_id
        assert base64.b64decode(status["validator_info"]["pub_key"]["value"]) == v.pub_key
        assert status["validator_info"]["voting_power"] == "10"


@pytest.mark.network
def test_pids_and_logs_are_recorded(cluster: Cluster) -> None:
    for v in cluster.spec.validators:
        pids = json.loads((v.home / "pids.json").read_text())
        assert set(pids) == {"cometbft"}
        assert cluster.running(v.index) == {"app": False, "cometbft": True}
        assert (v.home / "logs" / "cometbft.log").stat().st_size > 0


@pytest.mark.network
def test_app_hashes_agree(cluster: Cluster) -> None:
    h = max(cluster.wait_for_height(2).values())
    cluster.rpc(0).broadcast_tx_commit(b"cluster=test")
    hashes = cluster.app_hashes(h + 2)
    assert len(hashes) == 4 and len(set(hashes.values())) == 1


@pytest.mark.network
def test_wait_for_height_timeout_names_every_validator(cluster: Cluster) -> None:
    with pytest.raises(TimeoutError, match=r"height 1000000 not reached .*v0=\d+, v1=\d+, v2=\d+"):
        cluster.wait_for_height(1_000_000, timeout=0.2)


@pytest.mark.network
@pytest.mark.faults
def test_stop_restart_and_kill_validators(cluster: Cluster) -> None:
    cluster.stop(3)
    assert cluster.running(3) == {"app": False, "cometbft": False}
    assert cluster.height(3) is None
    h = max(cluster.wait_for_height(1, validators=[0, 1, 2]).values())
    cluster.wait_for_height(h + 3, validators=[0, 1, 2], timeout=30)  # 30 of 40 still commit
    with pytest.raises(TimeoutError, match="v3=unreachable"):
        cluster.wait_for_height(1, validators=[3], timeout=0.2)
    cluster.restart(3)
    cluster.wait_for_height(h + 3, validators=[3], timeout=60)

    cluster.kill(2)
    assert cluster.running(2)["cometbft"] is False
    cluster.start(2)
    top = max(cluster.wait_for_height(1).values())
    cluster.wait_for_height(top + 2, timeout=60)


@pytest.mark.network
def test_stop_all_works_from_the_files_alone(cluster: Cluster) -> None:
    stop_all(cluster.spec.root)
    for v in cluster.spec.validators:
        assert cluster.running(v.index) == {"app": False, "cometbft": False}
        assert json.loads((v.home / "pids.json").read_text()) == {}
