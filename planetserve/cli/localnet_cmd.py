"""`planetserve localnet`: the four-validator network on this machine."""

from __future__ import annotations

from pathlib import Path

import click

from planetserve.cli import console, emit_json, fail, table
from planetserve.localnet import net

root_option = click.option("--root", type=click.Path(file_okay=False, path_type=Path),
                           default=net.DEFAULT_ROOT, show_default=True, help="Where the network lives.")


@click.group("localnet")
def group() -> None:
    """Run a planetserve network of four validators on 127.0.0.1 (state under localnet/build)."""


@group.command("up")
@root_option
@click.option("--validators", "-n", default=4, show_default=True, help="Validators (first run only).")
@click.option("--json", "as_json", is_flag=True)
def up(root: Path, validators: int, as_json: bool) -> None:
    """Start the network in the background (or resume it) and print a verified node list."""
    with console.status("starting validators and waiting for blocks…"):
        try:
            spec, nodes, height = net.up(root, validators)
        except Exception as exc:  # every failure here is reported, with where to look
            fail(f"{type(exc).__name__}: {exc}\nlogs: {root}/v*/logs/")
    if as_json:
        emit_json({"chain_id": spec.chain_id, "genesis": str(spec.genesis_path),
                   "rpc": [v.rpc_url for v in spec.validators], "height": height,
                   "nodes": [n.to_record() for n in nodes]})
        return
    console.print(f"[green]localnet {spec.chain_id} is up[/]; genesis: {spec.genesis_path}")
    table("validators", ["moniker", "rpc"], [[v.moniker, v.rpc_url] for v in spec.validators])
    table(f"model nodes serving gt (height {height}, verified against the committee's signatures)",
          ["pubkey", "org_id", "address", "hardware", "capacity", "region"],
          [[n.pubkey, n.org_id, n.address, n.hardware, n.capacity, n.region] for n in nodes])
    console.print("stop it with [bold]make localnet-stop[/]; query it with "
                  f"[bold]planetserve query nodes --node {spec.validators[0].rpc_url} "
                  f"--genesis {spec.genesis_path}[/]")


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
@click.option("--json", "as_json", is_flag=True)
def status(root: Path, as_json: bool) -> None:
    """Health of each validator: processes, height and app hash."""
    try:
        rows = net.status(root)
    except FileNotFoundError:
        fail(f"no localnet under {root}; start one with `make localnet`")
    if as_json:
        emit_json([r.__dict__ for r in rows])
        return
    table("localnet", ["moniker", "rpc", "app", "cometbft", "height", "app hash"],
          [[r.moniker, r.rpc_url, "up" if r.app_running else "down", "up" if r.cometbft_running else "down",
            r.height if r.height is not None else "-", r.app_hash or "-"] for r in rows])
