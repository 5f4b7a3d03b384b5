"""`planetserve tx`: sign and submit registry and committee transactions."""

from __future__ import annotations

import base64
import binascii
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from planetserve.chain.client import LedgerClient, OutcomeMismatch, TxNotCommitted
from planetserve.chain.errors import Code
from planetserve.chain.keys import KeyFileError, KeySet
from planetserve.chain.lightclient import VerificationError
from planetserve.chain.messages import (
    DeployModel,
    Heartbeat,
    ProposeMember,
    ProposeParams,
    ProposeUpgrade,
    RegisterModel,
    RegisterModelNode,
    RegisterOrg,
    RegisterUser,
    UpdateModelNode,
    VoteMember,
)
from planetserve.chain.messages.base import Message
from planetserve.chain.rpc import RpcError
from planetserve.cli import EXIT_REFUSED, console, emit_json, err_console, fail, shown
from planetserve.cli.ledger import ledger_options

CAPACITY = click.IntRange(1, 1_000_000)
"""What the chain accepts as a node's capacity."""


def signer_option(fn):  # type: ignore[no-untyped-def]
    return click.option("--keys", "keys_path", required=True,
                        type=click.Path(exists=True, dir_okay=False, path_type=Path),
                        help="Key file of the signing account.")(fn)


def json_option(fn):  # type: ignore[no-untyped-def]
    return click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")(fn)


def load_keys(path: Path) -> KeySet:
    try:
        return KeySet.load(path)
    except KeyFileError as exc:
        fail(str(exc))
    raise AssertionError("unreachable")


def key_bytes(value: str, name: str) -> bytes:
    """A 32-byte public key given as hex or base64 (CometBFT prints base64)."""
    for decode in (bytes.fromhex, base64.b64decode):
        try:
            raw = decode(value)
        except (ValueError, binascii.Error):
            continue
        if len(raw) == 32:
            return raw
    raise click.BadParameter(f"{value!r} is not a 32-byte key in hex or base64", param_hint=name)


