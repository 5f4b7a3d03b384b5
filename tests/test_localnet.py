"""`planetserve localnet up` brings up the whole system from a configuration file: four validators with
a verifier daemon each, four model nodes of four organisations (two honest, one serving tiny as gt, one
altering prompts), user relays and the client's relay; answers a prompt over the anonymous overlay;
reports every process healthy; is harmless when run again; and `down` leaves nothing running."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from planetserve.localnet import processes
from planetserve.localnet.roles import existing_homes

pytestmark = pytest.mark.network

NAMES = {"honest-a", "honest-b", "smaller", "clickbait"}


def localnet(*args: str, timeout: float = 300) -> dict:
    done = subprocess.run([sys.executable, "-m", "planetserve", "localnet", *args], capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


def recorded(root: Path) -> list[dict[str, int]]:
    """Every process recorded under the root: validators' and roles'."""
    homes = sorted(root.glob("v[0-9]*")) + [home for _, home in existing_homes(root)]
    return [entry for home in homes for entry in processes.read_pids(home).values()]


def test_localnet_runs_every_role_and_stops_them_all(tmp_path, quick_family):
    config = tmp_path / "localnet.toml"
    config.write_text(f"""
[network]
timeout_commit = "500ms"
[models]
preset = "quick"
data_dir = "{quick_family}"
[relays]
count = 4
proxies = 4
""")
    root = tmp_path / "build"
    pids: list[dict[str, int]] = []
    try:
        began = time.monotonic()
        up = localnet("up", "--root", str(root), "--config", str(config), "--json")
        print(f"up in {time.monotonic() - began:.1f} s")
        pids = recorded(root)
        assert len(pids) == 4 * 2 + 4 + 4 + 5  # validators (app, cometbft), verifiers, nodes, relays
        assert len(up["started"]) == 4 + 4 + 4 + 5

        # the answer came over the overlay, signed by one of the configured nodes
        assert isinstance(up["answer"]["text"], str) and up["answer"]["name"] in NAMES
        assert up["client"].startswith("http://127.0.0.1:") and up["client"].endswith("/v1")
        # every node is in gt's verified list, each of its own organisation
        assert {n["name"] for n in up["nodes"]} == NAMES and {n["model_id"] for n in up["nodes"]} == {"gt"}
        assert {n["name"]: n["org_id"] for n in up["nodes"]} == {name: f"org-{name}" for name in NAMES}

        status = localnet("status", "--root", str(root), "--json")
        for group in ("validators", "verifiers", "nodes", "relays"):
            assert status[group] and all(entry["up"] for entry in status[group]), status[group]
        assert all(v["height"] >= 2 and v["app_hash"] for v in status["validators"])
        assert all(v["ticks"] >= 1 and v["epoch"] is not None for v in status["verifiers"])
        assert {n["name"] for n in status["nodes"]} == NAMES
        assert all(n["serving"] and n["trusted"] and n["reputation"] == 500_000 for n in status["nodes"])
        assert {(n["name"], n["model"], n["behaviour"]) for n in status["nodes"]} >= {
            ("smaller", "tiny", "honest"), ("clickbait", "gt", "alter-prompts")}
        client = [r for r in status["relays"] if r["client"]]
        assert len(client) == 1 and client[0]["live_paths"] >= 4 and client[0]["http"] == up["client"]

        # again, with one relay stopped: only that one is started, the same client endpoint answers
        stopped = processes.read_pids(root / "relays" / "relay2")["relay"]
        processes.stop_recorded([root / "relays" / "relay2"], timeout=15)
        assert not processes.alive(stopped)
        again = localnet("up", "--root", str(root), "--config", str(config), "--json")
        assert again["started"] == ["relay relay2"]
        assert again["client"] == up["client"] and again["answer"]["name"] in NAMES
        now = recorded(root)
        assert [p for p in now if p not in pids] == [processes.read_pids(root / "relays" / "relay2")["relay"]]
        assert [p for p in pids if p not in now] == [stopped]
        pids = now
    finally:
        subprocess.run([sys.executable, "-m", "planetserve", "localnet", "down", "--root", str(root)],
                       capture_output=True, timeout=120)
    assert pids and not any(processes.alive(entry) for entry in pids)
    assert recorded(root) == []
