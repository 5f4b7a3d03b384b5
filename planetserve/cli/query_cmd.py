"""`planetserve query`: read the ledger, verified against the genesis file by default."""

from __future__ import annotations

from typing import Any

import click

from planetserve.chain.client import LedgerClient, Listing, QueryRefused
from planetserve.chain.lightclient import VerificationError
from planetserve.chain.rpc import RpcError
from planetserve.cli import console, emit_json, fail, table
from planetserve.cli.ledger import ledger_options
from planetserve.cli.tx_cmd import key_bytes

FAILURES = (QueryRefused, RpcError, VerificationError)


def provenance(listing: Listing) -> str:
    how = "verified against the committee's signatures" if listing.verified else "[yellow]unverified[/]"
    return f"height {listing.height}, {how}"


def show_list(title: str, listing: Listing, records: list[Any], columns: list[str],
              as_json: bool) -> None:
    rows = [r.to_record() for r in records]
    if as_json:
        emit_json({"height": listing.height, "verified": listing.verified, title: rows})
        return
    table(f"{title} ({len(rows)}; {provenance(listing)})", columns,
          [[row[c] for c in columns] for row in rows])


def json_option(fn):  # type: ignore[no-untyped-def]
    return click.option("--json", "as_json", is_flag=True, help="Print the answer as JSON.")(fn)


@click.group("query")
def group() -> None:
    """Read registry state. Lists and entities are verified against --genesis unless --no-verify."""


@group.command("nodes")
@click.option("--model", "model_id", help="Only nodes serving this model.")
@click.option("--region", help="Only nodes in this region (needs --model).")
@json_option
@ledger_options(verify=True)
def nodes(ledger: LedgerClient, model_id: str | None, region: str | None, as_json: bool) -> None:
    """The signed list of active model nodes."""
    if region and not model_id:
        fail("--region needs --model (lists are kept per model, then per region)")
    try:
        listing, records = ledger.nodes(model_id, region)
    except FAILURES as exc:
        fail(str(exc))
    show_list("nodes", listing, records,
              ["pubkey", "org_id", "model_id", "region", "address", "hardware", "capacity"], as_json)


@group.command("users")
@click.option("--region", help="Only users in this region.")
@json_option
@ledger_options(verify=True)
def users(ledger: LedgerClient, region: str | None, as_json: bool) -> None:
    """The signed list of registered, unexpired user relays."""
    try:
        listing, records = ledger.users(region)
    except FAILURES as exc:
        fail(str(exc))
    show_list("users", listing, records, ["pubkey", "region", "address", "expires_at"], as_json)


@group.command("committee")
@json_option
@ledger_options(verify=True)
def committee(ledger: LedgerClient, as_json: bool) -> None:
    """The verification committee."""
    try:
        listing, records = ledger.committee()
    except FAILURES as exc:
        fail(str(exc))
    show_list("committee", listing, records, ["operator", "consensus_key", "power", "credential"], as_json)


@group.command("node")
@click.argument("pubkey")
@json_option
@ledger_options(verify=True)
def node(ledger: LedgerClient, pubkey: str, as_json: bool) -> None:
    """One model node by its identity key (hex)."""
    try:
        record = ledger.node(key_bytes(pubkey, "PUBKEY"))
    except FAILURES as exc:
        fail(str(exc))
    if record is None:
        fail(f"no model node with key {pubkey}", code=3)
    show_record(record.to_record(), as_json)


@group.command("params")
@json_option
@ledger_options(verify=True)
def params(ledger: LedgerClient, as_json: bool) -> None:
    """The chain's parameters."""
    try:
        record = ledger.params()
    except FAILURES as exc:
        fail(str(exc))
    show_record(record.to_record(), as_json)


@group.command("status")
@json_option
@ledger_options(verify=False)
def status(ledger: LedgerClient, as_json: bool) -> None:
    """The RPC endpoint's view of the chain: id, latest height and app hash."""
    try:
        raw = ledger.rpc.status()
    except RpcError as exc:
        fail(str(exc))
    info = raw["sync_info"]
    summary = {
        "chain_id": raw["node_info"]["network"],
        "moniker": raw["node_info"]["moniker"],
        "height": int(info["latest_block_height"]),
        "app_hash": info["latest_app_hash"],
        "block_time": info["latest_block_time"],
        "catching_up": info["catching_up"],
    }
    show_record(summary, as_json)


def show_record(record: dict[str, Any], as_json: bool) -> None:
    if as_json:
        emit_json(record)
        return
    for name, value in record.items():
        console.print(f"  [bold]{name:15}[/] {value.hex() if isinstance(value, bytes) else value}")
