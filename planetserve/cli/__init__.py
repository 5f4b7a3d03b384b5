"""`planetserve`: one command for every role. Human-readable output by default, `--json` for programs."""

from __future__ import annotations

import json
import logging
import sys
import unicodedata
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)


def jsonable(value: Any) -> Any:
    """Bytes as hex, containers recursively: the one JSON form of ledger records."""
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


HIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Zl", "Zp"})
"""Characters a terminal acts on or hides rather than shows: controls (escape sequences, bells, line
breaks), format characters (bidi overrides, zero-width joiners), surrogates, private use, line and
paragraph separators."""


def shown(value: Any) -> str:
    """`value` as console markup that prints it as it is. Text from outside the process (a ledger
    field, an endpoint's answer or error, a peer's message) may hold rich markup, which would restyle
    the output or end the command with a MarkupError, and characters a terminal acts on (an escape
    sequence can set the clipboard or retitle the window; a bidi override reorders what follows):
    the markup is escaped and those characters are written as Python escapes."""
    return escape(visible(str(value)))


def visible(text: str) -> str:
    """`text` with the characters a terminal acts on or hides written as Python escapes."""
    return "".join(_visible(ch) for ch in text)


def _visible(ch: str) -> str:
    if unicodedata.category(ch) not in HIDDEN_CATEGORIES:
        return ch
    return ch.encode("unicode_escape", "backslashreplace").decode("ascii")


class VisibleFormatter(logging.Formatter):
    """A log line whose message, which may quote a peer, an endpoint or a request, cannot forge another
    line or send the terminal an escape sequence; a traceback keeps its lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return visible(super().formatMessage(record))


def emit_json(value: Any) -> None:
    click.echo(json.dumps(jsonable(value), indent=2, sort_keys=True))


def table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    """A table for people; a value too wide for the terminal folds onto more lines instead of being
    cut (keys and addresses are copied from here). `title` is markup; a cell is shown as it is
    (`shown`) unless it is a rich Text, styled by its maker."""
    t = Table(title=title)
    for col in columns:
        t.add_column(col, overflow="fold")
    for row in rows:
        t.add_row(*(c if isinstance(c, Text) else shown(jsonable(c)) for c in row))
    console.print(t)


def setup_logging(level: str) -> None:
    """A long-running role's own messages at `level`; the HTTP client's one line per request only when
    debugging."""
    handler = logging.StreamHandler()
    handler.setFormatter(VisibleFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler])
    if level != "debug":
        logging.getLogger("httpx").setLevel(logging.WARNING)


rpc_option = click.option(
    "--rpc", "--node", "rpc", default="http://127.0.0.1:26657", show_default=True, envvar="PLANETSERVE_NODE",
    help="A validator's CometBFT RPC endpoint, which the role reads the ledger from (env PLANETSERVE_NODE).",
)


def _witness(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    return http_url(value, "--witness") if value else ""


def _max_age(_ctx: click.Context, _param: click.Parameter, value: float) -> float:
    from planetserve.config import max_age_problem

    if (problem := max_age_problem(value)) is not None:
        raise click.BadParameter(problem.replace("max_age", "--max-age", 1))
    return value


def check_listen(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    """A HOST:PORT to serve metrics at ('' for none), refused at once when it is not one."""
    from planetserve.metrics import parse_listen

    if value:
        try:
            parse_listen(value)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None
    return value


def metrics_option() -> Any:
    """--metrics: where the role serves its Prometheus metrics."""
    return click.option(
        "--metrics", default="", callback=check_listen, metavar="HOST:PORT",
        help="Serve Prometheus metrics at http://HOST:PORT/metrics (docs/operators.md, \"Monitoring\"). "
             "Default: none.")


def witness_option(where: str = "--rpc") -> Any:
    """--witness: a second endpoint whose headers must match those read from `where`."""
    return click.option(
        "--witness", default="", envvar="PLANETSERVE_WITNESS", callback=_witness, metavar="URL",
        help=f"A second CometBFT RPC endpoint, best another operator's validator, that must agree (env "
             f"PLANETSERVE_WITNESS): each header verified from {where} is compared with the witness's header "
             f"of the same height, and a difference (a fork, or one of the two lying) is refused, as is a "
             f"witness that does not answer. Default: no witness.")


def max_age_option(default: float | None = None) -> Any:
    """--max-age: the light client's bound on the age of the latest header."""
    from planetserve.config import MAX_AGE

    return click.option(
        "--max-age", type=float, default=MAX_AGE if default is None else default, show_default=True,
        callback=_max_age, metavar="SECONDS",
        help="Refuse the ledger's latest state when its signed header is older than this many seconds by "
             "this machine's clock (or more than 10 s ahead of it): an endpoint that is behind, replays old "
             "answers or serves a halted chain cannot keep a role on an old list, which a long-running role "
             "drops once it is this old. Keep it well above the block interval (about 1 s); the default "
             "leaves a margin for failed rounds and clock error.")


