"""A stream's sink transactions on one connection read their tables' targets ahead, with their first
statement (``tables.targets``): whatever changes between two of them at the sink (the table's
definition, its ``lr.sink_tables`` row, its origins) the next one applies exactly as a transaction
that looked the target up from scratch."""

from __future__ import annotations

import json

import psycopg2.errors
import pytest

from airflow_provider_lr.engine.errors import ApplyError, ConfigurationError, SchemaMismatchError
from airflow_provider_lr.engine.sink import stream_batch, writes
from airflow_provider_lr.engine.source.log_reader import LogBatch, LogRecord
from airflow_provider_lr.engine.tables import registry
from airflow_provider_lr.engine.tables.definition import TableName
from airflow_provider_lr.engine.tables.sink import TableState
from airflow_provider_lr.engine.tables.targets import Gone, target_of
from tests.support.session import apply, replicator
from tests.support.tables import create_accounts, federate, rows, sync

ACCOUNTS = TableName("public", "accounts")


class Stream:
    """The sink end of site-a's stream into ``sink``: each ``change`` is one sink transaction on the
    same connection, as a stream's are: by the general path (``apply_log_stream``), or the way a
    stream writes a session it wrote before (``stream_batches``, composed from the targets the last
    transaction read, and the general path when it declines)."""

    def __init__(self, sink, path: str) -> None:
        self.sink, self.path = sink, path
        self.fast: list[bool] = []  # per change: it went in the stream's one round trip
        self.conn = sink.connect()
        self.conn.autocommit = True  # as a stream's sink connection
        self.tids = dict(sink.query("SELECT table_name, source_table_id FROM lr.sink_tables"))
        self.tid = self.tids["public.accounts"]
        self.base, self.last, self.epoch = sink.query(
            "SELECT snapshot_applied, last_log_entry_processed, lease_epoch FROM lr.sink_sessions "
            "WHERE source_site_id = 'site-a'"
        )[0]
        self.applied: list = []  # each transaction's ChangeApplier

    def change(self, op: str, *rows: dict, table: str = "public.accounts") -> None:
        """One source transaction's change of ``table``, applied in a sink transaction."""
        message = json.dumps({"op": op, "rows": list(rows)}).encode()
        batch = LogBatch(self.last, self.last + 1, [LogRecord(self.last + 1, 1, message, self.tids[table])])
        if self.path == "stream":
            (end,) = stream_batch.stream_batches(
                self.conn, "site-a", [stream_batch.StreamWrite("policy", self.epoch, batch, self.base)]
            )
            self.fast.append(end is not None)
            if end is not None:
                self.last = end
                return
            assert self.sink.query("SELECT last_log_entry_processed FROM lr.sink_sessions") == [(self.last,)]
        self.last = writes.apply_log_stream(self.conn, "site-a", "policy", self.epoch, batch, self.base)

    def target(self):
        """The target the last transaction applied with."""
        return self.applied[-1].targets[self.tid]

    def fresh_target(self):
        """The target as looked up from scratch (the sink_tables row, the definition, the origin)."""
        state = self.sink.query(
            "SELECT state FROM lr.sink_tables WHERE source_site_id = 'site-a' AND source_table_id = %s", (self.tid,)
        )
        if not state or state[0][0] == TableState.CONFLICT:
            return None
        conn = self.sink.connect()
        try:
            with conn.cursor() as cur:
                return target_of(cur, "site-a", ACCOUNTS, lambda: "fresh")
        finally:
            conn.close()

    def close(self) -> None:
        self.conn.close()


def row(id_: int, owner: str = "o", **more) -> dict:
    return {"id": id_, "owner": owner, "balance": 1, "tags": None, "note": None, "updated_at": None, **more}


