"""An RPC endpoint, or whoever wrote a ledger field, that puts rich markup and terminal control sequences
into what the `planetserve` command prints for people. Before, `[/]` in a moniker, a fault's detail or an
endpoint's error ended the command with rich's MarkupError (a traceback instead of the answer), other
markup restyled the output, and escape sequences reached the terminal raw: OSC 52 writes the clipboard,
a bidi override reorders what follows it. Now such text is printed as it is, with those characters
written as Python escapes."""

from __future__ import annotations

import base64
import io
import subprocess
import sys

import pytest
from click.testing import CliRunner
from lyingrpc import json_answer, json_error, lying_endpoint
from rich.console import Console

from planetserve.chain import layout
from planetserve.cli import console, main, shown
from planetserve.registry import codec
from planetserve.registry.epochs import Fault

CLIPBOARD = "\x1b]52;c;cm0gLXJmIH4=\x07"
"""OSC 52: sets the clipboard (here to `rm -rf ~`) on terminals that allow it."""
HOSTILE = f"[/]x[bold red]ok[/bold red]{CLIPBOARD}\u202egnp.exe\x9b2J"
"""Markup that would end or restyle the output, the clipboard write, a right-to-left override and an
8-bit CSI (which a field that refuses only characters below 32 lets through)."""
RAW = ("\x1b", "\x07", "\u202e", "\x9b")


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    """Tables at full width, so that a long cell is one line to look for."""
    monkeypatch.setattr(console, "width", 1000)


def printed(*args: str, code: int) -> str:
    """What the command printed for people, stdout and stderr; it must end with exit code `code` and
    not with an exception of its own."""
    result = CliRunner().invoke(main, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == code, result.output
    return result.output


def assert_shown_as_it_is(output: str) -> None:
    assert "[/]x[bold red]ok[/bold red]" in output
    assert "\\x1b]52;c;cm0gLXJmIH4=\\x07" in output and "\\u202egnp.exe\\x9b2J" in output
    assert not any(ch in output for ch in RAW)


def status_answer(text: str) -> dict:
    return {"node_info": {"network": text, "moniker": text},
            "sync_info": {"latest_block_height": "7", "latest_app_hash": "AB" * 32,
                          "latest_block_time": "2026-11-29T00:00:00Z", "catching_up": False,
                          "earliest_block_height": "1"}}


def test_an_endpoints_status_is_printed_as_it_is():
    with lying_endpoint() as endpoint:
        endpoint.by_method["status"] = json_answer(status_answer(HOSTILE))
        endpoint.by_method["abci_info"] = json_answer({"response": {"app_version": "1", "data": HOSTILE}})
        output = printed("query", "status", "--node", endpoint.url, code=0)
    assert_shown_as_it_is(output)
    assert "height" in output and "7" in output


def test_a_ledger_fields_markup_and_control_characters_are_printed_as_they_are():
    """A fault's detail is text a leader wrote on the ledger (up to 256 characters, none below 32): a
    table of faults shows it as it is."""
    operator = bytes(range(32))
    fault = Fault(operator, 3, "bad-report", bytes(32), HOSTILE)
    prefix = layout.fault_prefix()
    entry = layout.fault_key(operator, 3, 0).removeprefix(prefix)
    answer = {"response": {"code": 0, "height": "7", "key": base64.b64encode(prefix).decode(),
                           "value": base64.b64encode(codec.pack([[entry, fault.encode()]])).decode()}}
    with lying_endpoint() as endpoint:
        endpoint.answers.append(json_answer(answer))
        output = printed("query", "faults", "--no-verify", "--node", endpoint.url, code=0)
    assert "bad-report" in output
    assert_shown_as_it_is(output)


@pytest.mark.parametrize("command", [["query", "params", "--no-verify"], ["query", "status"]])
def test_an_endpoints_error_is_printed_as_it_is(command):
    with lying_endpoint() as endpoint:
        endpoint.answers.append(json_error(HOSTILE))
        output = printed(*command, "--node", endpoint.url, code=1)
    assert output.startswith("error:")
    assert_shown_as_it_is(output)


@pytest.mark.parametrize(("text", "expected"), [
    ("plain [text] [/] ok", "plain [text] [/] ok"),
    ("tab\tline\nend", "tab\\tline\\nend"),
    ("\u200bzero width\u2028", "\\u200bzero width\\u2028"),
    ("ends in a backslash \\", "ends in a backslash \\\\"),  # doubled, so markup after it stays markup
    ("a backslash before markup \\[bold]", "a backslash before markup \\[bold]"),
    ("accents é ü 中文 stay", "accents é ü 中文 stay"),
])
def test_what_is_shown_prints_as_it_is_with_hidden_characters_as_escapes(text, expected):
    out = io.StringIO()
    Console(file=out, width=1000, highlight=False).print(shown(text))
    assert out.getvalue() == expected + "\n"


def test_a_roles_log_line_cannot_forge_lines_or_reach_the_terminal_raw():
    """A long-running role logs what peers and endpoints said (an error's text, a refused request's
    reason): a line break there would forge a log line, an escape sequence reach the operator's
    terminal. The traceback of a logged exception keeps its lines."""
    program = ("import logging; from planetserve.cli import setup_logging; setup_logging('info')\n"
               "log = logging.getLogger('peer')\n"
               f"log.warning('said: %s', {HOSTILE + chr(10) + 'INFO forged: all is well'!r})\n"
               "try:\n    raise ValueError('boom')\nexcept ValueError:\n    log.exception('failed')\n")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60,
                          check=True)
    lines = done.stderr.splitlines()
    said = [line for line in lines if "said:" in line]
    assert len(said) == 1 and "\\nINFO forged: all is well" in said[0]
    assert not any(line.startswith("INFO forged") for line in lines)
    assert_shown_as_it_is(said[0])
    assert "Traceback (most recent call last):" in lines and "ValueError: boom" in lines
