"""`planetserve chain`: run a validator's ABCI application, alone or with its CometBFT node."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import click

from planetserve.chain.abci.address import (
    AbciAddress,
    AbciAddressError,
    UnixAddress,
    listening,
    parse_abci_address,
)
from planetserve.chain.client import LedgerClient
from planetserve.cli import (
    check_listen,
    console,
    db_option,
    emit_json,
    fail,
    keep_heights_option,
    log_level_option,
    setup_logging,
    shown,
)
from planetserve.cli.ledger import ledger_options
from planetserve.genesis.network import (
    APP_CONFIG_FILE,
    DEFAULT_SNAPSHOT_INTERVAL,
    KEYS_FILE,
    NetworkBuildError,
    StateSync,
    cometbft_binary,
    join_home,
)
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


def abci_address(home: Path, config: dict) -> AbciAddress:
    """The app's address from the home's planetserve.json."""
    try:
        return parse_abci_address(str(config.get("abci_listen", "")))
    except ValueError as exc:
        fail(f"{home}/config/{APP_CONFIG_FILE}: abci_listen: {exc}")
    raise AssertionError("unreachable")


def check_abci(_ctx: click.Context, _param: click.Parameter, value: str | None) -> AbciAddress | None:
    """--abci as an address, refused before anything is written when it is not one."""
    try:
        return None if value is None else parse_abci_address(value)
    except AbciAddressError as exc:
        raise click.BadParameter(str(exc)) from None


def abci_note(address: AbciAddress, chosen: bool) -> str:
    """What `chain init` tells the operator about where the app listens, and who can reach it."""
    if isinstance(address, UnixAddress):
        return f"its app listens on {address}: only this user can connect to it"
    why = "" if chosen else " (the home's path is too long for a Unix socket)"
    return (f"its app listens on {address}{why}: on TCP any local process can drive it; "
            f"--abci unix:///SHORT/PATH.sock keeps it to this user")


@click.group("chain")
def group() -> None:
    """Run a validator: the planetserve ABCI app and CometBFT."""


@group.command("init")
@click.option("--home", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="The new node's home (must not exist or be empty).")
@click.option("--genesis", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="The network's genesis.json, as the committee published it.")
@click.option("--peer", "peers", multiple=True, required=True, metavar="NODE_ID@HOST:PORT",
              help="A node of the network to follow (repeat for several; members publish theirs).")
@click.option("--moniker", required=True, help="This node's name in CometBFT, e.g. the institution's.")
@click.option("--p2p", default="0.0.0.0:26656", show_default=True, help="P2P listen address.")
@click.option("--external", default="", help="P2P address others reach this node at (host:port).")
@click.option("--rpc", default="127.0.0.1:26657", show_default=True,
              help="CometBFT RPC listen address (clients and the verifier daemon read the ledger here).")
@click.option("--abci", metavar="unix:///PATH|HOST:PORT", callback=check_abci,
              help="Where the planetserve app listens. Default: unix://HOME/abci/app.sock, which only this "
                   "user can reach (127.0.0.1:26658 when that path is too long for a socket).")
@db_option("State database URL (default: SQLite in the home; or postgresql+psycopg://...).", default="")
@click.option("--local", is_flag=True, help="Nodes share one address (all on one machine): accept "
                                            "duplicate IPs and unroutable peers.")
@keep_heights_option()
@click.option("--state-sync", "state_sync_rpc", multiple=True, metavar="RPC_URL",
              help="Join from a recent state snapshot instead of replaying every block: the RPC of a "
                   "network node (repeat for a second, which must agree). The trusted header is the latest, "
                   "verified from the genesis, unless --trust-height and --trust-hash say otherwise.")
@click.option("--trust-height", type=click.IntRange(min=1), help="With --state-sync: the height of a header "
              "you trust (needed when the nodes no longer keep the blocks back to the genesis).")
@click.option("--trust-hash", metavar="HEX", help="With --state-sync: that header's hash.")
@click.option("--snapshot-interval", type=click.IntRange(min=0), default=DEFAULT_SNAPSHOT_INTERVAL,
              show_default=True, help="Heights between the state sync snapshots this node makes and serves "
                                      "(0: none).")
@click.option("--retain-blocks", type=click.IntRange(min=0), default=0, show_default=True,
              help="Blocks CometBFT keeps (0: all). Never fewer than a kept snapshot needs; CometBFT also "
                   "keeps the headers that evidence still needs.")
@click.option("--metrics", default="127.0.0.1:26660", show_default=True, metavar="HOST:PORT",
              callback=check_listen, help="Where CometBFT serves its Prometheus metrics ('' for nowhere).")
@click.option("--app-metrics", default="127.0.0.1:26661", show_default=True, metavar="HOST:PORT",
              callback=check_listen,
              help="Where the planetserve app serves its Prometheus metrics ('' for nowhere).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def init(home: Path, genesis: Path, peers: tuple[str, ...], moniker: str, p2p: str, external: str, rpc: str,
         abci: AbciAddress | None, db: str, local: bool, keep_heights: int, state_sync_rpc: tuple[str, ...],
         trust_height: int | None, trust_hash: str | None, snapshot_interval: int, retain_blocks: int,
         metrics: str, app_metrics: str, as_json: bool) -> None:
    """Make a node's home to join a running network (an institution joining the committee).

    The node starts as a full node: run it with `planetserve chain start --home HOME` and let it
    sync. Then send the printed keys to a committee member, who proposes the admission with
    `planetserve tx propose-member`; once members with more than 2/3 of the voting power approve
    (`planetserve tx vote-member`), the node becomes a validator at the next blocks. Keep
    HOME/config/priv_validator_key.json and HOME/config/planetserve_keys.json secret.

    \b
    Join by state sync (minutes instead of replaying the chain):
      planetserve chain init --home v5 --genesis genesis.json --peer ID@host:26656 --moniker v5 \\
        --state-sync http://host:26657 --state-sync http://other:26657
    """
    sync = state_sync(genesis, state_sync_rpc, trust_height, trust_hash) if state_sync_rpc else None
    if sync is None and (trust_height or trust_hash):
        fail("--trust-height and --trust-hash go with --state-sync")
    try:
        joined = join_home(home, genesis, peers, moniker=moniker, rpc=rpc, p2p=p2p, abci=abci,
                           external=external, db_url=db, local=local, keep_heights=keep_heights,
                           snapshot_interval=snapshot_interval, retain_blocks=retain_blocks, state_sync=sync,
                           metrics=metrics, app_metrics=app_metrics)
    except NetworkBuildError as exc:
        fail(str(exc))
    keys = joined.keys
    propose = (f"planetserve tx propose-member --operator {keys['identity']} "
               f"--consensus-key {joined.consensus_key.hex()} --vrf-key {keys['vrf']} "
               f"--x25519-key {keys['x25519']} --credential \"<who you are>\" --keys <member key file>")
    trusted = None if sync is None else {"height": sync.trust_height, "hash": sync.trust_hash.hex().upper()}
    if as_json:
        emit_json({"home": str(joined.home), "chain_id": joined.chain_id, "node_id": joined.node_id,
                   "operator": keys["identity"], "consensus_key": joined.consensus_key.hex(),
                   "vrf_key": keys["vrf"], "x25519_key": keys["x25519"], "propose": propose,
                   "state_sync": trusted, "abci": str(joined.abci)})
        return
    console.print(f"created node home [bold]{shown(joined.home)}[/] for chain {shown(joined.chain_id)}; "
                  f"node id {joined.node_id}")
    console.print(shown(abci_note(joined.abci, chosen=abci is not None)))
    if trusted is not None:
        console.print(f"it joins by state sync, trusting header {trusted['height']} ({trusted['hash']})")
    console.print(f"run it with: planetserve chain start --home {joined.home}")
    console.print(f"your keys are in {joined.home}/config/{KEYS_FILE}; a committee member proposes you with:")
    console.print(propose, soft_wrap=True)


def state_sync(genesis: Path, servers: tuple[str, ...], height: int | None,
               header_hash: str | None) -> StateSync:
    """The state sync settings of a joining node: the trusted header given, or the latest one,
    verified from the genesis by the project's light client (with a second server as its witness)."""
    if (height is None) != (header_hash is None):
        fail("give both --trust-height and --trust-hash, or neither")
    if height is not None and header_hash is not None:
        try:
            trusted = bytes.fromhex(header_hash)
        except ValueError:
            trusted = b""
        if len(trusted) != 32:
            fail(f"--trust-hash {header_hash!r} is not a 64-hex-digit header hash")
        return StateSync(servers, height, trusted)
    from planetserve.chain.lightclient import LightClient, VerificationError
    from planetserve.chain.rpc import RpcError

    try:
        witness = servers[1] if len(servers) > 1 else None
        client = LightClient.from_genesis_file(genesis, servers[0], witness=witness)
        header = client.verified_header()
    except (VerificationError, RpcError, OSError, ValueError) as exc:
        fail(f"cannot verify a header to trust from {servers[0]}: {exc}. If its node keeps no blocks back "
             "to the genesis, give --trust-height and --trust-hash of a header you trust")
    return StateSync(servers, header.height, header.hash)


