"""`planetserve query`: read the ledger, verified against the genesis file by default."""

from __future__ import annotations

import json
from typing import Any

import click

from planetserve.chain.client import LedgerClient, Listing, QueryRefused
from planetserve.chain.lightclient import VerificationError
from planetserve.chain.rpc import RpcError
from planetserve.cli import EXIT_NOT_FOUND, console, emit_json, fail, shown, table
from planetserve.cli.ledger import ledger_options
from planetserve.cli.tx_cmd import key_bytes
from planetserve.registry.credits import format_credits
from planetserve.registry.epochs import Schedule

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
    show_list("committee", listing, records,
              ["operator", "consensus_key", "power", "credential", "expires_at"], as_json)


@group.command("node")
@click.argument("pubkey")
@json_option
@ledger_options(verify=True)
def node(ledger: LedgerClient, pubkey: str, as_json: bool) -> None:
    """One model node by its identity key (hex), with the layers it serves when a deployment placed it
    in a layer pipeline (`stage`: [first layer, end layer, pipeline]; null when it serves whole models)."""
    try:
        key = key_bytes(pubkey, "PUBKEY")
        record = ledger.node(key)
        stage = ledger.stage(key) if record is not None else None
    except FAILURES as exc:
        fail(str(exc))
    if record is None:
        fail(f"no model node with key {pubkey}", code=EXIT_NOT_FOUND)
    show_record({**record.to_record(), "stage": list(stage) if stage else None}, as_json)


@group.command("epoch")
@click.argument("number", type=click.IntRange(min=0), required=False)
@json_option
@ledger_options(verify=True)
def epoch(ledger: LedgerClient, number: int | None, as_json: bool) -> None:
    """A verification epoch: its leader and how it was elected, its plan, and, once finalized, how
    many nodes it scored and how many faults it recorded. Without NUMBER, the current epoch."""
    try:
        record = ledger.epoch(number)
        schedule = Schedule.from_params(ledger.params())
    except FAILURES as exc:
        fail(str(exc))
    if record is None:
        which = "the current epoch" if number is None else f"epoch {number}"
        fail(f"{which} has no record yet (epochs are created near the end of the one before)",
             code=EXIT_NOT_FOUND)
    end = schedule.end(record.number)
    timeline = {
        "heights": f"{record.start_height}-{end}",
        "results_due_by": record.start_height + schedule.results_blocks - 1,
        "vrf_window": f"{end - schedule.vrf_window_blocks + 1}-{end}",
        "plan_window": f"{end - schedule.plan_window_blocks + 1}-{end}",
    }
    show_record({**record.to_record(), **timeline}, as_json)


@group.command("reputation")
@click.argument("node_key", metavar="NODE")
@json_option
@ledger_options(verify=True)
def reputation(ledger: LedgerClient, node_key: str, as_json: bool) -> None:
    """A model node's reputation (parts per million; untrusted below the threshold in `query params`),
    its window of recent credibilities, and its probation: the scored epochs it must still end trusted
    before it is listed. Every registered node has one, from registration on."""
    pubkey = key_bytes(node_key, "NODE")
    try:
        record = ledger.reputation(pubkey)
    except FAILURES as exc:
        fail(str(exc))
    if record is None:
        fail(f"no model node with key {node_key}", code=EXIT_NOT_FOUND)
    show_record(record.to_record(), as_json)


@group.command("faults")
@click.argument("member", required=False)
@json_option
@ledger_options(verify=True)
def faults(ledger: LedgerClient, member: str | None, as_json: bool) -> None:
    """Faults the chain recorded against committee members (all, or one operator key).

    Every kind counts toward a member's removal (member_fault_limit within member_fault_window epochs)
    but `unconfirmed-report`: a leader's claim of no valid response that members' re-challenges
    contradicted, which a node can cause by answering the leader late."""
    try:
        listing, records = ledger.faults(key_bytes(member, "MEMBER") if member else None)
    except FAILURES as exc:
        fail(str(exc))
    show_list("faults", listing, records, ["operator", "epoch", "kind", "node", "detail"], as_json)


@group.command("credits")
@click.argument("org_id", metavar="ORG")
@json_option
@ledger_options(verify=True)
def credits_(ledger: LedgerClient, org_id: str, as_json: bool) -> None:
    """An organisation's contribution credits (earned by its verified, trusted nodes' serving time,
    spent on deployments) and its deployments. Amounts are credits; one credit buys one server-hour
    at a price of 1 (prices per hardware class are in the genesis)."""
    try:
        if ledger.org(org_id) is None:
            fail(f"no organisation {org_id!r}", code=EXIT_NOT_FOUND)
        account = ledger.credits(org_id)
        _, deployments = ledger.deployments()
    except FAILURES as exc:
        fail(str(exc))
    mine = [d.to_record() for d in deployments if d.org_id == org_id]
    summary = {"org_id": org_id, "balance": format_credits(account.balance),
               "earned": format_credits(account.earned), "spent": format_credits(account.spent)}
    if as_json:
        emit_json({**summary, "deployments": mine})
        return
    show_record(summary, as_json)
    columns = ["deployment_id", "model_id", "hardware", "nodes", "stages", "expires_at"]
    rows = [[len(d[c]) if c in ("nodes", "stages") else d[c] for c in columns] for d in mine]
    table(f"deployments ({len(mine)})", columns, rows)


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
    """The RPC endpoint's view of the chain: id, latest height and app hash, the app version the chain
    runs, its earliest kept block, and the earliest height whose state it can still prove (a validator
    pruning with keep_heights, or one that joined by state sync)."""
    try:
        raw = ledger.rpc.status()
        app = ledger.rpc.abci_info()
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
        "earliest_block": int(info["earliest_block_height"]),
        "app_version": int(app.get("app_version") or 0),
        **_retention(app.get("data")),
    }
    show_record(summary, as_json)


def _retention(data: object) -> dict[str, int]:
    """keep_heights and earliest_height from the app's Info data (absent if it does not say)."""
    try:
        said = json.loads(data) if isinstance(data, str) else {}
    except json.JSONDecodeError:
        return {}
    if not isinstance(said, dict):
        return {}
    return {k: said[k] for k in ("keep_heights", "earliest_height") if type(said.get(k)) is int}


def show_record(record: dict[str, Any], as_json: bool) -> None:
    if as_json:
        emit_json(record)
        return
    for name, value in record.items():
        console.print(f"  [bold]{name:15}[/] {shown(value.hex() if isinstance(value, bytes) else value)}")
