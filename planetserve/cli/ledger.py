"""Options and connection shared by the commands that talk to a running chain."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from planetserve.chain.client import LedgerClient
from planetserve.chain.rpc import RpcClient
from planetserve.cli import http_url, max_age_option, witness_option

DEFAULT_NODE = "http://127.0.0.1:26657"


def ledger_options(verify: bool, required: bool = True) -> Callable:
    """Add --node (and, to verify, --genesis/--no-verify/--witness/--max-age) and pass a ready
    LedgerClient as `ledger`. Without `required` (transactions), no genesis file means no verification:
    the endpoint's word is taken, as it always was for them."""

    def decorate(fn: Callable) -> Callable:
        @click.option("--node", envvar="PLANETSERVE_NODE", default=DEFAULT_NODE, show_default=True,
                      callback=lambda _c, _p, value: http_url(value, "--node"),
                      help="A validator's CometBFT RPC endpoint (env PLANETSERVE_NODE); `genesis init` "
                           "prints each validator's.")
        @functools.wraps(fn)
        def wrapper(*args: Any, node: str, genesis: Path | None = None, no_verify: bool = False,
                    min_height: int = 0, witness: str = "", max_age: float | None = None,
                    **kwargs: Any) -> Any:
            from planetserve.cli import fail

            rpc = RpcClient(node)
            verifier = None
            if verify and not no_verify and (genesis is not None or required):
                if genesis is None:
                    fail("--genesis is required to verify answers (or pass --no-verify to trust the node)")
                if witness and witness == node:
                    fail(f"--witness must be another endpoint than --node ({node}): a witness checks the "
                         "node's answers, so it cannot be the node itself")
                from planetserve.chain.lightclient import LightClient, VerificationError

                try:
                    verifier = LightClient.from_genesis_file(genesis, rpc, max_age=max_age,
                                                             witness=RpcClient(witness) if witness else None)
                except VerificationError as exc:
                    fail(f"{genesis} is not a usable genesis file: {exc}")
            with rpc:
                return fn(*args, ledger=LedgerClient(rpc, verifier, min_height), **kwargs)

        if verify:
            wrapper = max_age_option()(wrapper)
            wrapper = witness_option("--node")(wrapper)
            if required:
                wrapper = click.option("--min-height", type=click.IntRange(min=0), default=0,
                                       help="Read state of this height or later, e.g. the height a "
                                            "transaction was committed in (waits for it).")(wrapper)
            wrapper = click.option("--no-verify", is_flag=True,
                                   help="Trust the RPC endpoint instead of verifying its answers.")(wrapper)
            wrapper = click.option("--genesis", envvar="PLANETSERVE_GENESIS",
                                   type=click.Path(exists=True, dir_okay=False, path_type=Path),
                                   help="Genesis file that answers are verified against "
                                        "(env PLANETSERVE_GENESIS)." + ("" if required else
                                        " A transaction's sequence and outcome are then checked against "
                                        "verified headers (one block more); without it, the endpoint's "
                                        "word is taken."))(wrapper)
        return wrapper

    return decorate