HOME_HELP = "The validator's home (CometBFT's config/ and data/, the app's config/planetserve.json)."


@group.command("app")
@click.option("--home", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help=HOME_HELP)
@db_option("State database URL (default: from the home's planetserve.json).")
@keep_heights_option(None, " Default: keep_heights in the home's planetserve.json, else 0.")
@log_level_option()
def app(home: Path, db: str | None, keep_heights: int | None, log_level: str) -> None:
    """Serve the ABCI application only (CometBFT connects to it)."""
    from sqlalchemy.exc import SQLAlchemyError

    from planetserve.chain.abci.app import Application
    from planetserve.chain.abci.metrics import AppMetrics
    from planetserve.chain.abci.server import AbciServer, tune_gc
    from planetserve.chain.abci.snapshots import CHUNK_BYTES, Snapshots
    from planetserve.chain.abci.store import StateStore, StoreError, masked_url
    from planetserve.metrics import serve as serve_metrics

    setup_logging(log_level)
    config = app_config(home)
    address = abci_address(home, config)
    keep = config.get("keep_heights", 0) if keep_heights is None else keep_heights
    url = db or config["db"]
    try:
        store = StateStore(url, keep_heights=keep)
    except (ValueError, StoreError, SQLAlchemyError) as exc:
        detail = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        fail(f"cannot open the state at {masked_url(url)}: {detail}")
    try:
        snapshots = Snapshots(home / "data" / "snapshots", interval=config.get("snapshot_interval", 0),
                              keep=config.get("snapshot_keep", 2),
                              chunk_bytes=config.get("snapshot_chunk_bytes", CHUNK_BYTES))
        listen = config.get("metrics_listen", "")
        metrics = AppMetrics(store) if listen else None
        application = Application(store, snapshots, retain_blocks=config.get("retain_blocks", 0),
                                  chain_id=config.get("chain_id", ""), metrics=metrics)
        if metrics is not None:
            serve_metrics(listen, metrics.registry)
    except (ValueError, TypeError) as exc:
        fail(f"{home}/config/{APP_CONFIG_FILE}: {exc}")
    except OSError as exc:
        fail(f"cannot serve the app's metrics at {listen}: {exc}")
    server = AbciServer(application)
    tune_gc()
    try:
        asyncio.run(server.serve(address))
    except AbciAddressError as exc:
        fail(f"cannot serve the app at {address}: {exc}")