@pytest.fixture(params=["general", "stream"])
def stream(lr_sites, monkeypatch, request):
    source, sink, _ = lr_sites
    topo = apply(lr_sites, [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}])
    create_accounts(source, rows=10)
    federate(source)
    source.query("CREATE TABLE public.orders (id int PRIMARY KEY, item text)")
    federate(source, "public.orders")
    repl = replicator(topo, lr_sites)
    sync(repl)
    repl.close()
    assert len(rows(sink)) == 10
    s = Stream(sink, request.param)
    applier = writes.ChangeApplier

    def kept(*args):  # each transaction's applier, to see the target it applied with
        s.applied.append(applier(*args))
        return s.applied[-1]

    monkeypatch.setattr(writes, "ChangeApplier", kept)  # the general path's
    monkeypatch.setattr(stream_batch, "ChangeApplier", kept)  # the one round trip's
    s.change("u", row(1, "warm"))  # the connection's transactions have used the table: read ahead from now on
    s.change("u", row(1, "warm again"))
    if s.path == "general":
        assert s.applied[-1].lookup.site_id == "site-b"
    else:  # the first read the targets, the second was composed from them
        assert s.fast == [False, True]
    yield s
    s.close()


def owner(sink, id_: int) -> list:
    return sink.query("SELECT owner FROM public.accounts WHERE id = %s", (id_,))


def test_a_column_dropped_or_renamed_at_the_sink_refuses_the_next_change_until_it_fits_one_added_is_kept(stream):
    sink = stream.sink
    sink.query("ALTER TABLE public.accounts ADD COLUMN region text DEFAULT 'eu'")
    stream.change("u", row(2, "x"))  # a column only the sink has keeps its value (as PostgreSQL's apply)
    assert sink.query("SELECT owner, region FROM public.accounts WHERE id = 2") == [("x", "eu")]
    assert stream.target() == stream.fresh_target()
    stream.change("u", row(2, "with region", region="eu"))
    assert sink.query("SELECT owner, region FROM public.accounts WHERE id = 2") == [("with region", "eu")]
    sink.query("ALTER TABLE public.accounts DROP COLUMN region")
    with pytest.raises(SchemaMismatchError, match="do not fit"):
        stream.change("u", row(2, "y", region="eu"))
    stream.change("u", row(2, "without region"))
    sink.query("ALTER TABLE public.accounts RENAME COLUMN note TO remark")
    with pytest.raises(SchemaMismatchError, match="do not fit"):
        stream.change("u", row(3, "z"))
    assert owner(sink, 2) == [("without region",)] and owner(sink, 3) == [("owner3",)]


def test_a_type_or_not_null_change_at_the_sink_is_the_definition_the_next_change_applies_with(stream):
    sink = stream.sink
    sink.query("ALTER TABLE public.accounts ALTER COLUMN balance TYPE numeric(20, 4)")
    stream.change("u", row(4, balance=1.23456))
    assert stream.target() == stream.fresh_target()
    assert dict((c.name, c.type) for c in stream.target().definition.columns)["balance"] == "numeric(20,4)"
    assert sink.query("SELECT balance::text FROM public.accounts WHERE id = 4") == [("1.2346",)]
    sink.query("UPDATE public.accounts SET tags = '{}' WHERE tags IS NULL")
    sink.query("ALTER TABLE public.accounts ALTER COLUMN tags SET NOT NULL")
    with pytest.raises(ApplyError, match="null value"):
        stream.change("u", row(5))
    assert stream.target() == stream.fresh_target()
    assert {c.name for c in stream.target().definition.columns if c.not_null} == {"id", "owner", "balance", "tags"}


def test_a_new_primary_key_at_the_sink_is_the_one_the_next_upsert_conflicts_on(stream):
    sink = stream.sink
    sink.query("ALTER TABLE public.accounts DROP CONSTRAINT accounts_pkey, ADD PRIMARY KEY (owner, id)")
    stream.change("u", row(6, "owner6", balance=9))  # ON CONFLICT (id) would find no such constraint now
    stream.change("u", row(6, "someone else"))  # another key now: a second row of id 6
    assert stream.target().definition.key == ("owner", "id") and stream.target() == stream.fresh_target()
    assert sink.query("SELECT owner, balance FROM public.accounts WHERE id = 6 ORDER BY 1") == [
        ("owner6", 9),
        ("someone else", 1),
    ]


def test_a_table_dropped_at_the_sink_refuses_and_one_created_again_takes_the_changes_by_its_new_shape(stream):
    sink = stream.sink
    sink.query("DROP TABLE public.accounts")
    with pytest.raises(SchemaMismatchError, match="no longer exists on the sink"):
        stream.change("u", row(7))
    sink.query("CREATE TABLE public.accounts (id bigint PRIMARY KEY, owner text NOT NULL)")
    with pytest.raises(SchemaMismatchError, match="do not fit"):
        stream.change("u", row(7))
    stream.change("u", {"id": 7, "owner": "new table"})
    assert sink.query("SELECT * FROM public.accounts") == [(7, "new table")]
    assert stream.target() == stream.fresh_target()


