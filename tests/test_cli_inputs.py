"""Bad inputs to the operators' commands of state sync, metrics, parameter votes and key rotation: each is
refused with a message that names what is wrong, before anything is written or sent (no network is
needed to refuse them)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from planetserve.chain.keys import KeySet
from planetserve.cli import main


def refused(*args: str) -> str:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert result.exit_code != 0, result.output
    return result.output


@pytest.fixture
def genesis(tmp_path: Path) -> Path:
    path = tmp_path / "genesis.json"
    path.write_text("{}")
    return path


def chain_init(tmp_path: Path, genesis: Path, *args: str) -> list[str]:
    return ["chain", "init", "--home", str(tmp_path / "home"), "--genesis", str(genesis), "--peer",
            "0123456789abcdef0123456789abcdef01234567@127.0.0.1:26656", "--moniker", "v5", *args]


@pytest.mark.parametrize(("args", "message"), [
    (["--trust-height", "5"], "go with --state-sync"),
    (["--trust-hash", "AB" * 32], "go with --state-sync"),
    (["--state-sync", "http://127.0.0.1:1", "--trust-height", "5"], "give both --trust-height and --trust-hash"),
    (["--state-sync", "http://127.0.0.1:1", "--trust-height", "5", "--trust-hash", "zz"],
     "is not a 64-hex-digit header hash"),
    (["--state-sync", "http://127.0.0.1:1", "--trust-height", "5", "--trust-hash", "AB" * 31],
     "is not a 64-hex-digit header hash"),
    (["--state-sync", "http://127.0.0.1:1", "--trust-height", "0", "--trust-hash", "AB" * 32],
     "0 is not in the range x>=1"),
    (["--metrics", "nonsense"], "metrics address 'nonsense' is not host:port"),
    (["--app-metrics", "127.0.0.1:99999"], "is not host:port"),
])
def test_chain_init_refuses_bad_state_sync_and_metrics_settings(tmp_path: Path, genesis: Path, args: list[str],
                                                                 message: str) -> None:
    assert message in refused(*chain_init(tmp_path, genesis, *args))
    assert not (tmp_path / "home").exists()


@pytest.mark.parametrize("setting", ["max_signer_txs", "max_signer_txs=", "=5", "max_signer_txs=ten",
                                     "max_signer_txs=1.5"])
def test_propose_params_refuses_a_setting_that_is_not_name_equals_integer(tmp_path: Path, setting: str) -> None:
    keys = tmp_path / "member.json"
    KeySet.generate().save(keys)
    out = refused("tx", "propose-params", "--height", "100", "--set", setting, "--keys", str(keys),
                  "--node", "http://127.0.0.1:1")
    assert f"--set takes NAME=INTEGER, got {setting!r}" in out


def test_node_init_refuses_a_bad_metrics_address(tmp_path: Path, genesis: Path) -> None:
    out = refused("node", "init-model", "--home", str(tmp_path / "mn"), "--org-id", "acme", "--model-id", "gt",
                  "--genesis", str(genesis), "--metrics", "localhost")
    assert "is not host:port" in out and not (tmp_path / "mn").exists()


def test_key_rotation_commands_refuse_homes_and_key_files_they_cannot_use(tmp_path: Path) -> None:
    not_a_key = tmp_path / "org.json"
    not_a_key.write_text('{"identity_seed": "00"}')
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "node.json" in refused("node", "rotate-key", "--home", str(empty), "--org-keys", str(not_a_key))
    out = refused("chain", "rotate-keys", "--home", str(empty), "--node", "http://127.0.0.1:1")
    assert "no key file at" in out and "planetserve_keys.json" in out
    assert not list(empty.iterdir())  # nothing prepared
