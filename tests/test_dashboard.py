"""`planetserve dashboard` with nothing behind it: the real server, started by its command, whose RPC
endpoints and relay are addresses where nothing listens. Every source's failure must show as an
error field of /api/state (never a crash), the page and its assets come from the package, and
/api/chat refuses what it must with specific errors. (tests/test_localnet.py checks the dashboard of
a running localnet, in a browser.)"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from planetserve.chain.keys import KeySet
from planetserve.chain.lightclient import DEFAULT_MAX_AGE
from planetserve.cli import main
from planetserve.dashboard.collect import Collector, Settings, _phase
from planetserve.dashboard.server import MAX_CHAT_BODY, MAX_PROMPT_CHARS, ChatError, Dashboard
from planetserve.genesis.network import free_ports
from planetserve.registry.epochs import Schedule

SVG_NAMESPACE = "http://www.w3.org/2000/svg"


def write_genesis(path: Path) -> Path:
    """A genesis file with one validator: enough to be a trust root (no chain runs on it)."""
    key = KeySet.generate().public
    path.write_text(json.dumps({
        "chain_id": "dashboard-test", "genesis_time": "2025-01-01T00:00:00Z", "initial_height": "1",
        "validators": [{"pub_key": {"type": "tendermint/PubKeyEd25519", "value": base64.b64encode(key).decode()},
                        "power": "10", "name": "v0"}],
    }))
    return path


def start_dashboard(log: Path, *args: str, timeout: float = 60.0) -> tuple[subprocess.Popen, dict]:
    """`planetserve dashboard ... --http 127.0.0.1:0 --json` and its ready line; its log goes to `log`."""
    with log.open("a") as err:
        proc = subprocess.Popen([sys.executable, "-m", "planetserve", "dashboard", *args, "--http",
                                 "127.0.0.1:0", "--json"], stdout=subprocess.PIPE, stderr=err, text=True,
                                start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if line:
                return proc, json.loads(line)
        if proc.poll() is not None:
            break
    proc.kill()
    proc.wait()
    proc.stdout.close()
    raise AssertionError(f"the dashboard did not start: {log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def nowhere(tmp_path_factory):
    """A dashboard whose two RPC endpoints and relay are closed ports."""
    home = tmp_path_factory.mktemp("dashboard")
    genesis = write_genesis(home / "genesis.json")
    rpc_a, rpc_b, relay = free_ports(3)
    proc, ready = start_dashboard(home / "dashboard.log", "--genesis", str(genesis), "--rpc", f"http://127.0.0.1:{rpc_a}",
                                  "--rpc", f"http://127.0.0.1:{rpc_b}", "--relay", f"http://127.0.0.1:{relay}/v1")
    yield ready
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=15) == 0  # stops cleanly on SIGTERM
    proc.stdout.close()


def test_ready_line(nowhere):
    assert re.fullmatch(r"http://127\.0\.0\.1:[0-9]+/", nowhere["url"])
    assert len(nowhere["rpc"]) == 2 and nowhere["relay"].startswith("http://127.0.0.1:")
    assert not nowhere["relay"].endswith("/v1")  # the endpoint's base, given with or without /v1


def test_the_page_and_its_assets_come_from_the_package(nowhere):
    url = nowhere["url"]
    page = httpx.get(url)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    for asset, kind in (("app.js", "text/javascript"), ("style.css", "text/css")):
        assert f"/static/{asset}" in page.text
        reply = httpx.get(f"{url}static/{asset}")
        assert reply.status_code == 200 and reply.headers["content-type"].startswith(kind)
        # nothing is fetched from anywhere else (the SVG namespace is a name, not a fetch)
        assert not re.search(r"https?://", reply.text.replace(SVG_NAMESPACE, "")), asset
    assert not re.search(r"https?://", page.text)
    assert httpx.get(f"{url}static/index.html").status_code == 404
    assert httpx.get(f"{url}static/..%2Fserver.py").status_code == 404
    assert httpx.get(f"{url}api/health").json() == {"ok": True}


def test_state_shows_every_failed_source_as_an_error(nowhere):
    async def twice() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            return list(await asyncio.gather(*(client.get(f"{nowhere['url']}api/state") for _ in range(2))))

    reply, again = asyncio.run(twice())
    assert reply.status_code == 200 and again.status_code == 200
    state = reply.json()
    assert {"time", "chain_id", "validators", "validators_agree", "ledger", "epoch", "nodes", "organisations",
            "overlay", "chat", "took_ms"} <= set(state)
    assert state["chain_id"] is None and state["validators_agree"] is None
    assert [v["rpc"] for v in state["validators"]] == nowhere["rpc"]
    for v in state["validators"]:
        assert v["height"] is None and v["app_hash"] is None and "nothing accepts connections there" in v["error"]
    assert state["ledger"]["verified"] is False and state["ledger"]["height"] is None
    assert state["ledger"]["error"].startswith("no RPC endpoint gave a verified answer: ")
    assert all(url in state["ledger"]["error"] for url in nowhere["rpc"])
    assert state["epoch"]["error"] == state["ledger"]["error"]
    assert state["nodes"]["items"] == [] and state["nodes"]["history"] == [] and state["nodes"]["error"]
    assert state["organisations"] == {"error": state["ledger"]["error"], "items": []}
    overlay = state["overlay"]
    assert overlay["relay"] == nowhere["relay"] and "ConnectError" in overlay["error"]
    assert overlay["live_paths"] is None and overlay["delivery_rate"] is None and overlay["paths"] == []
    assert set(state["chat"]) == {"chats", "answered", "failed"}
    # polled at the same time: one snapshot for both (collections are shared, at most one a second)
    assert again.json()["time"] == state["time"]


@pytest.mark.parametrize(("body", "status", "code"), [
    ({"prompt": ""}, 400, "empty_prompt"),
    ({"prompt": "  \n "}, 400, "empty_prompt"),
    ({}, 400, "empty_prompt"),
    ({"prompt": 7}, 400, "empty_prompt"),
    ({"prompt": "x" * (MAX_PROMPT_CHARS + 1)}, 413, "prompt_too_long"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "invalid_max_tokens"),
    ({"prompt": "hi", "max_tokens": True}, 400, "invalid_max_tokens"),
    ({"prompt": "hi", "model": ""}, 400, "invalid_model"),
    (["hi"], 400, "invalid_json"),
    ({"prompt": "hi"}, 502, "relay_unreachable"),  # asks the relay which model first
    ({"prompt": "hi", "model": "gt"}, 502, "relay_unreachable"),
])
def test_chat_refusals(nowhere, body, status, code):
    reply = httpx.post(f"{nowhere['url']}api/chat", json=body, timeout=30)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["code"] == code and error["message"]


def test_chat_refuses_what_is_not_json_or_too_large(nowhere):
    url = f"{nowhere['url']}api/chat"
    reply = httpx.post(url, content=b"{not json")
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_json"
    reply = httpx.post(url, content=json.dumps({"prompt": "x" * MAX_CHAT_BODY}).encode())
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "too_large"
    assert httpx.get(f"{nowhere['url']}api/state").json()["chat"]["failed"] >= 1


def test_without_a_relay_the_chat_says_how_to_get_one(tmp_path):
    async def ask() -> ChatError:
        dashboard = Dashboard(Settings(genesis=write_genesis(tmp_path / "g.json"), rpc=("http://127.0.0.1:9",)))
        try:
            with pytest.raises(ChatError) as caught:
                await dashboard.chat("hello", 8)
            overlay = dashboard.collector.overlay()
        finally:
            await dashboard.close()
        assert "--relay" in overlay["error"]
        return caught.value

    error = asyncio.run(ask())
    assert (error.status, error.code) == (503, "no_relay") and "--relay" in error.message


def test_refused_arguments(tmp_path):
    genesis = write_genesis(tmp_path / "genesis.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    base = ["dashboard", "--genesis", str(genesis), "--rpc", "http://127.0.0.1:26657"]
    for args, message in [
        (["--label", "abc=x"], "takes KEY=NAME"),
        (["--http", "8600"], "takes HOST:PORT"),
        (["--relay", "127.0.0.1:8080"], "--relay must be an http:// URL"),
        (["--rpc", "tcp://127.0.0.1:1"], "--rpc must be an http:// URL"),
        (["--max-age", "-1"], "--max-age must be a positive number of seconds"),
    ]:
        result = CliRunner().invoke(main, base + args)
        assert result.exit_code == 2 and message in result.output, result.output
    result = CliRunner().invoke(main, ["dashboard", "--genesis", str(bad), "--rpc", "http://127.0.0.1:1"])
    assert result.exit_code == 1 and "not a usable genesis file" in result.output
    result = CliRunner().invoke(main, ["dashboard", "--help"])
    assert result.exit_code == 0 and "/api/state" in result.output


def test_ledger_reads_take_the_freshness_bound(tmp_path):
    settings = Settings(genesis=write_genesis(tmp_path / "g.json"), rpc=("http://127.0.0.1:9",), max_age=42.0)
    assert Collector(settings)._ledger("http://127.0.0.1:9").verifier.max_age == 42.0
    assert Settings(genesis=settings.genesis, rpc=settings.rpc).max_age == DEFAULT_MAX_AGE


def test_epoch_phases_follow_the_schedule():
    schedule = Schedule(epoch_blocks=40, results_blocks=16, vrf_window_blocks=10, plan_window_blocks=14)
    assert _phase(schedule, 1) == ("results", ["results"])          # offset 0
    assert _phase(schedule, 16) == ("results", ["results"])         # offset 15
    assert _phase(schedule, 17) == ("attest", [])
    assert _phase(schedule, 27) == ("plan", ["plan"])               # offset 26: the last 14 blocks
    assert _phase(schedule, 31) == ("election", ["plan", "vrf"])    # offset 30: the last 10
    assert _phase(schedule, 40) == ("election", ["plan", "vrf"])
    assert _phase(schedule, 41) == ("results", ["results"])
