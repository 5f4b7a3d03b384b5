"""Validators on SQLite and on PostgreSQL in one network reach identical app hashes."""

from __future__ import annotations

import uuid

import pytest
from chainnet import assert_same_app_hashes, ledger, start_network
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from planetserve.chain.keys import KeySet
from planetserve.chain.messages import RegisterOrg, RegisterUser

pytestmark = [pytest.mark.network, pytest.mark.postgres]


def test_sqlite_and_postgres_validators_agree(tmp_path, pg_url):
    base = make_url(pg_url)
    second = f"t_{uuid.uuid4().hex[:16]}"
    admin = create_engine(base.set(query={}))
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{second}"'))
    try:
        pg2 = base.update_query_dict({"options": f"-csearch_path={second}"}).render_as_string(hide_password=False)
        urls = [f"sqlite:///{tmp_path / 'v0.db'}", pg_url, f"sqlite:///{tmp_path / 'v2.db'}", pg2]
        with start_network(tmp_path / "net", db_urls=urls) as net:
            client = ledger(net, 1)
            for i in range(6):
                user = KeySet.generate()
                registration = RegisterUser(f"127.0.0.1:{9000 + i}", "eu" if i % 2 else "us")
                assert client.submit(user, registration).outcome.code == 0
            owner = KeySet.generate()
            assert client.submit(owner, RegisterOrg("pg-org", "PG")).outcome.code == 0
            top = client.rpc.latest_height()
            assert_same_app_hashes(net, top)
            _, users = ledger(net, 3).users()
            assert len(users) == 6
        with admin.connect() as conn:  # the PostgreSQL validators really kept their state there
            rows = conn.execute(text(f'SELECT count(*) FROM "{second}".state_kv')).scalar()  # noqa: S608
        assert rows >= 7
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{second}" CASCADE'))
        admin.dispose()