def test_a_table_turned_conflict_or_forgotten_at_the_sink_drops_the_next_changes_until_it_is_synced_again(stream):
    sink = stream.sink
    sink.query("UPDATE lr.sink_tables SET state = 'conflict'")
    stream.change("u", row(8, "while in conflict"))
    assert stream.target() is None and stream.fresh_target() is None
    sink.query("UPDATE lr.sink_tables SET state = 'synced'")
    stream.change("u", row(8, "synced again"))
    assert stream.target() is not None and stream.target() == stream.fresh_target()
    assert owner(sink, 8) == [("synced again",)]
    (session_table,) = sink.query(
        "SELECT table_name, source_table_id FROM lr.sink_tables WHERE table_name = 'public.accounts'"
    )
    sink.query("DELETE FROM lr.sink_tables")  # a full sync of the session started over (``forget_session``)
    stream.change("u", row(8, "forgotten"))
    assert stream.target() is None and stream.fresh_target() is None
    sink.query(
        "INSERT INTO lr.sink_tables (source_site_id, client_name, table_name, source_table_id, state) "
        "VALUES ('site-a', 'policy', %s, %s, 'syncing')",
        session_table,
    )
    stream.change("u", row(8, "syncing"))
    assert stream.target() == stream.fresh_target()
    assert owner(sink, 8) == [("syncing",)]
    sink.query("UPDATE lr.sink_tables SET state = 'refused'")  # applied as ever (the session stops elsewhere)
    stream.change("u", row(8, "refused"))
    assert owner(sink, 8) == [("refused",)]


def test_another_source_taking_rows_of_the_table_makes_the_next_changes_keep_the_origin_ledger(stream):
    sink = stream.sink
    assert not stream.target().shared
    sink.query(  # site-c took key 9 meanwhile
        "INSERT INTO lr.table_row_origin (table_name, key, source_site_id) VALUES ('public.accounts', '{\"id\": 9}', "
        "'site-c')"
    )
    expected = stream.fresh_target()
    stream.change("u", row(9, "back to site-a"))  # the primary origin's row again: unlisted
    assert stream.target().shared and stream.target() == expected
    assert sink.query("SELECT count(*) FROM lr.table_row_origin") == [(0,)]  # so none is listed now
    sink.query(  # another source starts syncing the table
        "INSERT INTO lr.sink_tables (source_site_id, client_name, table_name, source_table_id, state) "
        "VALUES ('site-c', 'policy', 'public.accounts', 1, 'syncing')"
    )
    stream.change("u", row(9, "still site-a"))
    assert stream.target().shared and stream.target() == stream.fresh_target()
    sink.query("DELETE FROM lr.sink_tables WHERE source_site_id = 'site-c'")
    stream.change("d", {"id": 9})
    assert not stream.target().shared and stream.target() == stream.fresh_target()


def test_a_failover_of_the_primary_origin_lists_the_next_rows_under_their_source(stream):
    sink = stream.sink
    assert stream.target().primary
    sink.query("UPDATE lr.registry SET source_site_id = 'site-c' WHERE stream_name = 'public.accounts'")
    stream.change("u", row(10, "from site-a, no longer primary"))
    assert not stream.target().primary and stream.target() == stream.fresh_target()
    assert sink.query("SELECT key::text, source_site_id FROM lr.table_row_origin") == [('{"id": 10}', "site-a")]


def test_the_sink_opening_the_table_as_not_federated_drops_the_next_change_as_a_fresh_lookup_does(stream):
    sink = stream.sink
    conn = sink.connect()
    try:
        registry.open_table(conn, "public.accounts", "policy", federated=False)
    finally:
        conn.close()
    before = owner(sink, 1)
    # the open marked the copy a conflict (sink.keep_out): the next change is dropped, on either path
    stream.change("u", row(1, "dropped"))
    assert stream.target() is None and stream.fresh_target() is None
    assert owner(sink, 1) == before


