"""The `planetserve` command end to end: localnet up/status/down, keys, transactions and queries."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from planetserve.chain.rpc import RpcClient, RpcError
from planetserve.cli import main
from planetserve.genesis.network import free_ports
from planetserve.registry import credits
from planetserve.registry.genesis import parse_app_state

pytestmark = pytest.mark.network


def run(*args: str, code: int = 0) -> str:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result.output


def run_json(*args: str) -> dict:
    """A command's JSON answer (stdout; what it reports on stderr, such as progress, is left out)."""
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


VALIDATORS_ONLY = 'nodes = []\n[network]\nverifiers = false\n[relays]\ncount = 0\n'
"""A localnet of the four validators alone (tests/test_localnet.py runs the whole system)."""


@pytest.fixture(scope="module")
def localnet(tmp_path_factory):
    root = tmp_path_factory.mktemp("localnet") / "build"
    config = root.parent / "validators.toml"
    config.write_text(VALIDATORS_ONLY)
    up = run_json("localnet", "up", "--root", str(root), "--config", str(config), "--json")
    yield root, up, config
    run("localnet", "down", "--root", str(root))


def test_localnet_up_prints_a_verified_node_list(localnet):
    _, up, _ = localnet
    assert len(up["rpc"]) == 4 and up["height"] >= 1
    assert up["nodes"] == [] and up["answer"] is None and up["client"] is None


def test_localnet_up_twice_resumes_and_status_reports_health(localnet):
    root, first, config = localnet
    again = run_json("localnet", "up", "--root", str(root), "--config", str(config), "--json")
    assert again["rpc"] == first["rpc"] and again["started"] == []
    status = json.loads(run("localnet", "status", "--root", str(root), "--json"))
    assert all(v["app"] and v["cometbft"] and v["up"] and v["height"] >= 2 for v in status["validators"])
    assert status["verifiers"] == status["nodes"] == status["relays"] == []
    assert "up" in run("localnet", "status", "--root", str(root))


def test_keys_new_and_show(tmp_path):
    path = tmp_path / "k.json"
    created = json.loads(run("keys", "new", str(path), "--json"))
    assert json.loads(run("keys", "show", str(path), "--json")) == created
    assert "already exists" in run("keys", "new", str(path), code=1)
    assert "seed" not in run("keys", "show", str(path))
    (tmp_path / "bad.json").write_text("{}")
    assert "malformed key file" in run("keys", "show", str(tmp_path / "bad.json"), code=1)
    assert "no 'identity_seed' (a key file holds identity_seed, vrf_seed and x25519_secret" in " ".join(
        run("keys", "show", str(tmp_path / "bad.json"), code=1).split())
    assert "is a directory" in run("keys", "show", str(tmp_path), code=2)


def test_transactions_and_verified_queries(localnet, tmp_path):
    _, up, _ = localnet
    node, genesis = up["rpc"][1], up["genesis"]
    owner, model_node, user = (tmp_path / f"{n}.json" for n in ("owner", "node", "user"))
    for path in (owner, model_node, user):
        run("keys", "new", str(path))
    run("tx", "register-org", "--org-id", "acme", "--name", "ACME", "--keys", str(owner), "--node", node)
    done = json.loads(run("tx", "register-model-node", "--org-id", "acme", "--node-keys", str(model_node),
                          "--model-id", "gt", "--address", "127.0.0.1:7201", "--hardware", "cpu",
                          "--capacity", "2", "--region", "eu", "--memory-mib", "24576", "--gflops", "80000",
                          "--keys", str(owner), "--node", node, "--json"))
    assert done["code"] == 0 and done["height"] > 0
    registered = json.loads(run("tx", "register-user", "--address", "127.0.0.1:9301", "--region", "eu",
                                "--keys", str(user), "--node", node, "--json"))
    assert {"type": "register_user", "attributes": {"user": json.loads(
        run("keys", "show", str(user), "--json"))["identity"]}} in registered["events"]
    assert not registered["verified"]  # no genesis file: the endpoint's word
    renewed = json.loads(run("tx", "heartbeat", "--keys", str(user), "--node", node, "--genesis", genesis,
                             "--witness", up["rpc"][2], "--json"))
    assert renewed["code"] == 0 and renewed["verified"] and renewed["height"] > registered["height"]
    assert "outcome verified" in run("tx", "heartbeat", "--keys", str(user), "--node", node, "--genesis", genesis)
    after = str(registered["height"])
    nodes = json.loads(run("query", "nodes", "--model", "gt", "--region", "eu", "--genesis", genesis,
                           "--node", node, "--min-height", after, "--json"))
    assert nodes["verified"] and [n["org_id"] for n in nodes["nodes"]] == ["acme"]
    users = json.loads(run("query", "users", "--region", "eu", "--genesis", genesis, "--node", node,
                           "--min-height", after, "--json"))
    assert len(users["users"]) == 1
    pubkey = nodes["nodes"][0]["pubkey"]
    shown = json.loads(run("query", "node", pubkey, "--genesis", genesis, "--node", node, "--json"))
    assert shown["org_id"] == "acme" and shown["memory_mib"] == 24576 and shown["gflops"] == 80000
    assert shown["stage"] is None  # in no layer pipeline
    assert "no model node" in run("query", "node", "00" * 32, "--genesis", genesis, "--node", node, code=3)
    params = json.loads(run("query", "params", "--genesis", genesis, "--node", node, "--json"))
    assert params["max_tx_bytes"] == 16384
    witnessed = json.loads(run("query", "params", "--genesis", genesis, "--node", node, "--witness", up["rpc"][2],
                               "--max-age", "60", "--json"))
    assert witnessed == params
    committee = json.loads(run("query", "committee", "--genesis", genesis, "--node", node, "--json"))
    assert len(committee["committee"]) == 4
    unverified = json.loads(run("query", "nodes", "--no-verify", "--node", node, "--json"))
    assert not unverified["verified"] and len(unverified["nodes"]) == 1
    status = json.loads(run("query", "status", "--node", node, "--json"))
    assert status["chain_id"] == "planetserve-localnet"
    assert status["keep_heights"] == 0 and status["earliest_height"] == 1  # an archive


