"""Model nodes as their own processes (`planetserve node model`) on a real four-validator network:
they register through their organisation, form their group from the verified node list, forward to
the holder of a prefix, sign with the registered key, and drop a delisted member."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from chainnet import ledger, start_network
from modelnodes import SHARED, free_port, signed

from planetserve.chain.keys import KeySet
from planetserve.node.home import ModelNodeConfig

pytestmark = pytest.mark.network


def planetserve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "planetserve", *args], capture_output=True, text=True,
                          timeout=timeout)


def init_home(home: Path, net, data: Path) -> None:
    done = planetserve("node", "init-model", "--home", str(home), "--org-id", "acme", "--model-id", "gt",
                       "--genesis", str(net.spec.genesis_path), "--rpc", net.rpc_url(0), "--data-dir", str(data),
                       "--http", f"127.0.0.1:{free_port()}", "--peer", f"127.0.0.1:{free_port()}",
                       "--capacity", "2", "--json")
    assert done.returncode == 0, done.stderr
    config = ModelNodeConfig.load(home)
    config.list_interval = 1.0
    config.delta_interval = 0.05
    config.load_interval = 0.2
    config.max_prompt_tokens = 400
    config.save(home)


class NodeProcess:
    """A `planetserve node model` process; with `wait` False, `wait_ready` reads its ready line later
    (a pipeline stage prints it only once a deployment assigned it layers)."""

    def __init__(self, home: Path, org_keys: Path | None, *, wait: bool = True) -> None:
        args = [sys.executable, "-m", "planetserve", "node", "model", "--home", str(home), "--json",
                "--log-level", "warning"]
        if org_keys is not None:
            args += ["--org-keys", str(org_keys)]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        if wait:
            self.wait_ready()

    def wait_ready(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"model node did not start: {self.proc.stderr.read()[-2000:]}")
        self.ready = json.loads(line)
        self.url = self.ready["http"]
        return self.ready

    def status(self) -> dict:
        return httpx.get(f"{self.url}/v1/planetserve/status", timeout=10).json()

    def complete(self, prompt: str, **extra: object) -> dict:
        r = httpx.post(f"{self.url}/v1/completions", timeout=120,
                       json={"model": "gt", "prompt": prompt, "max_tokens": 8, "temperature": 0, **extra})
        assert r.status_code == 200, r.text
        return r.json()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def wait_until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.2)


def test_model_nodes_register_group_forward_and_sign(tmp_path, quick_family):
    net = start_network(tmp_path / "net")
    nodes: list[NodeProcess] = []
    try:
        client = ledger(net)
        owner = KeySet.generate()
        owner_path = tmp_path / "acme.json"
        owner.save(owner_path)
        assert client.submit(owner, "register-org", {"org_id": "acme", "name": "ACME"}).outcome.ok
        homes = [tmp_path / f"mn{i}" for i in range(3)]
        for home in homes:
            init_home(home, net, quick_family)

        # without the organisation's key an unregistered node explains how to register
        refused = planetserve("node", "model", "--home", str(homes[2]))
        assert refused.returncode == 1 and "is not registered" in refused.stderr
        assert "register-model-node" in refused.stderr

        nodes = [NodeProcess(home, owner_path) for home in homes[:2]]
        assert [n.ready["registration"] for n in nodes] == ["registered", "registered"]
        keys = [n.ready["node"] for n in nodes]
        listing, listed = client.nodes("gt")
        assert listing.verified and {n.pubkey.hex() for n in listed} == set(keys)
        wait_until(lambda: all(set(n.status()["group"]) == set(keys) for n in nodes))

        # a restart finds its registration in place
        nodes[1].stop()
        nodes[1] = NodeProcess(homes[1], None)
        assert nodes[1].ready["registration"] == "existing"

        first = signed(nodes[0].complete(SHARED + "What is a tuple?", planetserve={"no_forward": True}))
        assert first.node.hex() == keys[0]
        registered = client.node(first.node)
        assert registered is not None and registered.address == first.address  # the registered key signed

        wait_until(lambda: nodes[1].status()["tree_size"] > 0)
        answer = nodes[1].complete(SHARED + "What is a set?")
        assert signed(answer).node.hex() == keys[1]  # the entry node answers for what node 0 computed
        assert answer["planetserve"]["served_by"] == keys[0] and answer["planetserve"]["route"] == "hit"
        assert nodes[1].status()["routes"].get("hit") == 1

        # the organisation delists node 0: node 1 drops it from its group and stops forwarding to it
        done = client.submit(owner, "update-model-node", {"node_pubkey": bytes.fromhex(keys[0]),
                                                          "status": "inactive"})
        assert done.outcome.ok, done.outcome.log
        wait_until(lambda: nodes[1].status()["group"] == [keys[1]])
        again = nodes[1].complete(SHARED + "What is a frozenset?")
        assert signed(again).node.hex() == keys[1]
    finally:
        for node in nodes:
            node.stop()
        net.close()
