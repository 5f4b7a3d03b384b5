"""`planetserve genesis`: build validator homes and a shared genesis."""

from __future__ import annotations

import re
from pathlib import Path

import click
from click.core import ParameterSource

from planetserve.chain.abci.store import masked_url
from planetserve.cli import console, db_option, emit_json, fail, keep_heights_option, table
from planetserve.genesis.committee import ModelSpec, app_state_builder
from planetserve.genesis.export import ExportError, registry_of
from planetserve.genesis.network import NetworkBuildError, build_network
from planetserve.registry.credits import CREDIT_SECONDS
from planetserve.registry.entities import Model
from planetserve.registry.errors import RegistryError
from planetserve.registry.genesis import (
    MAX_GENESIS_CREDITS,
    GenesisOrganisation,
    model_json,
    parse_models,
    parse_organisations,
)

_NUMBER = re.compile(r"[0-9]+")
_KEY_HEX = re.compile(r"[0-9a-fA-F]{64}")
MAX_ORG_CREDITS = MAX_GENESIS_CREDITS // CREDIT_SECONDS


def parse_models_option(values: tuple[str, ...]) -> list[ModelSpec]:
    """`--model ID=NAME` or `ID=NAME:LAYERS:LAYER_MIB`; a name may hold colons unless it ends in two
    colon-separated numbers, which are read as the size."""
    models: list[ModelSpec] = []
    for value in values:
        model_id, sep, name = value.partition("=")
        if not sep or not model_id or not name:
            raise click.BadParameter(f"{value!r}: expected MODEL_ID=NAME or MODEL_ID=NAME:LAYERS:LAYER_MIB",
                                     param_hint="--model")
        head, *size = name.rsplit(":", 2)
        spec: ModelSpec = (model_id, name)
        if len(size) == 2 and all(_NUMBER.fullmatch(n) for n in size):
            if not head:
                raise click.BadParameter(f"{value!r}: the model needs a name before :LAYERS:LAYER_MIB",
                                         param_hint="--model")
            spec = (model_id, head, int(size[0]), int(size[1]))
        try:
            parse_models([model_json(Model(spec[0], spec[1], 0, *spec[2:]))])
        except RegistryError as exc:
            raise click.BadParameter(f"{value!r}: {exc}", param_hint="--model") from exc
        models.append(spec)
    return models


def parse_orgs_option(values: tuple[str, ...]) -> list[GenesisOrganisation]:
    """`--org ORG_ID=OWNER_KEY_HEX[:CREDITS]`, CREDITS in whole credits (default 0)."""
    orgs = []
    for value in values:
        org_id, sep, rest = value.partition("=")
        owner, colon, amount = rest.partition(":")
        if not sep or not org_id or not owner:
            raise click.BadParameter(f"{value!r}: expected ORG_ID=OWNER_KEY_HEX[:CREDITS]",
                                     param_hint="--org")
        if not _KEY_HEX.fullmatch(owner):
            raise click.BadParameter(f"{value!r}: the owner must be a public key of 64 hex characters "
                                     "(see `planetserve keys show`)", param_hint="--org")
        if colon and not (_NUMBER.fullmatch(amount) and int(amount) <= MAX_ORG_CREDITS):
            raise click.BadParameter(f"{value!r}: CREDITS must be a whole number of credits in "
                                     f"0..{MAX_ORG_CREDITS}", param_hint="--org")
        org = GenesisOrganisation(org_id, org_id, bytes.fromhex(owner),
                                  int(amount) * CREDIT_SECONDS if colon else 0)
        try:
            parse_organisations([org.to_json()])
        except RegistryError as exc:
            raise click.BadParameter(f"{value!r}: {exc}", param_hint="--org") from exc
        orgs.append(org)
    return orgs


@click.group("genesis")
def group() -> None:
    """Create the genesis file and validator homes of a new network."""


@group.command("init")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--validators", "-n", default=4, show_default=True, help="Number of validators.")
@click.option("--chain-id", default="planetserve-local", show_default=True,
              help="The network's name; every transaction is signed for it. Required with --from-export, "
                   "and other than the exported chain's.")