def test_cli_errors_are_clear(localnet, tmp_path):
    _, up, _ = localnet
    node, genesis = up["rpc"][0], up["genesis"]
    keys = tmp_path / "k.json"
    run("keys", "new", str(keys))
    out = run("tx", "heartbeat", "--keys", str(keys), "--node", node, code=4)
    assert "code 8 (UNKNOWN_ENTITY)" in out and "not registered" in out
    assert "--genesis is required" in run("query", "nodes", "--node", node, code=1)
    assert "--region needs --model" in run("query", "nodes", "--region", "eu", "--genesis", genesis,
                                           "--node", node, code=1)
    out = run("query", "nodes", "--genesis", genesis, "--node", "http://127.0.0.1:1", code=1)
    assert "127.0.0.1:1" in out
    out = run("tx", "register-org", "--org-id", "x", "--name", "y", "--keys", str(keys),
              "--node", "http://127.0.0.1:1", code=1)
    assert "could not submit" in out
    assert "MODEL_ID=NAME" in run("genesis", "init", str(tmp_path / "g"), "--model", "nonsense", code=2)
    out = run("tx", "register-model-node", "--org-id", "x", "--node-keys", str(keys), "--model-id", "gt",
              "--address", "127.0.0.1:7000", "--hardware", "cpu", "--capacity", "1", "--keys", str(keys),
              "--node", "http://127.0.0.1:1", code=1)
    assert "could not submit" in out and "nothing accepts connections there" in out
    assert "--capacity" in run("tx", "register-model-node", "--org-id", "x", "--node-keys", str(keys),
                               "--model-id", "gt", "--address", "127.0.0.1:7000", "--hardware", "cpu",
                               "--capacity", "-5", "--keys", str(keys), "--node", node, code=2)
    assert "less than one minute" in run("tx", "deploy-model", "--org-id", "x", "--model-id", "gt",
                                         "--hardware", "cpu", "--nodes", "1", "--days", "0.0001",
                                         "--keys", str(keys), "--node", node, code=2)
    out = " ".join(run("query", "status", "--node", "127.0.0.1:26657", code=2).split())
    assert "--node must be an http:// URL such as http://127.0.0.1:26657, got '127.0.0.1:26657'" in out
    (tmp_path / "empty.json").write_text("{}")
    out = run("query", "nodes", "--genesis", str(tmp_path / "empty.json"), "--node", node, code=1)
    assert "is not a usable genesis file: malformed genesis: missing chain_id" in out
    out = " ".join(run("query", "params", "--genesis", genesis, "--node", node, "--witness", node, code=1).split())
    assert f"--witness must be another endpoint than --node ({node})" in out
    out = " ".join(run("query", "params", "--genesis", genesis, "--node", node, "--max-age", "0", code=2).split())
    assert "--max-age must be a positive number of seconds (default 300)" in out
    out = " ".join(run("query", "params", "--genesis", genesis, "--node", node, "--witness", "http://127.0.0.1:1",
                       code=1).split())
    assert "witness http://127.0.0.1:1 gave no usable header" in out