@group.command("export")
@click.option("--home", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help=HOME_HELP)
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Where to write the new genesis.json.")
@click.option("--chain-id", default=None, help="The new chain's id (default: this chain's).")
@click.option("--json", "as_json", is_flag=True, help="Print what was exported as JSON.")
def export(home: Path, out: Path, chain_id: str | None, as_json: bool) -> None:
    """Write the genesis of a chain that goes on from this validator's last committed height H.

    Stop the validator first (at an upgrade's halt, for instance). The new genesis starts at height
    H+1, at H's block time, with the same committee and every entry of the state, whose app hash is
    H's. Each member installs it in a reset home (`cometbft unsafe-reset-all`, a new state database);
    `planetserve genesis init --from-export` takes only its registry for a new network.
    """
    from sqlalchemy.exc import SQLAlchemyError

    from planetserve.chain.abci.store import StateStore, StoreError, masked_url
    from planetserve.genesis.export import export_genesis

    config = app_config(home)
    try:
        genesis = json.loads((home / "config" / "genesis.json").read_text())
        with StateStore(config["db"]) as store:
            doc = export_genesis(store, genesis, chain_id)
            app_hash = store.app_hash.hex().upper()
    except (OSError, ValueError) as exc:  # ExportError included
        fail(f"cannot export {home}: {exc}")
    except (StoreError, SQLAlchemyError) as exc:
        fail(f"cannot read the state at {masked_url(config['db'])}: {exc}")
    out.write_text(json.dumps(doc, indent=1) + "\n")
    summary = {"out": str(out), "chain_id": doc["chain_id"], "initial_height": int(doc["initial_height"]),
               "app_hash": app_hash, "entries": len(doc["app_state"]["exported"]),
               "validators": len(doc["validators"])}
    if as_json:
        emit_json(summary)
        return
    console.print(f"wrote {shown(out)}: chain {shown(summary['chain_id'])} from height "
                  f"{summary['initial_height']}, "
                  f"{summary['entries']} state entries, app hash {app_hash}")