def test_a_table_read_ahead_that_the_transaction_does_not_change_refuses_nothing(stream):
    sink = stream.sink
    stream.change("u", {"id": 1, "item": "first"}, table="public.orders")  # both tables used lately
    sink.query("DROP TABLE public.orders")
    stream.change("u", row(1, "only accounts changed"))
    assert owner(sink, 1) == [("only accounts changed",)]
    if stream.path == "general":
        assert isinstance(stream.applied[-1].lookup.found[stream.tids["public.orders"]], Gone)  # read ahead
    else:  # checked only the table it changes
        assert stream.fast[-1]
    with pytest.raises(SchemaMismatchError, match="public.orders no longer exists on the sink"):
        stream.change("u", {"id": 1, "item": "second"}, table="public.orders")


def test_the_targets_ride_with_the_first_statement_once_the_connection_used_the_table(stream):
    sink = stream.sink
    statements: list = []
    real = type(stream.conn.cursor())

    class Counting(real):
        def execute(self, query, vars=None):
            statements.append(query)
            return super().execute(query, vars)

    stream.conn.cursor_factory = Counting
    stream.change("u", row(1, "counted"))
    # the session's row locked; apply mark, constraints and targets; the changes; position and commit;
    # a stream: all of it in one round trip
    assert len(statements) == (4 if stream.path == "general" else 1), statements
    assert owner(sink, 1) == [("counted",)]


def test_a_lookup_discarded_from_the_connection_fails_one_transaction_and_the_next_prepares_it_again(stream):
    with stream.conn.cursor() as cur:
        cur.execute("DISCARD ALL")  # what a pooler in transaction mode does between transactions
    if stream.path == "general":
        with pytest.raises(psycopg2.errors.InvalidSqlStatementName):
            stream.change("u", row(1, "lost"))
    else:  # the stream's check is refused first: the general path prepares both again
        stream.change("u", row(1, "the general path"))
        assert stream.fast[-1] is False and owner(stream.sink, 1) == [("the general path",)]
    stream.change("u", row(1, "prepared again"))
    assert owner(stream.sink, 1) == [("prepared again",)]
    assert stream.path == "general" or stream.fast[-1]


def test_an_api_caller_applying_changes_on_a_latin1_connection_is_refused_before_a_garbled_name_is_written(lr_sites):
    """An engine API caller applies a batch itself (``apply_log_stream``) with a plain connection
    whose client encoding is LATIN1: the apply is refused at its start, saying so, nothing written;
    on a UTF8 connection the same batch applies. Before, lr's statements (composed in UTF8) reached
    the server as LATIN1: the column "été" read as "Ã©tÃ©", the change refused as not fitting."""
    source, sink, _ = lr_sites
    topo = apply(lr_sites[:2], [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}])
    source.query('CREATE TABLE public.notes (id int PRIMARY KEY, "été" text NOT NULL)')
    source.query("INSERT INTO public.notes VALUES (1, 'café')")
    federate(source, "public.notes")
    repl = replicator(topo, lr_sites[:2])
    sync(repl)
    repl.close()
    (tid,) = sink.query("SELECT source_table_id FROM lr.sink_tables WHERE table_name = 'public.notes'")[0]
    base, last, epoch = sink.query(
        "SELECT snapshot_applied, last_log_entry_processed, lease_epoch FROM lr.sink_sessions WHERE source_site_id = 'site-a'"
    )[0]
    message = json.dumps({"op": "u", "rows": [{"id": 2, "été": "naïve"}]}).encode()
    batch = LogBatch(last, last + 1, [LogRecord(last + 1, 1, message, tid)])
    conn = sink.connect()
    try:
        conn.set_client_encoding("LATIN1")
        with pytest.raises(ConfigurationError, match="client encoding is LATIN1"):
            writes.apply_log_stream(conn, "site-a", "policy", epoch, batch, base)
        assert sink.query("SELECT last_log_entry_processed FROM lr.sink_sessions") == [(last,)]
        conn.set_client_encoding("UTF8")
        assert writes.apply_log_stream(conn, "site-a", "policy", epoch, batch, base) == last + 1
    finally:
        conn.close()
    assert sink.query('SELECT id, "été" FROM public.notes ORDER BY id') == [(1, "café"), (2, "naïve")]