def test_a_proposal_names_its_id_for_the_votes(localnet):
    root, up, _ = localnet
    member = root / "v0" / "config" / "planetserve_keys.json"
    other = json.loads(run("keys", "show", str(root / "v1" / "config" / "planetserve_keys.json"), "--json"))
    out = run("tx", "propose-member", "--action", "remove", "--operator", other["identity"],
              "--keys", str(member), "--node", up["rpc"][0])
    assert "committed propose-member" in out
    assert re.search(r"propose_member: action=remove proposal_id=\d+", out), out


def genesis_file(tmp_path: Path) -> Path:
    """A real one-validator network's genesis file."""
    return Path(json.loads(run("genesis", "init", str(tmp_path / "net"), "-n", "1", "--json"))["genesis"])


def test_node_homes_take_an_existing_key_and_are_never_overwritten(tmp_path):
    genesis = genesis_file(tmp_path)
    key = tmp_path / "k.json"
    created = json.loads(run("keys", "new", str(key), "--json"))
    user = json.loads(run("node", "init-user", "--home", str(tmp_path / "u"), "--genesis", str(genesis),
                          "--keys", str(key), "--json"))
    assert user["user"] == created["identity"]
    assert "already has a node key" in run("node", "init-user", "--home", str(tmp_path / "u"),
                                           "--genesis", str(genesis), code=1)
    node = json.loads(run("node", "init-model", "--home", str(tmp_path / "m"), "--org-id", "acme",
                          "--model-id", "gt", "--genesis", str(genesis), "--node-keys", str(key),
                          "--engine-url", "http://127.0.0.1:8001", "--kv-events", "tcp://127.0.0.1:5557",
                          "--kv-events-replay", "tcp://127.0.0.1:5558", "--prefill-chunk", "256",
                          "--kv-budget-tokens", "65536", "--json"))
    assert node["node"] == created["identity"]
    saved = json.loads((tmp_path / "m" / "node.json").read_text())
    assert (saved["kv_events"], saved["kv_events_replay"]) == ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558")
    assert (saved["prefill_chunk"], saved["kv_budget_tokens"]) == (256, 65536)
    assert "--prefill-chunk" in run("node", "init-model", "--home", str(tmp_path / "z"), "--org-id", "acme",
                                    "--model-id", "gt", "--genesis", str(genesis), "--prefill-chunk", "0", code=2)
    fresh = json.loads(run("node", "init-user", "--home", str(tmp_path / "v"), "--genesis", str(genesis),
                           "--node", "http://10.0.0.7:26657", "--witness", "http://10.0.0.8:26657/",
                           "--max-age", "120", "--json"))
    assert fresh["user"] != created["identity"]
    saved = json.loads((tmp_path / "v" / "user.json").read_text())
    assert (saved["rpc"], saved["witness"], saved["max_age"]) == ("http://10.0.0.7:26657", "http://10.0.0.8:26657", 120)
    saved = json.loads((tmp_path / "m" / "node.json").read_text())
    assert (saved["witness"], saved["max_age"]) == ("", 300)  # no witness, the light client's default bound
    (tmp_path / "bad.json").write_text("{}")
    assert "malformed key file" in run("node", "init-user", "--home", str(tmp_path / "w"), "--genesis",
                                       str(genesis), "--keys", str(tmp_path / "bad.json"), code=1)


@pytest.mark.parametrize(("args", "message"), [
    (["--rpc", "127.0.0.1:26657"], "rpc must be an http:// URL"),
    (["--peer", "nope"], "peer must be host:port"),
    (["--http", "banana"], "http must be host:port"),
    (["--advertise", "host-without-port"], "advertise must be host:port"),
])
def test_node_homes_refuse_unusable_addresses_before_writing_anything(tmp_path, args, message):
    genesis = genesis_file(tmp_path)
    for command in (["init-user"], ["init-model", "--org-id", "acme", "--model-id", "gt"]):
        home = tmp_path / command[0]
        assert message in run("node", *command, "--home", str(home), "--genesis", str(genesis), *args, code=1)
        assert not home.exists()
    (tmp_path / "empty.json").write_text("{}")
    refused = run("node", "init-user", "--home", str(tmp_path / "u"), "--genesis", str(tmp_path / "empty.json"),
                  code=1)
    assert "is not a usable genesis file: malformed genesis: missing chain_id" in refused