@group.command("rotate-keys")
@click.option("--home", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help=HOME_HELP)
@click.option("--finish", is_flag=True,
              help="Once the rotation took effect, with the validator stopped: put the new keys in place.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@ledger_options(verify=False)
def rotate_keys(ledger: LedgerClient, home: Path, finish: bool, as_json: bool) -> None:
    """Rotate this member's keys: operator, VRF, X25519 and its validator's consensus key.

    Step 1 (validator running): writes the new keys beside the current ones (*.next.json in
    HOME/config) and sends rotate-member-key, signed by the operator key and by each new signing key.
    It takes effect at the next epoch's first block H: the member's record, faults and votes move to
    the new operator key, and its validator's power to the new consensus key from H+2 on.

    Step 2 (after H): stop the validator and the verifier, run this again with --finish, start them.
    The old operator keys stay as planetserve_keys.retired.json: the verifier still opens the epoch's
    plan, sealed before the rotation, with them. The validator misses the few blocks it is down.
    """
    from planetserve.chain.client import TRANSIENT
    from planetserve.chain.keys import KeyFileError, KeySet
    from planetserve.chain.messages import RotateMemberKey
    from planetserve.genesis import validator_keys

    try:
        operator = KeySet.load(home / "config" / KEYS_FILE)
        new_keys, consensus = (validator_keys.prepared if finish else validator_keys.prepare)(home)
        if finish:
            member = next((m for m in ledger.committee()[1] if m.operator == new_keys.public), None)
            if member is None or member.consensus_key != bytes(consensus.verify_key):
                pending = [r for r in ledger.member_rotations() if r.operator == operator.public]
                due = f"it is due at height {pending[0].height}" if pending else "none is pending"
                fail(f"the ledger does not show the rotation in effect yet ({due}); the current keys stay")
            validator_keys.finish(home)
            summary = {"operator": new_keys.public.hex(), "consensus_key": bytes(consensus.verify_key).hex()}
            message = "new keys in place: start the validator and its verifier again"
        else:
            rotation_msg = RotateMemberKey.signed(ledger.chain_id(), operator.public, new_keys, consensus)
            done = ledger.submit(operator, rotation_msg)
            if not done.outcome.ok:
                fail(f"rotate-member-key refused (code {done.outcome.code}): {done.outcome.log}")
            # its own event says when: the rotation may already be in effect by the time it is read
            at = done.outcome.attribute("rotate_member_key", "height")
            if at is None:
                fail(f"rotate-member-key committed in block {done.height} without its height event")
            height = int(at)
            summary = {"operator": operator.public.hex(), "new_operator": new_keys.public.hex(),
                       "height": height}
            message = (f"keys rotate at height {height}: after it, stop the validator, run "
                       f"`planetserve chain rotate-keys --home {home} --finish` and start it again")
    except (KeyFileError, validator_keys.RotationFileError) as exc:
        fail(str(exc))
    except TRANSIENT as exc:
        fail(f"the ledger could not be reached: {exc}")
    if as_json:
        emit_json(summary)
        return
    console.print(message)


def stop_all(procs: dict[str, subprocess.Popen], grace: float) -> list[str]:
    """SIGTERM every process, last started first; SIGKILL what outlives one shared deadline.

    One deadline for all rather than one each, so a hung child cannot make the stop take
    a multiple of it; returns the names of the processes that had to be killed.
    """
    for proc in reversed(procs.values()):
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace
    killed = []
    for name, proc in procs.items():
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            killed.append(name)
    return killed


@group.command("start")
@click.option("--home", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help=HOME_HELP)
@click.option("--stop-timeout", default=20.0, show_default=True, type=click.FloatRange(min=0.0),
              help="Seconds the app and CometBFT together get to exit after SIGTERM before they are killed.")
def start(home: Path, stop_timeout: float) -> None:
    """Run the ABCI app and CometBFT together until interrupted; if either exits, stop both."""
    address = abci_address(home, app_config(home))
    try:
        cometbft = cometbft_binary()
    except NetworkBuildError as exc:
        fail(str(exc))
    stopping = False

    def stop(*_args: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    procs = {"app": subprocess.Popen(app_command(home))}
    if app_up(procs["app"], address, lambda: stopping):
        procs["cometbft"] = subprocess.Popen([cometbft, "start", "--home", str(home)])
        pids = ", ".join(f"{name} pid {proc.pid}" for name, proc in procs.items())
        console.print(f"validator {home} running ({pids})")
    while not stopping and all(p.poll() is None for p in procs.values()):
        time.sleep(0.2)
    killed = stop_all(procs, stop_timeout)
    if killed:
        fail(f"{' and '.join(killed)} did not exit within {stop_timeout:g} s of SIGTERM and "
             f"{'was' if len(killed) == 1 else 'were'} killed")
    if not stopping:
        codes = ", ".join(f"{name} {proc.returncode}" for name, proc in procs.items())
        fail(f"a process exited unexpectedly ({codes})")


def app_up(app: subprocess.Popen, address: AbciAddress, stopping: Callable[[], bool]) -> bool:
    """Wait until the app accepts connections at `address` (CometBFT gives up on an app it cannot reach
    at start); False when the app exits first or a stop is asked."""
    while not stopping() and app.poll() is None:
        if listening(address):
            return True
        time.sleep(0.2)
    return False
