"""`planetserve chain`: run a validator's ABCI application, alone or with its CometBFT node."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import signal
import subprocess
import time
from pathlib import Path

import click

from planetserve.cli import console, fail
from planetserve.genesis.network import APP_CONFIG_FILE, cometbft_binary
from planetserve.localnet.net import app_command


def app_config(home: Path) -> dict:
    path = home / "config" / APP_CONFIG_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        fail(f"{path} not found: is {home} a validator home made by `planetserve genesis init`?")
    except json.JSONDecodeError as exc:
        fail(f"{path} is not valid JSON: {exc}")
    raise AssertionError("unreachable")


@click.group("chain")
def group() -> None:
    """Run a validator: the planetserve ABCI app and CometBFT."""


@group.command("app")
@click.option("--home", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--db", help="State database URL (default: from the home's planetserve.json).")
@click.option("--log-level", default="INFO", show_default=True)
def app(home: Path, db: str | None, log_level: str) -> None:
    """Serve the ABCI application only (CometBFT connects to it)."""
    from planetserve.chain.app import Application
    from planetserve.chain.server import AbciServer
    from planetserve.chain.store import StateStore

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = app_config(home)
    host, _, port = config["abci_listen"].rpartition(":")
    store = StateStore(db or config["db"])
    server = AbciServer(Application(store))
    # The app allocates many short-lived objects per transaction and keeps few cycles: collect
    # less often, and never rescan what start-up loaded.
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)
    asyncio.run(server.serve(host, int(port)))


@group.command("start")
@click.option("--home", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
def start(home: Path) -> None:
    """Run the ABCI app and CometBFT together until interrupted; if either exits, stop both."""
    app_config(home)
    procs = [subprocess.Popen(app_command(home))]
    time.sleep(1.0)
    procs.append(subprocess.Popen([cometbft_binary(), "start", "--home", str(home)]))
    stopping = False

    def stop(*_args: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    console.print(f"validator {home} running (app pid {procs[0].pid}, cometbft pid {procs[1].pid})")
    while not stopping and all(p.poll() is None for p in procs):
        time.sleep(0.2)
    for p in reversed(procs):
        if p.poll() is None:
            p.terminate()
    for p in procs:
        p.wait(timeout=20)
    codes = [p.returncode for p in procs]
    if not stopping:
        fail(f"a process exited unexpectedly (app {codes[0]}, cometbft {codes[1]})")