@pytest.mark.parametrize(("args", "code", "message"), [
    (["--witness", "10.0.0.8:26657"], 2, "--witness must be an http:// URL such as http://127.0.0.1:26657"),
    (["--witness", "http://127.0.0.1:26657"], 1,
     "witness must be another endpoint than rpc (http://127.0.0.1:26657): a witness checks rpc's answers"),
    (["--max-age", "0"], 2, "--max-age must be a positive number of seconds (default 300), well above the "
                            "chain's block interval, got 0.0"),
    (["--max-age", "inf"], 2, "--max-age must be a positive number of seconds"),
])
def test_node_homes_refuse_an_unusable_witness_or_max_age(tmp_path, args, code, message):
    genesis = genesis_file(tmp_path)
    for command in (["init-user"], ["init-model", "--org-id", "acme", "--model-id", "gt"]):
        home = tmp_path / command[0]
        out = " ".join(run("node", *command, "--home", str(home), "--genesis", str(genesis), *args, code=code).split())
        assert message in out
        assert not home.exists()


def test_genesis_init_builds_homes(tmp_path):
    out = json.loads(run("genesis", "init", str(tmp_path / "net"), "-n", "2", "--model", "gt=Reference",
                         "--chain-id", "c1", "--keep-heights", "500", "--json"))
    genesis = json.loads(Path(out["genesis"]).read_text())
    assert genesis["chain_id"] == "c1" and len(genesis["validators"]) == 2
    for v in out["validators"]:
        assert json.loads((Path(v["home"]) / "config" / "planetserve.json").read_text())["keep_heights"] == 500
    assert [m["model_id"] for m in genesis["app_state"]["models"]] == ["gt"]
    assert len(genesis["app_state"]["committee"]) == 2
    assert "already" in run("genesis", "init", str(tmp_path / "net"), "-n", "2", code=1).lower()


def test_genesis_init_keeps_database_passwords_to_the_owner(tmp_path):
    url = "postgresql+psycopg://ps:s3cret@127.0.0.1:5432/state"
    refused = CliRunner().invoke(main, ["genesis", "init", str(tmp_path / "net"), "-n", "1", "--db", url])
    assert refused.exit_code == 2 and "environment variable PLANETSERVE_DB" in refused.output  # not in argv
    assert "s3cret" not in refused.output and not (tmp_path / "net").exists()
    done = CliRunner().invoke(main, ["genesis", "init", str(tmp_path / "net"), "-n", "1", "--json"],
                              env={"PLANETSERVE_DB": url}, catch_exceptions=False)
    assert done.exit_code == 0, done.output
    printed = done.stdout
    assert "s3cret" not in printed
    assert json.loads(printed)["validators"][0]["db_url"] == "postgresql+psycopg://ps:***@127.0.0.1:5432/state"
    home = Path(json.loads(printed)["validators"][0]["home"])
    for path in (home / "config" / "planetserve.json", tmp_path / "net" / "network.json"):
        assert path.stat().st_mode & 0o777 == 0o600, path
        assert "s3cret" in path.read_text()  # the app needs it, and only the owner can read it


def test_genesis_init_with_organisations_and_sized_models(tmp_path):
    owner = "ab" * 32
    out = json.loads(run("genesis", "init", str(tmp_path / "net"), "-n", "1", "--model", "big=Big Model:80:1700",
                         "--model", "gt=Ref:v2", "--org", f"acme={owner}:500", "--org", f"zeta={owner}", "--json"))
    app_state = json.loads(Path(out["genesis"]).read_text())["app_state"]
    assert app_state["models"] == [{"model_id": "big", "name": "Big Model", "layers": 80, "layer_mib": 1700},
                                   {"model_id": "gt", "name": "Ref:v2"}]
    assert app_state["organisations"] == [
        {"org_id": "acme", "name": "acme", "owner": owner, "credits": 500 * credits.CREDIT_SECONDS},
        {"org_id": "zeta", "name": "zeta", "owner": owner, "credits": 0},
    ]
    assert parse_app_state(app_state).organisations[0].credits == 1_800_000


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--org", "acme"], "expected ORG_ID=OWNER_KEY_HEX[:CREDITS]"),
        (["--org", "acme=zz"], "64 hex characters"),
        (["--org", f"acme={'ab' * 32}:-5"], "whole number of credits"),
        (["--org", f"acme={'ab' * 32}:1e9"], "whole number of credits"),
        (["--org", f"bad id={'ab' * 32}"], "'org_id'"),
        (["--org", f"acme={'ab' * 32}", "--org", f"acme={'cd' * 32}:1"], "duplicate organisation 'acme'"),
        (["--model", "gt=G:0:10"], "'layers': model 'gt': must be an integer in 1..10000"),
        (["--model", "gt=:80:10"], "needs a name"),
    ],
)
def test_genesis_init_refuses_malformed_orgs_and_models_before_building(tmp_path, args, message):
    out = run("genesis", "init", str(tmp_path / "g"), "-n", "1", *args, code=2)
    assert message in " ".join(out.split())
    assert not (tmp_path / "g").exists()


