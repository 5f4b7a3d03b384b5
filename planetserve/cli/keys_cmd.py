"""`planetserve keys`: create and inspect key files."""

from __future__ import annotations

from pathlib import Path

import click

from planetserve.chain.keys import KeyFileError, KeySet
from planetserve.cli import console, emit_json, fail


@click.group("keys")
def group() -> None:
    """Create and show key files (identity, VRF and X25519 keys). Secrets are never printed."""


@group.command("new")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the public keys as JSON.")
def new(path: Path, as_json: bool) -> None:
    """Generate a key file at PATH (mode 0600; an existing file is never overwritten)."""
    if path.exists():
        fail(f"{path} already exists; refusing to overwrite a key file")
    keys = KeySet.generate()
    keys.save(path)
    show_public(keys, path, as_json)


@group.command("show")
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the public keys as JSON.")
def show(path: Path, as_json: bool) -> None:
    """Print the public keys of the key file at PATH."""
    try:
        keys = KeySet.load(path)
    except KeyFileError as exc:
        fail(str(exc))
    show_public(keys, path, as_json)


def show_public(keys: KeySet, path: Path, as_json: bool) -> None:
    summary = keys.public_summary()
    if as_json:
        emit_json({"path": str(path), **summary})
        return
    console.print(f"[bold]{path}[/]")
    for name, value in summary.items():
        console.print(f"  {name:9} {value}")
