"""The outbox on PostgreSQL (docs/outbox.md): psycopg 3 and SQLAlchemy connections, the relay.

Every test runs against a real PostgreSQL the suite starts itself (tests/support/postgres.py).
"""

from __future__ import annotations

import psycopg

from tests.support.postgres import PostgresServer


def test_each_test_gets_a_fresh_database_on_a_private_server(
    postgres_server: PostgresServer, pg_dsn: str
) -> None:
    assert "host=/tmp/" in pg_dsn
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'").fetchone() == (0,)
        assert conn.execute("SHOW listen_addresses").fetchone() == ("",)
    print(postgres_server.version)
