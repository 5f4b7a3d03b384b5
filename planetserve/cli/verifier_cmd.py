"""`planetserve verifier`: the committee member's verifier daemon, beside its validator."""

from __future__ import annotations

import json
from pathlib import Path

import click

from planetserve.cli import (
    check_genesis,
    console,
    emit_json,
    fail,
    log_level_option,
    max_age_option,
    metrics_option,
    rpc_option,
    setup_logging,
    shown,
    table,
    witness_option,
)

HOME_HELP = "The verifier's home (verifier.json, its journals and status.json)."


@click.group("verifier")
def group() -> None:
    """Take part in verification epochs as a committee member.

    \b
    Beside each validator, once:
      planetserve node init-user --home relay --genesis genesis.json     # challenges travel the overlay
      planetserve verifier init --home ver --keys <validator home>/config/planetserve_keys.json \\
          --genesis genesis.json --relay http://127.0.0.1:8080 --model gt=gt
    then keep both running:
      planetserve node user --home relay
      planetserve verifier run --home ver

    The daemon proves its VRF for each next epoch, commits the plan when it leads, challenges the
    planned model nodes through the user relay, submits their signed answers, scores every result with
    its own reference model, attests, and re-challenges nodes whose results the leader withheld.
    """


@group.command("init")
@click.option("--home", required=True, type=click.Path(file_okay=False, path_type=Path), help=HOME_HELP)
@click.option("--keys", "key_file", required=True,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="The member's key file (operator, VRF and X25519 keys), e.g. the validator home's "
                   "config/planetserve_keys.json.")
@click.option("--genesis", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Genesis file the ledger is verified against.")
@rpc_option
@witness_option()
@max_age_option()
@metrics_option()
@click.option("--relay", default="http://127.0.0.1:8080", show_default=True,
              help="A user relay's local OpenAI endpoint, which carries the challenges.")
@click.option("--model", "models", multiple=True, metavar="MODEL_ID=REFERENCE",
              help="Registered model id and the reference model that scores its nodes (family name or "
                   "checkpoint directory); repeatable. Default: gt=gt.")
@click.option("--data-dir", default="", help="Where the model family is cached.")
@click.option("--credibility", type=click.Choice(["calibrated", "ppl"]), default="calibrated",
              show_default=True, help="calibrated (docs/detection.md) or the paper's 1/PPL.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def init(home: Path, key_file: Path, genesis: Path, models: tuple[str, ...], as_json: bool,
         **settings: object) -> None:
    """Create a verifier's home (refuses to overwrite one)."""
    from planetserve.chain.keys import KeyFileError, KeySet
    from planetserve.config import HomeError
    from planetserve.verifier.config import CONFIG_FILE, VerifierConfig

    if (home / CONFIG_FILE).exists():
        fail(f"{home} already has {CONFIG_FILE}; edit it to change settings")
    mapping: dict[str, str] = {}
    for item in models or ("gt=gt",):
        model_id, sep, reference = item.partition("=")
        if not sep or not model_id or not reference:
            fail(f"--model takes MODEL_ID=REFERENCE, got {item!r}")
        mapping[model_id] = reference
    try:
        keys = KeySet.load(key_file)
    except KeyFileError as exc:
        fail(str(exc))
    check_genesis(genesis)
    config = VerifierConfig(keys=str(key_file.resolve()), genesis=str(genesis.resolve()), models=mapping,
                            **settings)  # type: ignore[arg-type]
    try:
        config.save(home)
    except HomeError as exc:
        fail(str(exc))
    if as_json:
        emit_json({"home": str(home), "member": keys.public.hex(), "models": mapping})
        return
    console.print(f"created verifier home [bold]{home}[/] for member {keys.public.hex()}")
    console.print(f"run it with: planetserve verifier run --home {home}")


@group.command("run")
@click.option("--home", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help=HOME_HELP)
@log_level_option()
@click.option("--json", "as_json", is_flag=True, help="Print the ready line as JSON.")
def run(home: Path, log_level: str, as_json: bool) -> None:
    """Run the daemon until interrupted; it resumes the current epoch from the ledger after a restart."""
    from planetserve.chain.client import QueryRefused
    from planetserve.chain.keys import KeyFileError
    from planetserve.chain.lightclient import VerificationError
    from planetserve.chain.rpc import RpcError
    from planetserve.config import HomeError
    from planetserve.models import ModelError
    from planetserve.verifier.config import VerifierConfig
    from planetserve.verifier.daemon import Daemon
    from planetserve.verifier.runner import run_verifier

    setup_logging(log_level)

    def ready(daemon: Daemon, config: VerifierConfig) -> None:
        line = {"member": daemon.me.hex(), "rpc": config.rpc, "relay": config.relay,
                "models": dict(sorted(config.models.items()))}
        if as_json:
            click.echo(json.dumps(line))
        else:
            console.print(f"verifier {daemon.me.hex()[:16]}… running against {config.rpc}; challenges go "
                          f"through {config.relay}; models {', '.join(sorted(config.models))}")

    try:
        run_verifier(home, ready)
    except (HomeError, KeyFileError, ModelError, ValueError, OSError) as exc:
        fail(str(exc))
    except (RpcError, VerificationError, QueryRefused) as exc:
        fail(f"the ledger could not be read: {exc}")


@group.command("status")
@click.option("--home", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help=HOME_HELP)
@click.option("--last", default=10, show_default=True, type=click.IntRange(0, 10_000),
              help="How many of the latest submissions to show.")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
def status(home: Path, last: int, as_json: bool) -> None:
    """What a running (or stopped) daemon last reported, and its latest transactions."""
    from planetserve.verifier.config import STATUS_FILE, read_submissions

    try:
        state = json.loads((home / STATUS_FILE).read_text())
    except FileNotFoundError:
        fail(f"no {STATUS_FILE} in {home}: the daemon has not run yet")
    except ValueError as exc:
        fail(f"{home / STATUS_FILE} is not the daemon's status (not JSON: {exc})")
    if not isinstance(state, dict) or not {"member", "submitted", "rejected"} <= set(state):
        fail(f"{home / STATUS_FILE} is not the daemon's status (member, submitted, rejected missing)")
    recent = read_submissions(home)[-last:] if last else []
    if as_json:
        emit_json({**state, "submissions": recent})
        return
    console.print(f"member {state['member']}: epoch {state.get('epoch')}, height {state.get('height')}, "
                  f"{'leader' if state.get('leader') else 'member'}; {state['submitted']} committed, "
                  f"{state['rejected']} refused, {state.get('pending', 0)} challenge(s) in flight")
    if state.get("last_error"):
        console.print(f"[yellow]last error: {shown(state['last_error'])}[/]")
    table("latest submissions", ["epoch", "type", "height", "code", "log"],
          [[s.get("epoch"), s.get("type"), s.get("height"), s.get("code"), str(s.get("log", ""))[:80]]
           for s in recent])
