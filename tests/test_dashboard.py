"""`planetserve dashboard` with nothing behind it: the real server, started by its command, whose RPC
endpoints and relay are addresses where nothing listens. Every source's failure must show as an
error field of /api/state (never a crash), the page and its assets come from the package, and
/api/chat refuses what it must with specific errors. With a stand-in relay that answers, other sites'
pages and rebinding pages are refused before any prompt leaves, over HTTP and in a browser, while the
dashboard's own page chats. (tests/test_localnet.py checks the dashboard of a running localnet, in a
browser.)"""

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
from aiohttp import web
from chromium import CHROMIUM, require_browser
from click.testing import CliRunner
from crosssite import allowed, attacks, check_refusal, post
from relaystandin import FakeRelayAnswers

from planetserve.chain.challenge import response_extension, sign_response
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
    assert nowhere["witness"] is None
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
    """A request refused before it is sent counts as no chat; one the relay failed counts as failed."""
    state = f"{nowhere['url']}api/state"
    before = httpx.get(state, timeout=30).json()["chat"]
    reply = httpx.post(f"{nowhere['url']}api/chat", json=body, timeout=30)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["code"] == code and error["message"]
    sent = int(status == 502)
    assert httpx.get(state, timeout=30).json()["chat"] == {
        "chats": before["chats"] + sent, "answered": before["answered"], "failed": before["failed"] + sent}


def test_chat_refuses_what_is_not_json_or_too_large(nowhere):
    url = f"{nowhere['url']}api/chat"
    before = httpx.get(f"{nowhere['url']}api/state").json()["chat"]
    as_json = {"Content-Type": "application/json"}
    for garbage in (b"{not json", b"[" * 5_000 + b"]" * 5_000):
        reply = httpx.post(url, content=garbage, headers=as_json)
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_json"
    reply = httpx.post(url, content=json.dumps({"prompt": "x" * MAX_CHAT_BODY}).encode(), headers=as_json)
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "too_large"
    reply = httpx.post(url, content=json.dumps({"prompt": "hi"}).encode())  # JSON, but not said to be
    assert reply.status_code == 415 and reply.json()["error"]["code"] == "unsupported_media_type"
    assert httpx.get(f"{nowhere['url']}api/state").json()["chat"] == before  # refused before any chat


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
        (["--witness", "127.0.0.1:26667"], "--witness must be an http:// URL"),
    ]:
        result = CliRunner().invoke(main, base + args)
        assert result.exit_code == 2 and message in result.output, result.output
    result = CliRunner().invoke(main, ["dashboard", "--genesis", str(bad), "--rpc", "http://127.0.0.1:1"])
    assert result.exit_code == 1 and "not a usable genesis file" in result.output
    result = CliRunner().invoke(main, base + ["--witness", "http://127.0.0.1:26657/"])
    assert result.exit_code == 1 and "--witness must be another endpoint than every --rpc" in result.output
    result = CliRunner().invoke(main, ["dashboard", "--help"])
    assert result.exit_code == 0 and "/api/state" in result.output


def test_ledger_reads_take_the_freshness_bound_and_the_witness(tmp_path):
    settings = Settings(genesis=write_genesis(tmp_path / "g.json"), rpc=("http://127.0.0.1:9",), max_age=42.0,
                        witness="http://127.0.0.1:10")
    verifier = Collector(settings)._ledger("http://127.0.0.1:9").verifier
    assert verifier.max_age == 42.0 and verifier.witness.url == "http://127.0.0.1:10"
    assert Settings(genesis=settings.genesis, rpc=settings.rpc).max_age == DEFAULT_MAX_AGE
    assert Collector(Settings(genesis=settings.genesis, rpc=settings.rpc))._ledger(settings.rpc[0]).verifier.witness \
        is None


def test_epoch_phases_follow_the_schedule():
    schedule = Schedule(epoch_blocks=40, results_blocks=16, vrf_window_blocks=10, plan_window_blocks=14)
    assert _phase(schedule, 1) == ("results", ["results"])          # offset 0
    assert _phase(schedule, 16) == ("results", ["results"])         # offset 15
    assert _phase(schedule, 17) == ("attest", [])
    assert _phase(schedule, 27) == ("plan", ["plan"])               # offset 26: the last 14 blocks
    assert _phase(schedule, 31) == ("election", ["plan", "vrf"])    # offset 30: the last 10
    assert _phase(schedule, 40) == ("election", ["plan", "vrf"])
    assert _phase(schedule, 41) == ("results", ["results"])


