"""`planetserve localnet`: the whole system on this machine (validators, verifiers, model nodes, relays)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from rich.progress import Progress
from rich.text import Text

from planetserve.cli import console, emit_json, err_console, fail, shown, table
from planetserve.localnet import net

root_option = click.option("--root", type=click.Path(file_okay=False, path_type=Path),
                           default=net.DEFAULT_ROOT, show_default=True, help="Where the network lives.")


@click.group("localnet", short_help="Run the whole system on 127.0.0.1 (up, status, down).")
def group() -> None:
    """Run the whole planetserve system on 127.0.0.1 (state under localnet/build).

    \b
    `up` starts, in the background, what localnet/localnet.toml lists: validators (CometBFT and the
    app) with a verifier daemon beside each, model nodes of several organisations (honest and not),
    user relays and a client relay with a dashboard beside it (a live web page of the whole system),
    then sends one prompt through the client's anonymous endpoint.
    """


@group.command("up")
@root_option
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The composition (default: localnet/localnet.toml, else built-in defaults).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def up(root: Path, config_path: Path | None, as_json: bool) -> None:
    """Start the network in the background (or resume it), ask it one question and print the answer."""
    from planetserve.cli.models_cmd import PROGRESS_COLUMNS, RichReporter
    from planetserve.localnet.config import ConfigError, load_config
    from planetserve.localnet.roles import RoleError

    try:
        config = load_config(config_path)
    except ConfigError as exc:
        fail(str(exc))
    noted: list[str] = []
    try:
        with Progress(*PROGRESS_COLUMNS, console=err_console if as_json else console) as progress:

            def note(message: str) -> None:  # each step once, as a line above the training bars
                if not noted or noted[-1] != message:
                    noted.append(message)
                    progress.console.print(f"[dim]{shown(message)}[/]")

            result = net.up(root, config, note, RichReporter(progress))
    except net.LocalnetError as exc:  # says what to do
        fail(str(exc))
    except Exception as exc:  # every other failure is reported too, with where to look
        where = "" if isinstance(exc, RoleError) else (
            f"\nlogs: {root}/v*/logs/, {root}/<nodes|relays|verifiers>/*/logs/")
        fail(f"{type(exc).__name__}: {exc}{where}\n"
             f"what started keeps running; stop it with `planetserve localnet down --root {root}`")
    if as_json:
        emit_json(result.to_json())
        return
    _print_up(result)


def _print_up(result: net.UpResult) -> None:
    spec = result.spec
    console.print(f"[green]localnet {spec.chain_id} is up[/]; genesis: {spec.genesis_path}")
    if result.started:
        console.print(f"started: {', '.join(result.started)}")
    table("validators", ["moniker", "rpc"], [[v.moniker, v.rpc_url] for v in spec.validators])
    table(f"model nodes serving {result.model_id} (height {result.height}, verified against the committee's "
          "signatures)", ["name", "pubkey", "org_id", "address", "capacity"],
          [[result.names.get(n.pubkey.hex(), "-"), n.pubkey.hex()[:16] + "…", n.org_id, n.address, n.capacity]
           for n in result.nodes])
    if result.answer is not None:
        name = result.names.get(result.answer.node, result.answer.node[:16] + "…")
        console.print(f"[bold]asked[/] through the client relay; [bold]{name}[/] answered in "
                      f"{result.answer.seconds:.1f} s:\n  {shown(repr(result.answer.text))}")
    if result.client is not None:
        console.print(f"client endpoint (OpenAI-compatible, anonymous): [bold]{result.client}[/]")
    if result.dashboard is not None:
        console.print(f"dashboard: [bold]{result.dashboard}[/]")
    console.print("health: [bold]planetserve localnet status[/]; stop it with "
                  "[bold]planetserve localnet down[/] (or make localnet-stop)")


@group.command("down")
@root_option
def down(root: Path) -> None:
    """Stop every process of the network (its state stays for the next `up`)."""
    if net.down(root):
        console.print("localnet stopped")
    else:
        console.print(f"no localnet under {root}")


@group.command("status")
@root_option
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
def status(root: Path, as_json: bool) -> None:
    """Health of each process: validators, verifiers, model nodes, relays, the dashboard."""
    from planetserve.localnet import health

    try:
        groups = health.status(root)
    except FileNotFoundError:
        fail(f"no localnet under {root}; start one with `planetserve localnet up` (or `make localnet`) "
             "from the project's directory, or name its --root")
    if as_json:
        emit_json(groups)
        return
    down = Text("down", style="red")
    rows = [[kind[:-1], entry["name"], "up" if entry["up"] else down, _detail(kind, entry)]
            for kind in health.GROUPS for entry in groups[kind]]
    table(f"localnet under {root}", ["role", "name", "process", "health"], rows)


def _detail(kind: str, e: dict[str, Any]) -> str:
    def show(value: Any) -> str:
        return "-" if value is None else str(value)

    if kind == "validators":
        return (f"height {show(e['height'])}, app hash {show(e['app_hash'])[:16]}, app "
                f"{'up' if e['app'] else 'down'}, cometbft {'up' if e['cometbft'] else 'down'}, {e['rpc']}")
    if kind == "verifiers":
        error = f", last error: {e['last_error'][:80]}" if e.get("last_error") else ""
        return (f"epoch {show(e['epoch'])}, height {show(e['height'])}, {show(e['submitted'])} submitted, "
                f"{show(e['rejected'])} refused{', leader' if e['leader'] else ''}{error}")
    if kind == "nodes":
        trust = {True: "trusted", False: "untrusted", None: "standing unknown"}[e["trusted"]]
        reputation = "" if e["reputation"] is None else f", reputation {e['reputation'] / 1e6:.3f}"
        return (f"{e['model']} as {e['model_id']}, {e['behaviour']}, {e['org']}, "
                f"{'serving' if e['serving'] else 'not answering'}, {trust}{reputation}, {e['http']}")
    if kind == "dashboards":
        return f"{'serving' if e['serving'] else 'not answering'}, {e['url'] or '-'}"
    paths = "not answering" if e["live_paths"] is None else f"{e['live_paths']} live path(s)"
    return f"{'client, ' if e['client'] else ''}{paths}, {e['http']}"