def _events(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the transaction did, as the chain's events say it ({"type", "attributes": {key: value}}),
    without the one every transaction has."""
    out = []
    for event in raw:
        attributes = {str(a.get("key")): str(a.get("value")) for a in event.get("attributes") or ()
                      if isinstance(a, dict)}
        if event.get("type") != "tx":
            out.append({"type": str(event.get("type")), "attributes": attributes})
    return out


def submit(ledger: LedgerClient, keys: KeySet, msg: Message, as_json: bool) -> None:
    tx_type = msg.TYPE
    try:
        with err_console.status(f"submitting {tx_type} and waiting for a block...", spinner="dots"):
            done = ledger.submit(keys, msg)
        verified = bool(done.height) and ledger.verifier is not None
        if verified:
            with err_console.status(f"checking {tx_type}'s outcome against the next block", spinner="dots"):
                done = ledger.verified_outcome(done)
    except TxNotCommitted as exc:
        fail(f"{exc}: check with `planetserve query status` before sending it again (it may still commit)")
    except OutcomeMismatch as exc:
        fail(f"{exc}: the endpoint's answer does not check; read the outcome from another endpoint before "
             "sending it again (it may have committed)")
    except RpcError as exc:
        fail(f"could not submit: {exc}")
    except VerificationError as exc:
        fail(f"could not verify the ledger's answers: {exc}")
    events = _events(done.outcome.events)
    result = {
        "type": tx_type,
        "hash": done.tx_hash.hex().upper(),
        "height": done.height,
        "code": done.outcome.code,
        "log": done.outcome.log,
        "events": events,
        "verified": verified,
    }
    if as_json:
        emit_json(result)
    elif done.outcome.code == 0:
        console.print(f"[green]committed[/] {tx_type} in block {done.height} (tx {result['hash']})"
                      + (", outcome verified" if verified else ""))
        for event in events:
            attributes = " ".join(f"{k}={v}" for k, v in event["attributes"].items())
            console.print(f"  {shown(event['type'])}: {shown(attributes)}")
    if done.outcome.code != 0:
        name = Code(done.outcome.code).name if done.outcome.code in Code._value2member_map_ else "?"
        fail(f"{tx_type} refused with code {done.outcome.code} ({name}): {done.outcome.log}",
             code=EXIT_REFUSED)


@click.group("tx", short_help="Sign and submit transactions; each waits for its block.")
def group() -> None:
    """Sign and submit transactions (each waits until it is committed in a block). With a genesis file,
    the outcome the endpoint reports is then checked against the next block's verified header, which
    commits to every transaction's result (one block more)."""


@group.command("register-org")
@click.option("--org-id", required=True, help="Identifier of the organisation (letters, digits, . _ : / -).")
@click.option("--name", required=True, help="Display name.")
@signer_option
@json_option
@ledger_options(verify=True, required=False)
def register_org(ledger: LedgerClient, keys_path: Path, org_id: str, name: str, as_json: bool) -> None:
    """Register an organisation owned by the signing key."""
    submit(ledger, load_keys(keys_path), RegisterOrg(org_id, name), as_json)


@group.command("register-user")
@click.option("--address", required=True, help="host:port where this user relays traffic.")
@click.option("--region", default="global", show_default=True,
              help="Where the relay runs; clients ask for the user list of a region.")
@signer_option
@json_option
@ledger_options(verify=True, required=False)
def register_user(ledger: LedgerClient, keys_path: Path, address: str, region: str, as_json: bool) -> None:
    """Register the signing key as a user relay (renew it with `tx heartbeat` before it expires)."""
    submit(ledger, load_keys(keys_path), RegisterUser(address, region), as_json)


@group.command("heartbeat")
@click.option("--address", help="A new host:port, if it changed.")
@click.option("--region", help="A new region, if it changed.")
@signer_option
@json_option
@ledger_options(verify=True, required=False)
def heartbeat(ledger: LedgerClient, keys_path: Path, address: str | None, region: str | None,
              as_json: bool) -> None:
    """Renew the signing user's registration for another time-to-live."""
    submit(ledger, load_keys(keys_path), Heartbeat(address, region), as_json)


@group.command("register-model")
@click.option("--model-id", required=True, help="Identifier nodes and requests name the model by, e.g. 'gt'.")
@click.option("--name", required=True, help="Display name.")
@click.option("--layers", type=click.IntRange(1, 10_000),
              help="Transformer layers; with --layer-mib, a deployment on nodes that cannot hold the model "
                   "whole is split into layer pipelines.")
@click.option("--layer-mib", type=click.IntRange(1), help="Memory one layer needs (MiB).")
@signer_option
@json_option
@ledger_options(verify=True, required=False)
def register_model(ledger: LedgerClient, keys_path: Path, model_id: str, name: str, layers: int | None,
                   layer_mib: int | None, as_json: bool) -> None:
    """Propose a model that nodes may serve (committee members only). It is registered once members with
    more than 2/3 of the power approve (`tx vote-member --proposal N --approve`): every member must then
    hold its reference model, so approve only a model you can verify."""
    submit(ledger, load_keys(keys_path), RegisterModel(model_id, name, layers, layer_mib), as_json)


@group.command("register-model-node")
@click.option("--org-id", required=True, help="The organisation the signer owns.")
@click.option("--node-keys", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="The model node's own key file (it proves the key is held).")
@click.option("--model-id", required=True, help="A registered model the node serves.")
@click.option("--address", required=True, help="host:port of the node's peer port.")
@click.option("--hardware", required=True, help="Hardware class, e.g. 'A100-80GB'.")
@click.option("--capacity", required=True, type=CAPACITY, help="Concurrent requests it can serve.")
@click.option("--region", default="global", show_default=True, help="Where the node runs.")
@click.option("--memory-mib", type=click.IntRange(0), help="Accelerator memory for weights (MiB); lets the "
                                                          "chain place layer pipelines on the node.")
@click.option("--gflops", type=click.IntRange(0), help="Compute throughput (GFLOP/s), for pipelines.")
@signer_option
@json_option
@ledger_options(verify=True, required=False)
def register_model_node(ledger: LedgerClient, keys_path: Path, node_keys: Path, org_id: str,
                        model_id: str, address: str, hardware: str, capacity: int, region: str,
                        memory_mib: int | None, gflops: int | None, as_json: bool) -> None:
    """Register a model node of the signer's organisation."""
    try:
        chain_id = ledger.chain_id()
    except RpcError as exc:
        fail(f"could not submit: {exc}")
    registration = RegisterModelNode.signed(chain_id, org_id, load_keys(node_keys), model_id=model_id,
                                            address=address, hardware=hardware, capacity=capacity,
                                            region=region, memory_mib=memory_mib, gflops=gflops)
    submit(ledger, load_keys(keys_path), registration, as_json)


@group.command("update-model-node")
@click.option("--node-pubkey", required=True, help="The node's identity key (hex).")
@click.option("--address", help="A new host:port of the node's peer port.")
@click.option("--capacity", type=CAPACITY, help="A new number of concurrent requests it can serve.")
@click.option("--region", help="A new region.")
@click.option("--status", type=click.Choice(["active", "inactive"]),
              help="inactive takes the node out of the lists without unregistering it.")
@signer_option
@json_option
@ledger_options(verify=True, required=False)
def update_model_node(ledger: LedgerClient, keys_path: Path, node_pubkey: str, as_json: bool,
                      **changes: Any) -> None:
    """Change a model node of the signer's organisation."""
    update = UpdateModelNode(key_bytes(node_pubkey, "--node-pubkey"), **changes)
    submit(ledger, load_keys(keys_path), update, as_json)


@group.command("propose-member")
@click.option("--action", type=click.Choice(["add", "remove", "renew"]), default="add", show_default=True,
              help="Admit a new member, remove one, or renew one's credential (--credential, checked "
                   "again) before it lapses.")
@click.option("--operator", required=True, help="Candidate's identity key (hex).")
@click.option("--consensus-key", help="Candidate's CometBFT validator key (hex or base64).")
@click.option("--vrf-key", help="Candidate's VRF key (hex).")
@click.option("--x25519-key", help="Candidate's X25519 key (hex).")
@click.option("--credential", help="Who the candidate is and why it may verify.")
@click.option("--power", type=click.IntRange(1, 1_000_000), default=10, show_default=True,
              help="The new member's voting power as a validator.")
@signer_option
@json_option
@ledger_options(verify=True, required=False)
def propose_member(ledger: LedgerClient, keys_path: Path, action: str, operator: str,
                   consensus_key: str | None, vrf_key: str | None, x25519_key: str | None,
                   credential: str | None, power: int, as_json: bool) -> None:
    """Propose admitting, removing or renewing a committee member (applied at >2/3 of voting power).

    The proposer's vote counts; the output names the proposal_id the other members vote on with
    `planetserve tx vote-member --proposal ID`."""
    proposal = ProposeMember(action, key_bytes(operator, "--operator"))
    if action == "renew":
        if not credential:
            fail("renewing a member needs --credential")
        proposal = replace(proposal, credential=credential)
    if action == "add":
        missing = [n for n, v in (("--consensus-key", consensus_key), ("--vrf-key", vrf_key),
                                  ("--x25519-key", x25519_key), ("--credential", credential)) if not v]
        if missing:
            fail(f"adding a member needs {', '.join(missing)}")
        proposal = replace(proposal, consensus_key=key_bytes(consensus_key, "--consensus-key"),  # type: ignore[arg-type]
                           vrf_key=key_bytes(vrf_key, "--vrf-key"),  # type: ignore[arg-type]
                           x25519_key=key_bytes(x25519_key, "--x25519-key"),  # type: ignore[arg-type]
                           credential=credential, power=power)
    submit(ledger, load_keys(keys_path), proposal, as_json)


@group.command("propose-params")
@click.option("--height", required=True, type=click.IntRange(min=1),
              help="The block at whose start the change applies (a vote needs time: some blocks ahead).")
@click.option("--set", "changes", multiple=True, required=True, metavar="NAME=VALUE",
              help="A parameter and its new integer value (repeatable); `planetserve query params` lists "
                   "them.")
@signer_option
@json_option
@ledger_options(verify=True, required=False)
def propose_params(ledger: LedgerClient, keys_path: Path, height: int, changes: tuple[str, ...],
                   as_json: bool) -> None:
    """Propose changing parameters at a height (applied there once >2/3 of voting power approves).

    The others vote with `planetserve tx vote-member --proposal ID` before that height. epoch_blocks is
    set by the genesis alone, and results_blocks, vrf_window_blocks and plan_window_blocks change only
    at an epoch's first block (`planetserve query epoch` shows where the next one starts)."""
    values: dict[str, int] = {}
    for item in changes:
        name, sep, value = item.partition("=")
        if not sep or not name or not value.lstrip("-").isdigit():
            fail(f"--set takes NAME=INTEGER, got {item!r}")
        values[name] = int(value)
    submit(ledger, load_keys(keys_path), ProposeParams(height, values), as_json)


@group.command("propose-upgrade")
@click.option("--name", required=True,
              help="The upgrade's name: the newer app runs its migration of that name.")
@click.option("--app-version", required=True, type=click.IntRange(min=2),
              help="The app version validators must run from --height on.")
@click.option("--height", required=True, type=click.IntRange(min=1),
              help="The first block of the new version: older apps stop before it.")
@signer_option
@json_option
@ledger_options(verify=True, required=False)
def propose_upgrade(ledger: LedgerClient, keys_path: Path, name: str, app_version: int, height: int,
                    as_json: bool) -> None:
    """Propose an upgrade (approved at >2/3 of voting power): at --height, apps older than --app-version
    halt with "UPGRADE <name> NEEDED"; each operator then starts the newer app, which goes on from the
    same state (docs/operators.md, "Upgrade")."""
    submit(ledger, load_keys(keys_path), ProposeUpgrade(name, app_version, height), as_json)


@group.command("vote-member")
@click.option("--proposal", "proposal_id", required=True, type=click.IntRange(min=1),
              help="The proposal_id that `tx propose-member` printed.")
@click.option("--approve/--reject", default=True, show_default=True,
              help="More than a third of the voting power rejecting drops the proposal.")
@signer_option
@json_option
@ledger_options(verify=True, required=False)
def vote_member(ledger: LedgerClient, keys_path: Path, proposal_id: int, approve: bool,
                as_json: bool) -> None:
    """Vote on a pending committee proposal: a member, parameters or an upgrade."""
    submit(ledger, load_keys(keys_path), VoteMember(proposal_id, approve), as_json)


@group.command("deploy-model")
@click.option("--org-id", required=True, help="The organisation the signer owns; it pays.")
@click.option("--model-id", required=True, help="A registered model to serve.")
@click.option("--hardware", required=True, help="Hardware class of the servers (priced in genesis).")
@click.option("--nodes", required=True, type=click.IntRange(min=1), help="How many servers.")
@click.option("--days", required=True, type=click.FloatRange(min=0, min_open=True),
              help="For how long (fractions allowed; at least one minute).")
@signer_option
@json_option
@ledger_options(verify=True, required=False)
def deploy_model(ledger: LedgerClient, keys_path: Path, org_id: str, model_id: str, hardware: str, nodes: int,
                 days: float, as_json: bool) -> None:
    """Spend the organisation's contribution credits to have a model served by NODES servers of a
    hardware class for DAYS. The organisation's reputation must clear the trust threshold; the chain
    picks the servers and ends the deployment when its time is up. See `query credits ORG`.

    Only active, trusted nodes registered for the model, of the class, serving no other deployment
    are assigned: NODES of those that hold the model whole, or, for a model registered with its
    size that none of them holds whole, layer pipelines of at most NODES of them. Otherwise the
    chain refuses (code 15, unavailable) and spends nothing: no such node is registered for the
    model, fewer than NODES hold it whole, or no pipeline can be formed or fits in NODES.

    When an assigned node leaves (set inactive), changes its model, class or memory, or becomes
    untrusted, the chain re-assigns its share: at once for a change of registration, at the end of
    the epoch for trust. A node that holds the model whole is replaced by another; pipelines are
    planned again over the remaining and standby nodes. Servers that cannot be replaced are
    refunded for the time left; a deployment left without servers ends."""
    if days * 86_400 < 60:
        raise click.BadParameter(f"{days:g} days is less than one minute", param_hint="--days")
    deployment = DeployModel(org_id, model_id, hardware, nodes, round(days * 86_400))
    submit(ledger, load_keys(keys_path), deployment, as_json)