# -- other sites' pages ---------------------------------------------------------------------------------

ANSWER = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "It runs programs."},
                       "finish_reason": "stop"}]}
CHAT_ERROR = {"message", "code"}


@pytest.fixture(scope="module")
def answering(tmp_path_factory):
    """A dashboard whose relay is a stand-in that answers every chat and records what reached it."""
    relay = FakeRelayAnswers()
    relay.body = ANSWER
    home = tmp_path_factory.mktemp("dashboard-relay")
    genesis = write_genesis(home / "genesis.json")
    (rpc,) = free_ports(1)
    proc, ready = start_dashboard(home / "dashboard.log", "--genesis", str(genesis), "--rpc",
                                  f"http://127.0.0.1:{rpc}", "--relay", relay.url, "--model", "gt")
    yield ready["url"].rstrip("/"), relay
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=15) == 0
    proc.stdout.close()
    relay.close()


def chats(url: str) -> dict[str, int]:
    return httpx.get(f"{url}/api/state", timeout=30).json()["chat"]


@pytest.mark.parametrize(("body", "said"), [
    (b"[" * 5_000 + b"]" * 5_000, "with something that is not JSON"),
    (b"[" + b"[]," * 100_000 + b"[]]", "more than an answer needs"),
], ids=["deep", "wide"])
def test_an_answer_built_to_exhaust_the_dashboard_is_a_clear_error(answering, body, said):
    """A model node's answer reaches the dashboard through the relay as the node wrote it: nested past the
    interpreter's recursion limit it was an internal error, and wide it built one object per byte."""
    url, relay = answering
    relay.body = body
    try:
        reply = httpx.post(f"{url}/api/chat", json={"prompt": "What does os do?"}, timeout=30)
    finally:
        relay.body = ANSWER
    assert reply.status_code == 502 and reply.json()["error"]["code"] == "bad_answer"
    assert said in reply.json()["error"]["message"]
    again = httpx.post(f"{url}/api/chat", json={"prompt": "What does os do?"}, timeout=30)
    assert again.status_code == 200 and again.json()["answer"] == "It runs programs."


def test_an_answer_signed_with_a_time_nothing_can_pack_is_shown_as_unsigned(answering):
    """A node's signed time of 10^30 raised from the signature check (msgpack packs no such integer): the
    page got an internal error. Such an answer is shown as it is, its signature not valid."""
    url, relay = answering
    node = KeySet.generate()
    signed = sign_response(node, "x", [5], "It runs programs.", "gt", 1, "h:1", 0, 0)
    relay.body = {**ANSWER, "planetserve": {**response_extension(signed), "time": 10**30}}
    try:
        reply = httpx.post(f"{url}/api/chat", json={"prompt": "What does os do?"}, timeout=30)
    finally:
        relay.body = ANSWER
    assert reply.status_code == 200, reply.text
    assert reply.json()["answer"] == "It runs programs." and reply.json()["signature_valid"] is False


def test_other_sites_pages_send_no_prompt_and_rebinding_pages_read_nothing(answering):
    """Every request a web page can make the user's browser send (another site's fetch or form, a page
    re-pointing its DNS name at 127.0.0.1, a simple-request body) is refused with a specific error
    before a prompt leaves; programs and the dashboard's own page still chat."""
    url, relay = answering
    sent, counted = len(relay.received), chats(url)
    with httpx.Client(timeout=30) as client:
        for attack in attacks(url):
            check_refusal(post(client, f"{url}/api/chat", {"prompt": "What does os do?"}, attack), attack,
                          CHAT_ERROR)
            if attack.reads:
                for path in ("/api/state", "/", "/static/app.js", "/api/health"):
                    check_refusal(client.get(f"{url}{path}", headers=attack.headers), attack, CHAT_ERROR)
        assert len(relay.received) == sent and chats(url) == counted  # no prompt left, none was counted
        for name, headers in allowed(url):
            reply = client.post(f"{url}/api/chat", json={"prompt": "What does os do?"}, headers=headers)
            assert reply.status_code == 200 and reply.json()["answer"] == "It runs programs.", (name, reply.text)
            assert client.get(f"{url}/api/state", headers=headers).status_code == 200, name
        # a link another site's page shows the user may still be followed (the page reads nothing)
        followed = client.get(f"{url}/", headers={"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate",
                                                  "Sec-Fetch-Dest": "document"})
        assert followed.status_code == 200 and followed.headers["content-type"].startswith("text/html")
    assert len(relay.received) == sent + len(allowed(url))
    assert [r["messages"][0]["content"] for r in relay.received[sent:]] == ["What does os do?"] * len(allowed(url))