def test_chain_start_runs_app_and_cometbft_until_terminated(tmp_path):
    """A home made by `chain init` has its app on a Unix socket in a directory of its own; holding the
    genesis validator's consensus key, it is a one-validator chain, and CometBFT makes blocks through
    that socket."""
    spec = json.loads(run("genesis", "init", str(tmp_path / "one"), "-n", "1", "--json"))
    v0 = spec["validators"][0]
    rpc_port, p2p_port = free_ports(2)
    rpc = RpcClient(f"http://127.0.0.1:{rpc_port}")
    with tempfile.TemporaryDirectory(prefix="ps-") as short:  # a socket path fits wherever pytest's paths are
        home = Path(short) / "solo"
        made = run_json("chain", "init", "--home", str(home), "--genesis", spec["genesis"], "--moniker", "solo",
                        "--peer", f"{v0['node_id']}@127.0.0.1:{v0['ports']['p2p']}", "--p2p", f"127.0.0.1:{p2p_port}",
                        "--rpc", f"127.0.0.1:{rpc_port}", "--metrics", "", "--app-metrics", "", "--local", "--json")
        socket_path = home / "abci" / "app.sock"
        assert made["abci"] == f"unix://{socket_path}"
        shutil.copy(Path(v0["home"]) / "config" / "priv_validator_key.json", home / "config")
        proc = subprocess.Popen([sys.executable, "-m", "planetserve", "chain", "start", "--home", str(home)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            height = 0
            while height < 3 and time.monotonic() < deadline:
                with contextlib.suppress(RpcError):
                    height = rpc.latest_height()
                time.sleep(0.2)
            assert height >= 3
            assert stat.S_IMODE(socket_path.stat().st_mode) == 0o600
            assert stat.S_IMODE(socket_path.parent.stat().st_mode) == 0o700
        finally:
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out.decode()
    with pytest.raises(RpcError):
        rpc.latest_height()


def test_chain_start_kills_a_child_that_ignores_sigterm(tmp_path):
    """A CometBFT that will not exit is killed once the shared deadline passes, and `start` says so."""
    spec = json.loads(run("genesis", "init", str(tmp_path / "one"), "-n", "1", "--json"))
    home = spec["validators"][0]["home"]
    pid_file = tmp_path / "stubborn.pid"
    stubborn = tmp_path / "cometbft"
    stubborn.write_text(f"#!/bin/sh\ntrap '' TERM\necho $$ > {pid_file}\nwhile :; do sleep 0.1; done\n")
    stubborn.chmod(0o755)
    proc = subprocess.Popen([sys.executable, "-m", "planetserve", "chain", "start", "--home", home,
                             "--stop-timeout", "2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PLANETSERVE_COMETBFT": str(stubborn)})
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pid_file.exists()
        time.sleep(0.3)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 1, out.decode()
    assert "cometbft did not exit within 2 s of SIGTERM and was killed" in " ".join(out.decode().split())
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)


def test_chain_app_refuses_a_home_without_config(tmp_path):
    assert "planetserve genesis init" in run("chain", "app", "--home", str(tmp_path), code=1)


def test_chain_app_refuses_to_prune_the_height_clients_verify(tmp_path):
    spec = json.loads(run("genesis", "init", str(tmp_path / "one"), "-n", "1", "--json"))
    home = spec["validators"][0]["home"]
    out = run("chain", "app", "--home", home, "--keep-heights", "1", code=2)
    assert "must be 0 (keep every height) or at least 2" in " ".join(out.split())
    config = Path(home) / "config" / "planetserve.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "keep_heights": 1}))
    out = " ".join(run("chain", "app", "--home", home, code=1).split())
    assert "cannot open the state at sqlite:///" in out
    assert ": keep_heights must be 0 (keep every height) or at least 2" in out
    for bad in ("-3", "1"):
        out = run("genesis", "init", str(tmp_path / "two"), "--keep-heights", bad, code=2)
        assert f"must be 0 (keep every height) or at least 2 (clients verify the state one height before the " \
               f"latest), got {bad}" in " ".join(out.split())
    assert not (tmp_path / "two").exists()
