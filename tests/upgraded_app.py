"""The next version of the planetserve app, as a process: version 2, whose migration "v2" writes a mark
into the state. `python tests/upgraded_app.py --home HOME` serves it as `planetserve chain app` does."""

from __future__ import annotations

import sys

from planetserve.chain.abci.app import Application
from planetserve.cli import main

MARK = b"upgraded/v2"


def upgrade() -> None:
    """Make this process's app the next version (only in the process that serves it: never on import)."""
    Application.VERSION = 2
    Application.MIGRATIONS = {"v2": lambda st: st.put_int(MARK, 1)}


if __name__ == "__main__":
    upgrade()
    main(["chain", "app", *sys.argv[1:]])
