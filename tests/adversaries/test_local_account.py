"""Another account on a validator's or a member's machine, reading what planetserve leaves readable: the
digests of the challenges a member has sent (`used_prompts`, 0644 in a 0755 home: with them a model node
operator holding a shell account on a member's host recognised every challenge by hashing its prompts),
a database password in a long-running process's arguments (/proc/PID/cmdline is every account's), and a
secret rewritten in place into a file it had opened while that file was readable."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner
from nobody import as_nobody, as_root, shared_directory

from planetserve.chain.abci.store import carries_password, masked_url
from planetserve.chain.keys import write_private
from planetserve.cli import main
from planetserve.verifier.challenges import ChallengeSource, prompt_digest
from planetserve.verifier.config import VerifierConfig


def reads(path: Path) -> str:
    def attempt() -> str:
        try:
            return path.read_text()
        except PermissionError:
            return "denied"

    return as_nobody(attempt)


@as_root
def test_another_account_cannot_read_the_challenges_a_member_has_sent():
    with shared_directory("ps-ver-") as root:
        home = root / "verifier"
        VerifierConfig(rpc="http://127.0.0.1:26657", genesis="genesis.json", keys="keys.json").save(home)
        source = ChallengeSource(used_file=home / "used_prompts")
        drawn = source.draw(3)
        digests = (home / "used_prompts").read_text().split()
        assert digests == [prompt_digest(c.text) for c in drawn]
        assert reads(home / "used_prompts") == "denied"
        assert home.stat().st_mode & 0o777 == 0o700 and (home / "used_prompts").stat().st_mode & 0o777 == 0o600
        home.chmod(0o755)  # an older home: the file alone keeps them out
        assert reads(home / "used_prompts") == "denied"


@as_root
def test_a_journal_left_readable_by_an_older_version_is_closed_at_its_next_entry():
    with shared_directory("ps-ver-") as root:
        used = root / "used_prompts"
        used.write_text("")
        used.chmod(0o644)
        ChallengeSource(used_file=used).draw(1)
        assert used.stat().st_mode & 0o777 == 0o600 and reads(used) == "denied"


@as_root
def test_a_secret_rewritten_into_a_file_once_readable_does_not_reach_an_earlier_reader():
    """The adversary opened the file while it was readable and keeps the descriptor; the new text goes
    to a new 0600 file that replaces it, so the descriptor still shows only the old text."""
    with shared_directory("ps-key-") as root:
        path = root / "planetserve.json"
        path.write_text('{"db": "old"}')
        path.chmod(0o644)
        ready_read, ready_write = os.pipe()
        go_read, go_write = os.pipe()

        def attempt() -> str:
            with path.open() as held:
                os.write(ready_write, b"1")
                os.read(go_read, 1)
                return held.read()

        held: dict[str, str] = {}
        reader = threading.Thread(target=lambda: held.setdefault("text", as_nobody(attempt)))
        reader.start()
        os.read(ready_read, 1)
        write_private(path, '{"db": "postgresql://ps:N3WPW@db/state"}')
        os.write(go_write, b"1")
        reader.join(30)
        assert held["text"] == '{"db": "old"}'
        assert path.stat().st_mode & 0o777 == 0o600 and reads(path) == "denied"


def test_a_database_password_is_refused_on_the_command_line_and_taken_from_the_environment(tmp_path):
    url = "postgresql+psycopg://ps:s3cret@127.0.0.1:1/state"
    home = tmp_path / "home"
    (home / "config").mkdir(parents=True)
    refused = CliRunner().invoke(main, ["chain", "app", "--home", str(home), "--db", url])
    assert refused.exit_code == 2 and "environment variable PLANETSERVE_DB" in refused.output
    assert "s3cret" not in refused.output


@pytest.mark.parametrize("url", ["postgresql+psycopg://ps:s3cret@db:notaport/state", "postgresql://ps:s3cret@[::1/x"])
def test_a_database_url_that_does_not_parse_is_shown_without_its_password(url):
    assert "s3cret" not in masked_url(url) and masked_url(url).startswith("postgresql")
    assert carries_password(url)
    assert not carries_password("postgresql+psycopg://ps@db/state") and not carries_password("/srv/state.db")