@click.option("--model", "models", multiple=True, metavar="ID=NAME[:LAYERS:LAYER_MIB]",
              help="A model registered at genesis (repeatable). Add :LAYERS:LAYER_MIB to declare its size "
                   "(number of layers, MiB per layer), so that deployments on nodes too small to hold it "
                   "whole are split into layer pipelines; e.g. llama-70b=\"Llama 3 70B\":80:1700.")
@click.option("--org", "orgs", multiple=True, metavar="ORG_ID=OWNER_KEY_HEX[:CREDITS]",
              help="An organisation that exists from genesis (repeatable), named ORG_ID and owned by the "
                   "64-hex public key OWNER_KEY_HEX (the `identity` of `planetserve keys show`), which can "
                   "then register its model nodes and deploy; CREDITS whole credits (default 0) are its "
                   "starting balance.")
@click.option("--credential", default="{moniker}: founding committee member", show_default=True,
              help="Credential text of each founding member; {moniker} is replaced.")
@click.option("--timeout-commit", default="1s", show_default=True, help="CometBFT timeout_commit.")
@db_option("Database URL per validator, in order (default: SQLite in each home).", multiple=True)
@keep_heights_option()
@click.option("--from-export", "from_export", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Start from the registry (accounts, organisations, users, models, model nodes, "
                   "reputations, credits, deployments) of a genesis that `planetserve chain export` wrote; "
                   "the committee and its epochs begin afresh. Name the new network with --chain-id, other "
                   "than the exported chain's: accounts keep their sequences, so under the old name each "
                   "chain would take the other's transactions.")
@click.option("--json", "as_json", is_flag=True, help="Print the validators' homes and ports as JSON.")
def init(out: Path, validators: int, chain_id: str, models: tuple[str, ...], orgs: tuple[str, ...],
         credential: str, timeout_commit: str, db_urls: tuple[str, ...], keep_heights: int,
         from_export: Path | None, as_json: bool) -> None:
    """Create OUT/v0..v{N-1}: CometBFT homes with one genesis whose committee is the N validators.

    \b
    Example:
      planetserve genesis init /tmp/net -n 4 --model gt="planetserve reference model"
      planetserve genesis init /tmp/net --model gt=Reference:32:400 --org acme=<identity hex>:5000
    """
    if db_urls and len(db_urls) != validators:
        fail(f"--db given {len(db_urls)} times for {validators} validators")
    named = click.get_current_context().get_parameter_source("chain_id") is not ParameterSource.DEFAULT
    if from_export and not named:
        fail("--from-export needs --chain-id: the new network must be named apart from the exported chain "
             "and from any other network started from the same export, whose transactions it would "
             "otherwise take")
    try:
        exported = registry_of(from_export, chain_id) if from_export else ()
    except ExportError as exc:
        fail(str(exc))
    try:
        builder = app_state_builder(parse_models_option(models), credential=credential,
                                    organisations=parse_orgs_option(orgs), exported=exported)
    except RegistryError as exc:
        raise click.UsageError(str(exc)) from exc
    try:
        spec = build_network(
            out, validators, chain_id, builder,
            timeout_commit=timeout_commit, db_urls=db_urls or None, keep_heights=keep_heights,
        )
    except NetworkBuildError as exc:
        fail(str(exc))
    if as_json:
        emit_json({"chain_id": spec.chain_id, "genesis": str(spec.genesis_path),
                   "validators": [{**v.to_json(), "db_url": masked_url(v.db_url)} for v in spec.validators]})
        return
    console.print(f"network [bold]{chain_id}[/] created under {out}")
    table("validators", ["moniker", "home", "rpc", "p2p", "abci", "metrics (cometbft, app)"],
          [[v.moniker, v.home, v.rpc_url, v.ports.p2p, v.abci_listen,
            f"{v.ports.cometbft_metrics}, {v.ports.app_metrics}"] for v in spec.validators])
    console.print("start each validator (ABCI app and CometBFT, until interrupted):")
    for v in spec.validators:
        console.print(f"  planetserve chain start --home {v.home}", soft_wrap=True)
    console.print("then point the client commands at one of them:")
    console.print(f"  export PLANETSERVE_NODE={spec.validators[0].rpc_url}", soft_wrap=True)
    console.print(f"  export PLANETSERVE_GENESIS={spec.genesis_path}", soft_wrap=True)
