"""`planetserve dashboard`: a live web page of the whole system, served locally."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import click

from planetserve.cli import (
    check_genesis,
    console,
    fail,
    http_url,
    log_level_option,
    max_age_option,
    setup_logging,
    witness_option,
)
from planetserve.config import is_host_port

_KEY = re.compile(r"[0-9a-fA-F]{64}")


def _address(_ctx: click.Context, _param: click.Parameter, text: str) -> tuple[str, int]:
    if not is_host_port(text):
        raise click.BadParameter(f"takes HOST:PORT such as 127.0.0.1:8600 (port 0: a free one), got {text!r}")
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


def _urls(_ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(http_url(v, "--rpc") for v in values)


def _relay(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    if not value:
        return None
    url = http_url(value, "--relay")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _labels(_ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]) -> dict[str, str]:
    labels = {}
    for text in values:
        key, sep, name = text.partition("=")
        if not sep or not _KEY.fullmatch(key) or not 0 < len(name) <= 64:
            raise click.BadParameter(f"takes KEY=NAME, a model node's key as 64 hex digits and a name of "
                                     f"1-64 characters, got {text[:100]!r}")
        labels[key.lower()] = name
    return labels


@click.command("dashboard", short_help="Serve a live web page of a network: ledger, nodes, overlay, chat.")
@click.option("--genesis", required=True, envvar="PLANETSERVE_GENESIS",
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Genesis file every ledger read is verified against (env PLANETSERVE_GENESIS).")
@click.option("--rpc", "rpc", multiple=True, required=True, callback=_urls, metavar="URL",
              help="A validator's CometBFT RPC endpoint, e.g. http://127.0.0.1:26657 (repeat for each "
                   "validator: each one's height and app hash are shown; ledger reads use the first that "
                   "answers).")
@click.option("--relay", callback=_relay, metavar="URL",
              help="A user relay's local endpoint, e.g. http://127.0.0.1:8080 (with or without /v1): overlay "
                   "health, and the chat box's way into the network. Without it both are off.")
@click.option("--model", default=None, metavar="ID",
              help="The model the chat box asks (default: the first the relay lists).")
@click.option("--label", "labels", multiple=True, callback=_labels, metavar="KEY=NAME",
              help="Show NAME for the model node whose key (hex) is KEY (repeatable).")
@click.option("--http", "http_addr", default="127.0.0.1:8600", show_default=True, callback=_address,
              metavar="HOST:PORT",
              help="HOST:PORT to serve the page on (port 0: a free one). Keep it on loopback: the chat box "
                   "spends your relay.")
@max_age_option()
@witness_option("each --rpc")
@log_level_option("warning")
@click.option("--json", "as_json", is_flag=True, help="Print the ready line as JSON.")
def command(genesis: Path, rpc: tuple[str, ...], relay: str | None, model: str | None, labels: dict[str, str],
          http_addr: tuple[str, int], max_age: float, witness: str, log_level: str, as_json: bool) -> None:
    """Serve a live dashboard of a planetserve network in your browser, until interrupted.

    \b
    The page (no external assets: it works offline) refreshes every 2 seconds and shows:
      validators     each one's height, app hash and block time (its RPC /status)
      epoch          the current verification epoch, its phase and leader, the next leader
      model nodes    organisation, listed/trusted, reputation, and a plot of reputations over epochs
                     (the ledger's state after each finalized epoch, read and verified like any read)
      organisations  contribution credits (balance, earned, spent) and reputation
      overlay        the relay's live proxies (onion paths) and its delivery rate
      chat           a prompt sent anonymously through the relay; the answer and the node that signed it
    Ledger reads are verified against the genesis file, so a lying RPC endpoint shows as an error;
    with --witness, so does a header the witness does not have (a fork).

    \b
    Example (a localnet starts one for you: `planetserve localnet up` prints its URL):
      planetserve dashboard --genesis localnet/build/v0/config/genesis.json \\
          --rpc http://127.0.0.1:26657 --rpc http://127.0.0.1:26667 --relay http://127.0.0.1:8080

    The JSON behind the page: GET /api/state; the chat: POST /api/chat {"prompt": "..."} as
    application/json. Other sites' pages, and names other than this machine's loopback ones and
    --http's host, are refused (403).
    """
    from planetserve.dashboard.collect import Settings
    from planetserve.dashboard.server import Dashboard, run_dashboard

    setup_logging(log_level)
    check_genesis(genesis)
    if witness in rpc:
        fail(f"--witness must be another endpoint than every --rpc ({witness} is one): a witness checks the "
             "endpoints' answers, so it cannot be one of them")
    host, port = http_addr
    settings = Settings(genesis=genesis.resolve(), rpc=rpc, relay=relay, model=model, labels=labels,
                        max_age=max_age, witness=witness)

    def ready(dashboard: Dashboard) -> None:
        shown = f"[{host}]" if ":" in host else host
        url = f"http://{shown}:{dashboard.port}/"
        if as_json:
            click.echo(json.dumps({"url": url, "rpc": list(rpc), "witness": witness or None, "relay": relay,
                                   "genesis": str(genesis)}))
        else:
            console.print(f"dashboard: [bold]{url}[/] ({len(rpc)} RPC endpoint(s), witness "
                          f"{witness or 'none'}, relay {relay or 'none'}); Ctrl-C stops it")

    try:
        asyncio.run(run_dashboard(settings, host, port, ready))
    except KeyboardInterrupt:
        pass
    except OSError as exc:
        fail(f"cannot serve on {host}:{port}: {exc.strerror or exc}")
