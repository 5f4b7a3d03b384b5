"""Planetserve's roles as their own processes for tests, started through the CLI as an operator would:
model nodes, user relays, an organisation's network with its node, and the localnet command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import httpx
from chainnet import ledger, start_network
from openai import APIStatusError

from planetserve.chain.client import LedgerClient
from planetserve.chain.keys import KeySet
from planetserve.chain.messages import RegisterOrg
from planetserve.genesis.network import free_ports
from planetserve.localnet.cluster import Cluster
from planetserve.node.home import ModelNodeConfig, UserConfig
from planetserve.registry.params import Params

T = TypeVar("T")


def planetserve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "planetserve", *args], capture_output=True, text=True,
                          timeout=timeout)


def localnet(*args: str, timeout: float = 300) -> dict:
    """`planetserve localnet ARGS` succeeded; its JSON answer."""
    done = planetserve("localnet", *args, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


def quick_config(tmp_path: Path, family: Path) -> Path:
    """The default composition, on the quick model family, faster blocks and four relays."""
    config = tmp_path / "localnet.toml"
    config.write_text(f"""
[network]
timeout_commit = "500ms"
[models]
preset = "quick"
data_dir = "{family}"
[relays]
count = 4
proxies = 4
""")
    return config


def init_home(home: Path, net, data: Path) -> None:
    http, peer = free_ports(2)
    done = planetserve("node", "init-model", "--home", str(home), "--org-id", "acme", "--model-id", "gt",
                       "--genesis", str(net.spec.genesis_path), "--rpc", net.rpc_url(0), "--data-dir", str(data),
                       "--http", f"127.0.0.1:{http}", "--peer", f"127.0.0.1:{peer}",
                       "--capacity", "2", "--json")
    assert done.returncode == 0, done.stderr
    config = ModelNodeConfig.load(home)
    config.list_interval = 1.0
    config.delta_interval = 0.05
    config.load_interval = 0.2
    config.max_prompt_tokens = 400
    config.save(home)


class RoleProcess:
    """A `planetserve ARGS --json` role process that prints one JSON ready line once it serves. Its log
    goes to `log`: a pipe nobody reads while the process runs would fill and stall it."""

    def __init__(self, what: str, log: Path, *args: str) -> None:
        self.what = what
        self.log = log
        with log.open("a") as err:  # the process keeps its own descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "planetserve", *args, "--json", "--log-level", "warning"],
                stdout=subprocess.PIPE, stderr=err, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def log_tail(self) -> str:
        return self.log.read_text()[-2000:]

    def wait_ready(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"{self.what} did not start: {self.log_tail()}")
        self.ready = json.loads(line)
        self.url = self.ready["http"]
        return self.ready

    def status(self) -> dict:
        return httpx.get(f"{self.url}/v1/planetserve/status", timeout=10).json()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


class NodeProcess(RoleProcess):
    """A `planetserve node model` process; with `wait` False, `wait_ready` reads its ready line later
    (a pipeline stage prints it only once a deployment assigned it layers)."""

    def __init__(self, home: Path, org_keys: Path | None, *, wait: bool = True) -> None:
        super().__init__("model node", home / "node.log", "node", "model", "--home", str(home),
                         *(["--org-keys", str(org_keys)] if org_keys is not None else []))
        if wait:
            self.wait_ready()

    def complete(self, prompt: str, **extra: object) -> dict:
        r = httpx.post(f"{self.url}/v1/completions", timeout=120,
                       json={"model": "gt", "prompt": prompt, "max_tokens": 8, "temperature": 0, **extra})
        assert r.status_code == 200, r.text
        return r.json()


def init_user(home: Path, net) -> None:
    http, peer = free_ports(2)
    done = planetserve("node", "init-user", "--home", str(home), "--genesis", str(net.spec.genesis_path),
                       "--rpc", net.rpc_url(0), "--http", f"127.0.0.1:{http}",
                       "--peer", f"127.0.0.1:{peer}", "--proxies", "4", "--json")
    assert done.returncode == 0, done.stderr
    config = UserConfig.load(home)
    config.list_interval = 1.0
    config.ping_interval = 2.0
    config.save(home)


class RelayProcess(RoleProcess):
    """A `planetserve node user` process (a user relay)."""

    def __init__(self, home: Path) -> None:
        super().__init__("user relay", home / "relay.log", "node", "user", "--home", str(home))


def acme_node(tmp_path: Path, net, data: Path) -> NodeProcess:
    """Organisation acme registered, and its model node (quick gt) running and registered by it."""
    owner = KeySet.generate()
    owner.save(tmp_path / "acme.json")
    assert ledger(net).submit(owner, RegisterOrg("acme", "ACME")).outcome.ok
    init_home(tmp_path / "mn", net, data)
    return NodeProcess(tmp_path / "mn", tmp_path / "acme.json")


@contextmanager
def acme_network(tmp_path: Path, data: Path, params: Params | None = None
                 ) -> Iterator[tuple[Cluster, LedgerClient, NodeProcess, list[RelayProcess]]]:
    """A four-validator network (of genesis `params`, if given) with acme's model node (`acme_node`):
    (network, ledger client, node, relays). Relays the caller adds to the list are stopped with the
    rest, whatever happens."""
    net = start_network(tmp_path / "net", params=params)
    relays: list[RelayProcess] = []
    node = None
    try:
        node = acme_node(tmp_path, net, data)
        yield net, ledger(net), node, relays
    finally:
        for relay in relays:
            relay.stop()
        if node is not None:
            node.stop()
        net.close()


def relay_retried(call: Callable[[], T], context: Callable[[], str] = lambda: "") -> tuple[T, int]:
    """`call()` through a relay, its 502 and 503 answers (documented as worth a retry: a proxy whose
    registration the model node has not read yet, a path that just broke) retried twice, as a client
    would: the answer and the number of calls made. Any other error, or a third one, fails with what
    came back and `context()`."""
    errors = []
    for attempt in range(1, 4):
        try:
            return call(), attempt
        except APIStatusError as exc:
            errors.append(f"{exc.status_code}: {exc.body}")
            if exc.status_code not in (502, 503):
                break
            time.sleep(2)
    raise AssertionError(f"no answer: {errors}; {context()}")


def start_relays(tmp_path: Path, net, count: int, name: str = "user") -> list[RelayProcess]:
    """`count` user relay processes with homes under tmp_path, registered on the ledger and ready (or
    all stopped again)."""
    homes = [tmp_path / f"{name}{i}" for i in range(count)]
    for home in homes:
        init_user(home, net)
    relays = [RelayProcess(home) for home in homes]
    try:
        for relay in relays:
            relay.wait_ready()
    except BaseException:
        for relay in relays:
            relay.stop()
        raise
    return relays
