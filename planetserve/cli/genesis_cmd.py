"""`planetserve genesis`: build validator homes and a shared genesis."""

from __future__ import annotations

from pathlib import Path

import click

from planetserve.cli import console, emit_json, fail, table
from planetserve.genesis.committee import app_state_builder
from planetserve.genesis.network import NetworkBuildError, build_network


def parse_models(values: tuple[str, ...]) -> list[tuple[str, str]]:
    models = []
    for value in values:
        model_id, sep, name = value.partition("=")
        if not sep or not model_id or not name:
            raise click.BadParameter(f"{value!r}: expected MODEL_ID=NAME", param_hint="--model")
        models.append((model_id, name))
    return models


@click.group("genesis")
def group() -> None:
    """Create the genesis file and validator homes of a new network."""


@group.command("init")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--validators", "-n", default=4, show_default=True, help="Number of validators.")
@click.option("--chain-id", default="planetserve-local", show_default=True)
@click.option("--model", "models", multiple=True, metavar="ID=NAME",
              help="A model registered at genesis (repeatable).")
@click.option("--credential", default="{moniker}: founding committee member", show_default=True,
              help="Credential text of each founding member; {moniker} is replaced.")
@click.option("--timeout-commit", default="1s", show_default=True, help="CometBFT timeout_commit.")
@click.option("--db", "db_urls", multiple=True, metavar="URL",
              help="Database URL per validator, in order (default: SQLite in each home).")
@click.option("--json", "as_json", is_flag=True)
def init(out: Path, validators: int, chain_id: str, models: tuple[str, ...], credential: str,
         timeout_commit: str, db_urls: tuple[str, ...], as_json: bool) -> None:
    """Create OUT/v0..v{N-1}: CometBFT homes with one genesis whose committee is the N validators.

    \b
    Example:
      planetserve genesis init /tmp/net -n 4 --model gt="planetserve reference model"
    """
    if db_urls and len(db_urls) != validators:
        fail(f"--db given {len(db_urls)} times for {validators} validators")
    try:
        spec = build_network(
            out, validators, chain_id, app_state_builder(parse_models(models), credential=credential),
            timeout_commit=timeout_commit, db_urls=db_urls or None,
        )
    except NetworkBuildError as exc:
        fail(str(exc))
    if as_json:
        emit_json({"chain_id": spec.chain_id, "genesis": str(spec.genesis_path),
                   "validators": [v.to_json() for v in spec.validators]})
        return
    console.print(f"network [bold]{chain_id}[/] created under {out}")
    table("validators", ["moniker", "home", "rpc", "p2p", "abci"],
          [[v.moniker, v.home, v.rpc_url, v.ports.p2p, v.abci_listen] for v in spec.validators])
