"""User relays as their own processes (`planetserve node user`) on a real four-validator network with a
model node process: they register themselves, build onion paths to each other over TLS between
processes, and the OpenAI client library talks to a relay's endpoint as to any OpenAI server."""

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
import pytest
from chainnet import ledger, start_network
from modelnodes import free_port, signed
from openai import APIStatusError, OpenAI
from test_model_node_network import NodeProcess, init_home, planetserve, wait_until

from planetserve.chain.client import LedgerClient
from planetserve.chain.keys import KeySet
from planetserve.localnet.cluster import Cluster
from planetserve.node.home import UserConfig

pytestmark = pytest.mark.network

RELAYS = 5
T = TypeVar("T")


class RelayProcess:
    def __init__(self, home: Path) -> None:
        self.home = home
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "planetserve", "node", "user", "--home", str(home), "--json",
             "--log-level", "warning"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def wait_ready(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"user relay did not start: {self.proc.stderr.read()[-2000:]}")
        self.ready = json.loads(line)
        return self.ready

    def status(self) -> dict:
        return httpx.get(f"{self.ready['http']}/v1/planetserve/status", timeout=10).json()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def init_user(home: Path, net) -> None:
    done = planetserve("node", "init-user", "--home", str(home), "--genesis", str(net.spec.genesis_path),
                       "--rpc", net.rpc_url(0), "--http", f"127.0.0.1:{free_port()}",
                       "--peer", f"127.0.0.1:{free_port()}", "--proxies", "4", "--json")
    assert done.returncode == 0, done.stderr
    config = UserConfig.load(home)
    config.list_interval = 1.0
    config.ping_interval = 2.0
    config.save(home)


def acme_node(tmp_path: Path, net, data: Path) -> NodeProcess:
    """Organisation acme registered, and its model node (quick gt) running and registered by it."""
    owner = KeySet.generate()
    owner.save(tmp_path / "acme.json")
    assert ledger(net).submit(owner, "register-org", {"org_id": "acme", "name": "ACME"}).outcome.ok
    init_home(tmp_path / "mn", net, data)
    return NodeProcess(tmp_path / "mn", tmp_path / "acme.json")


@contextmanager
def acme_network(tmp_path: Path, data: Path) -> Iterator[tuple[Cluster, LedgerClient, NodeProcess,
                                                                 list[RelayProcess]]]:
    """A four-validator network with acme's model node (`acme_node`): (network, ledger client, node,
    relays). Relays the caller adds to the list are stopped with the rest, whatever happens."""
    net = start_network(tmp_path / "net")
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


def relay_retried(call: Callable[[], T], context: Callable[[], str] = lambda: "") -> T:
    """`call()` through a relay, its 502 and 503 answers (documented as worth a retry: a proxy whose
    registration the model node has not read yet, a path that just broke) retried twice, as a client
    would; any other error, or a third one, fails with what came back and `context()`."""
    errors = []
    for _ in range(3):
        try:
            return call()
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


def test_an_openai_client_chats_through_user_relays_on_the_ledger(tmp_path, quick_family):
    with acme_network(tmp_path, quick_family) as (net, client, node, relays):
        homes = [tmp_path / f"user{i}" for i in range(RELAYS)]
        for home in homes:
            init_user(home, net)
        bad = planetserve("node", "init-user", "--home", str(tmp_path / "x"), "--genesis",
                          str(net.spec.genesis_path), "--proxies", "2")
        assert bad.returncode != 0 and "--proxies >= --n >= --k" in bad.stderr
        relays.extend(RelayProcess(home) for home in homes)
        ready = [relay.wait_ready() for relay in relays]
        assert {r["registration"] for r in ready} == {"registered"}
        listing, users = client.users()
        assert listing.verified and {u.pubkey.hex() for u in users} == {r["user"] for r in ready}

        me = relays[0]
        wait_until(lambda: len(me.status()["paths"]) >= 4, timeout=60)
        openai = OpenAI(base_url=f"{me.ready['http']}/v1", api_key="not-needed", max_retries=0)
        assert [m.id for m in openai.models.list().data] == ["gt"]
        answer = relay_retried(lambda: openai.chat.completions.create(
            model="gt", messages=[{"role": "user", "content": "What does the json module do?"}],
            max_tokens=8, temperature=0), lambda: f"relay {me.status()}; node {node.status()}")
        text = answer.choices[0].message.content
        assert text and answer.usage.completion_tokens > 0
        response = signed(answer.model_dump())
        assert response.node.hex() == node.ready["node"]
        stream = openai.chat.completions.create(
            model="gt", messages=[{"role": "user", "content": "What does the json module do?"}],
            max_tokens=8, temperature=0, stream=True)
        assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == text

        # the paths ran through the other relay processes
        assert sum(r.status()["relay_counters"]["setups"] for r in relays[1:]) >= 3 * 4
        assert node.status()["overlay"]["prompts"] == 2

        # a restarted relay renews its registration and is back in service
        relays[1].stop()
        relays[1] = RelayProcess(homes[1])
        assert relays[1].wait_ready()["registration"] == "renewed"
        wait_until(lambda: len(me.status()["paths"]) >= 4, timeout=60)
        again = openai.completions.create(model="gt", prompt="The os module", max_tokens=4,
                                          extra_body={"ignore_eos": True})
        assert again.choices[0].finish_reason == "length" and again.usage.completion_tokens == 4
