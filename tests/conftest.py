"""Shared pytest fixtures."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

# -- PostgreSQL (state store) ----------------------------------------------------------------------
# `pg_url`: a SQLAlchemy URL of the test server (env PLANETSERVE_TEST_PG, written to
# build/postgres.url by scripts/postgres.sh) whose search_path is a fresh schema of its own, dropped
# after the test, so tests never see each other's data. Without the variable a test marked
# `postgres` (or using `pg_url`) is skipped, except under CI (CI=true), where it fails.

PG_ENV = "PLANETSERVE_TEST_PG"


def _pg_base_url() -> str:
    url = os.environ.get(PG_ENV, "").strip()
    if url:
        return url
    reason = f"{PG_ENV} is not set (run scripts/postgres.sh, then export {PG_ENV}=$(cat build/postgres.url))"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"PostgreSQL tests cannot be skipped under CI=true: {reason}", pytrace=False)
    pytest.skip(reason)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Tests marked `postgres` skip (or, under CI, fail) without a server, fixture or not."""
    if item.get_closest_marker("postgres") is not None:
        _pg_base_url()


@pytest.fixture
def pg_url() -> Iterator[str]:
    from sqlalchemy import create_engine, text

    from planetserve.chain.abci.store import normalise_url

    base = normalise_url(_pg_base_url())
    schema = f"t_{uuid.uuid4().hex[:16]}"
    admin = create_engine(base)
    try:
        with admin.begin() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
        url = base.update_query_dict({"options": f"-csearch_path={schema}"})
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.begin() as conn:
            conn.execute(text("SET LOCAL lock_timeout = '20s'"))  # a store left open must not hang
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()


# -- end PostgreSQL --------------------------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist each worker draws its network ports from its own share of the range, so two
    workers never both hand out a port that neither has bound yet."""
    from planetserve.genesis.network import PORTS_ENV, port_range

    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not worker.startswith("gw") or not count or os.environ.get(PORTS_ENV, "").strip():
        return
    low, high = port_range()
    share = (high - low + 1) // int(count)
    start = low + int(worker.removeprefix("gw")) * share
    os.environ[PORTS_ENV] = f"{start}-{start + share - 1}"


@pytest.fixture(scope="session", autouse=True)
def data_directory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The default data directory (where a built corpus is kept) is the session's own folder, shared
    with the processes tests start, never the user's; a developer may point PLANETSERVE_DATA at one
    that lasts."""
    from planetserve.models import DATA_ENV

    if os.environ.get(DATA_ENV, "").strip():
        yield
        return
    os.environ[DATA_ENV] = str(tmp_path_factory.mktemp("data"))
    try:
        yield
    finally:
        del os.environ[DATA_ENV]


from modelfix import deep_gt, quick_family  # noqa: E402,F401  (session fixtures: the quick model family)
from relaystandin import relay  # noqa: E402,F401  (a stand-in for a user relay's endpoint)