ATTACK_PAGE = """<!doctype html><title>a page on another site</title>
<form id="form" method="POST" action="TARGET/api/chat" enctype="text/plain" target="sink">
<input name='{"prompt": "from a form", "x": "' value='"}'></form>
<iframe name="sink"></iframe>
<script>
async function attack() {
  const seen = {};
  const chat = "TARGET/api/chat";
  const body = JSON.stringify({prompt: "from another site"});
  try {
    await fetch(chat, {method: "POST", mode: "no-cors", headers: {"Content-Type": "application/json"}, body});
    seen.no_cors = "sent";
  } catch (e) { seen.no_cors = String(e); }
  try {
    const reply = await fetch(chat, {method: "POST", headers: {"Content-Type": "application/json"}, body});
    seen.cors = reply.status;
  } catch (e) { seen.cors = "refused: " + e; }
  try { seen.state = (await fetch("TARGET/api/state")).status; } catch (e) { seen.state = "refused: " + e; }
  document.getElementById("form").submit();
  return seen;
}
</script>"""


def serve_page(html: str) -> tuple[web.AppRunner, int, asyncio.AbstractEventLoop]:
    """`html` at / of a real server on a free loopback port, on a loop of its own thread."""
    import threading

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    async def page(_: web.Request) -> web.Response:
        return web.Response(text=html, content_type="text/html")

    async def start() -> tuple[web.AppRunner, int]:
        app = web.Application()
        app.router.add_get("/", page)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner, runner.addresses[0][1]

    runner, port = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    return runner, port, loop


def test_in_a_browser_the_dashboard_chats_and_other_sites_pages_cannot(answering):
    """Headless chromium, with attacker.test and rebind.test resolving to 127.0.0.1: the dashboard's own
    page sends a prompt and shows the answer; a page of attacker.test posts a form, a no-cors fetch and a
    CORS fetch to /api/chat and none reaches the relay; the dashboard opened under rebind.test (a page
    whose DNS name now points here) is refused, and so are its requests."""
    require_browser()
    from playwright.sync_api import expect, sync_playwright

    url, relay = answering
    port = int(url.rsplit(":", 1)[1])
    runner, attacker_port, loop = serve_page(ATTACK_PAGE.replace("TARGET", url))
    statuses: list[tuple[str, str, int]] = []
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=[
                "--host-resolver-rules=MAP attacker.test 127.0.0.1, MAP rebind.test 127.0.0.1"])
            try:
                page = browser.new_page()
                page.on("response", lambda r: statuses.append((r.request.method, r.url, r.status)))
                page.goto(f"{url}/")
                expect(page.locator("body[data-ready=true]")).to_have_count(1, timeout=20_000)
                sent = len(relay.received)
                page.fill("#chat-prompt", "What does the os module do?")
                page.click("#chat-send")
                expect(page.locator("#chat-log li.answer .answer-text")).to_have_text("It runs programs.",
                                                                                      timeout=30_000)
                assert len(relay.received) == sent + 1

                sent, counted = len(relay.received), chats(url)
                statuses.clear()
                attacker = browser.new_page()
                attacker.on("response", lambda r: statuses.append((r.request.method, r.url, r.status)))
                attacker.goto(f"http://attacker.test:{attacker_port}/")
                with attacker.expect_response(lambda r: r.url == f"{url}/api/chat" and r.request.method == "POST"
                                              and r.request.post_data.startswith('{"prompt": "from a form"')):
                    seen = attacker.evaluate("attack()")
                assert seen["no_cors"] == "sent", seen  # an opaque answer: the page cannot tell
                assert str(seen["cors"]).startswith("refused") and str(seen["state"]).startswith("refused"), seen
                to_dashboard = [(m, s) for m, u, s in statuses if u.startswith(url)]
                assert to_dashboard and all(s == 403 for _, s in to_dashboard), to_dashboard

                rebound = page.goto(f"http://rebind.test:{port}/")
                assert rebound is not None and rebound.status == 403
                assert "host_not_allowed" in page.content()
                tried = page.evaluate("""async () => {
                    const reply = await fetch("/api/chat", {method: "POST", body: '{"prompt": "rebound"}',
                                                           headers: {"Content-Type": "application/json"}});
                    return [reply.status, (await reply.json()).error.code];
                }""")
                assert tried == [403, "host_not_allowed"]
            finally:
                browser.close()
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
    assert len(relay.received) == sent and chats(url) == counted
