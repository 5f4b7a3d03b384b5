"""Another local account, for the tests of what a file or socket mode keeps out: the test process
(running as root) forks a child that drops to nobody and tries. Where the suite does not run as root
these tests are skipped (`as_root`)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="the unprivileged adversary is this process dropping "
                                                       "root for nobody (uid 65534), which only root can do")


def as_nobody(attempt: Callable[[], str]) -> str:
    """What `attempt` returns in a child process that dropped root for nobody (uid and gid 65534, no
    supplementary groups): a real unprivileged local process. Forked, not run from a program file: the
    interpreter may sit where nobody can read it (a root user's pyenv)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        outcome = "child failed"
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            outcome = attempt()
        except Exception as exc:  # reported to the parent; the child exits whatever happens
            outcome = f"{type(exc).__name__}: {exc}"
        finally:
            os.write(write, outcome.encode())
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        outcome = pipe.read().decode()
    os.waitpid(pid, 0)
    return outcome


@contextmanager
def shared_directory(prefix: str) -> Iterator[Path]:
    """A directory in the system's temporary one: short (pytest's paths can come near the 100 bytes a
    socket's path may take) and open for others to traverse (pytest's are root's alone), so that only
    what a test makes inside it stands between the adversary and what it holds."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path)
