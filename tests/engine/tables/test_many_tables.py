"""A snapshot of many federated tables: its start reads every table's definition (shape and extras)
at the source in a few statements, whatever the number of tables (read one by one, 200 tables were
four statements each: ~2 s before the first row moved), and each table still gets its own
definition: the sink's tables are the source's, with their rows."""

from __future__ import annotations

import psycopg2
import psycopg2.extensions

from airflow_provider_lr.engine.tables.definition import TableName, read_definitions
from airflow_provider_lr.engine.tables.registry import federated_tables
from airflow_provider_lr.engine.tables.snapshot import SinkSide, TableSnapshot
from airflow_provider_lr.engine.vocabulary import SessionKey
from tests.support.session import apply, empty_provider, replicator
from tests.support.tables import federate, rows, sync

TABLES = 24


class Counting(psycopg2.extensions.cursor):
    """A cursor that counts the statements it sends (``sent``: by every such cursor)."""

    sent = 0

    def execute(self, query, vars=None):  # noqa: A002 - psycopg2's name
        Counting.sent += 1
        return super().execute(query, vars)


def _create(site) -> None:
    """TABLES tables of different shapes: table i has i % 3 extra columns, a default of its own, a
    UNIQUE constraint and an index named after it, and i rows."""
    statements = []
    for i in range(TABLES):
        extra = "".join(f", c{c} int" for c in range(1, i % 3 + 1))
        statements += [
            f"CREATE TABLE public.t{i} (id serial PRIMARY KEY, v int NOT NULL DEFAULT {i}, "
            f"u text CONSTRAINT t{i}_u UNIQUE{extra})",
            f"CREATE INDEX t{i}_by_v ON public.t{i} (v)",
            f"INSERT INTO public.t{i} (v, u) SELECT g, 'u' || g FROM generate_series(1, {i}) g",
        ]
    site.query("; ".join(statements))


def test_a_snapshot_of_many_tables_reads_their_definitions_in_a_few_statements_and_copies_each(lr_sites):
    source, sink, _ = lr_sites
    topo = apply(lr_sites, [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}])
    _create(source)
    for i in range(TABLES):
        federate(source, f"public.t{i}")
    conn = psycopg2.connect(source.dsn, cursor_factory=Counting)
    sink_conn = sink.connect()
    try:
        tables = federated_tables(conn, "policy")
        conn.rollback()
        assert len(tables) == TABLES
        Counting.sent = 0
        snapshot = TableSnapshot(
            conn, "policy", [SinkSide(SessionKey("site-a", "site-b", "policy"), sink_conn, 1, tables)]
        )
        snapshot.open()
        executed = Counting.sent
        snapshot.close()
        assert executed <= 8, f"the snapshot's start sent {executed} statements for {TABLES} tables"
        for i in range(TABLES):
            definition = snapshot.definitions[TableName("public", f"t{i}")]
            assert definition.column_names == ["id", "v", "u"] + [f"c{c}" for c in range(1, i % 3 + 1)]
            assert definition.extras is not None, f"t{i} without its extras"
            assert [x.name for x in definition.extras.indexes] == [f"t{i}_by_v"]
            assert [name for name, _ in definition.extras.constraints] == [f"t{i}_u"]
            assert definition.extras.columns[1].expression == str(i)
        with conn.cursor() as cur:
            none = read_definitions(cur, [TableName("public", "t0"), TableName("public", "gone")], extras=True)
        conn.rollback()
        assert none[TableName("public", "gone")] is None and none[TableName("public", "t0")] is not None
    finally:
        conn.close()
        sink_conn.close()
    sync(replicator(topo, lr_sites, providers={"policy": empty_provider}))
    for i in range(TABLES):
        assert rows(sink, f"public.t{i}") == rows(source, f"public.t{i}"), f"t{i}"
    created = sink.query("SELECT indexname FROM pg_catalog.pg_indexes WHERE schemaname = 'public'")
    assert {f"t{i}_by_v" for i in range(TABLES)} <= {name for (name,) in created}