def log_level_option(default: str = "info") -> Any:
    """--log-level of a long-running role (its messages go to stderr)."""
    return click.option("--log-level", default=default, show_default=True,
                        type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
                        help="The least important messages shown (debug adds every HTTP request).")


def _keep_heights(_ctx: click.Context, _param: click.Parameter, value: int | None) -> int | None:
    from planetserve.chain.abci.store import check_keep_heights

    try:
        return None if value is None else check_keep_heights(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def keep_heights_option(default: int | None = 0, where: str = "") -> Any:
    """--keep-heights, checked as the state store checks it; `where` adds where the default comes from."""
    return click.option(
        "--keep-heights", type=int, default=default, show_default=default is not None, callback=_keep_heights,
        help="Recent heights whose state stays provable; trie nodes that only older heights used are "
             "deleted. 0 keeps every height (an archive, whose database grows by the trie paths each block "
             "replaces); at least 2 otherwise." + where)


DB_ENV = "PLANETSERVE_DB"


def _db_urls(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """--db, refused on the command line when a URL holds a password: every local account reads a
    process's arguments (/proc/PID/cmdline), not its environment."""
    from planetserve.chain.abci.store import carries_password

    urls = value if isinstance(value, tuple) else (value,) if value else ()
    if ctx.get_parameter_source(param.name or "") is ParameterSource.COMMANDLINE and any(
            carries_password(url) for url in urls):
        raise click.BadParameter(f"a database URL holding a password would be readable by every local "
                                 f"account in the process list: give it in the environment variable {DB_ENV} "
                                 "instead")
    return value


def db_option(help_text: str, *, multiple: bool = False, default: str | None = None) -> Any:
    """--db (env PLANETSERVE_DB; several URLs there are separated by spaces)."""
    return click.option("--db", "db_urls" if multiple else "db", multiple=multiple, default=default,
                        metavar="URL", envvar=DB_ENV, callback=_db_urls,
                        help=f"{help_text} A URL with a password goes in the environment variable {DB_ENV}, "
                             "not on the command line.")


EXIT_NOT_FOUND = 3
"""A query found no such entity."""
EXIT_REFUSED = 4
"""The chain refused a transaction (its numbered code is printed)."""


def fail(message: str, code: int = 1) -> None:
    """Print `message` (which may quote an endpoint, a file or the ledger: shown as it is, its own line
    breaks kept) and exit with `code`."""
    lines = "\n".join(shown(line) for line in message.split("\n"))
    err_console.print(f"[bold red]error:[/] {lines}")
    sys.exit(code)


def check_genesis(path: Path) -> Path:
    """`path` if it is a genesis file a light client can start from; otherwise a clear error now,
    not when the role first reads the ledger."""
    from planetserve.chain.lightclient import Genesis, VerificationError

    try:
        Genesis.from_file(path)
    except VerificationError as exc:
        fail(f"{path} is not a usable genesis file: {exc}")
    return path


def http_url(text: str, what: str) -> str:
    """An http(s) URL without its trailing slash, or click.BadParameter naming `what`."""
    from planetserve.config import is_http_url

    if not is_http_url(text):
        raise click.BadParameter(f"{what} must be an http:// URL such as http://127.0.0.1:26657, "
                                 f"got {text!r}")
    return text.rstrip("/")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="planetserve")
def main() -> None:
    """Decentralized, privacy-preserving LLM serving on a CometBFT verification ledger.

    \b
    Roles:
      validator   genesis init, chain start   (committee institutions)
      anyone      keys, tx, query             (organisations, users, clients)
      model node  models train, node init-model, node model   (organisations)
      user        node init-user, node user   (anonymous OpenAI endpoint, relays for others)
      verifier    verifier init, verifier run (beside each validator)
      developer   localnet up|down|status     (the whole system on this machine)
      anyone      dashboard                   (a live web page of a network: ledger, nodes, overlay)
      validator   chain init, chain app       (join a running network; the ABCI app alone)

    
    Exit codes: 0 done; 1 failed (the message says why); 2 wrong usage;
    3 not found (query); 4 refused by the chain (tx: the code and reason are printed).
    """


def _register() -> None:
    from planetserve.cli import (
        chain_cmd,
        dashboard_cmd,
        genesis_cmd,
        keys_cmd,
        localnet_cmd,
        models_cmd,
        node_cmd,
        query_cmd,
        tx_cmd,
        verifier_cmd,
    )

    for module in (keys_cmd, genesis_cmd, chain_cmd, tx_cmd, query_cmd, localnet_cmd, models_cmd, node_cmd,
                   verifier_cmd):
        main.add_command(module.group)
    main.add_command(dashboard_cmd.command)


_register()
