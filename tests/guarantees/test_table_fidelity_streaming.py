"""The table fidelity guarantees (tests/guarantees/test_table_fidelity.py) with ``lr sync``'s default
streaming mode carrying the changes: a session the stream wrote before gets its whole sink
transaction in one round trip, its table statements composed from the targets the connection's last
transaction read and checked in the same transaction (docs/tables.md, "Apply at the sink"). Whatever
the table, whatever the sink's table became meanwhile, a change applies as a fresh apply would, or
is refused saying why, and arrives once the sink is fixed: exactly once."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg2.extensions
import pytest

from airflow_provider_lr.client import RoutingQueueClient
from airflow_provider_lr.engine.db import conninfo, schema
from airflow_provider_lr.engine.db.timeouts import Purpose
from airflow_provider_lr.engine.session.settings import SessionSettings, StreamSettings
from airflow_provider_lr.engine.sink import stream_batch
from airflow_provider_lr.engine.site import status
from airflow_provider_lr.engine.site.replicator import Replicator
from airflow_provider_lr.engine.source import full_sync
from airflow_provider_lr.engine.tables import registry
from airflow_provider_lr.subscriber import RoutingQueueSubscriber
from tests.conftest import TestSite, create_database, drop_database
from tests.support.session import Streaming, apply, empty_provider, queue, replicator, wait_for
from tests.support.subscriber import Recorder
from tests.support.tables import (
    CONSTRAINT_SCENARIOS,
    PEOPLE,
    PEOPLE_ROWS,
    TYPES,
    TYPES_DDL,
    TableWriter,
    create_accounts,
    every_type_table,
    federate,
    hostile_table,
    in_one_transaction,
    insert_every_type,
    on_every_site,
    quoted,
    rows,
    status_text,
    type_differences,
)

FAST = StreamSettings(check_interval=0.2, ack_interval=0.05, retry_min=0.1, retry_max=0.5)


class RoundTrips:
    """What the stream's one-round-trip sink writes (``stream_batch.stream_batches``) applied of table
    changes: per sink site, the source positions of the changes of each batch so applied."""

    def __init__(self, sites) -> None:
        self.site_of = {psycopg2.extensions.parse_dsn(s.dsn)["port"]: s.site_id for s in sites}
        self.batches: dict[str, list[set[int]]] = defaultdict(list)

    def spy(self, real):
        def stream_batches(conn, source, batches):
            ends = real(conn, source, batches)
            site = self.site_of[conn.get_dsn_parameters()["port"]]
            for write, end in zip(batches, ends):
                changes = {r.position for r in write.batch.records if r.table_id is not None}
                if end is not None and changes:
                    self.batches[site].append(changes)
            return ends

        return stream_batches


@pytest.fixture
def round_trips(lr_sites, monkeypatch) -> RoundTrips:
    """The test's stream writes, watched: a test checks the one round trip carried its changes."""
    trips = RoundTrips(lr_sites)
    monkeypatch.setattr(stream_batch, "stream_batches", trips.spy(stream_batch.stream_batches))
    return trips


def streaming_over(topo, sites, providers: dict | None = None, as_lr: bool = False) -> Streaming:
    return Streaming(replicator(topo, sites, providers=providers, lease_seconds=2.0, as_lr=as_lr), FAST)


def streamed(streaming: Streaming, source, sinks, *tables: str, what: str = "") -> None:
    """Wait until every sink holds exactly the source's rows of ``tables``, carried by the stream:
    no cycle ran meanwhile."""
    cycles = len(streaming.cycles)
    wait_for(lambda: all(rows(s, t) == rows(source, t) for s in sinks for t in tables), 30, f"{what or tables}")
    assert len(streaming.cycles) == cycles, f"{what}: cycles ran while streaming: {streaming.cycles[cycles:]}"


class Application:
    """The source's application: each transaction changes federated tables and transmits its name,
    for each of ``clients``, to ``sinks``, atomically; ``sent``: the names committed, in order."""

    def __init__(self, source, sinks, clients: tuple[str, ...] = ("policy",)) -> None:
        self.conn = source.connect()
        self.clients = [RoutingQueueClient(self.conn, client) for client in clients]
        self.to = [s.site_id for s in sinks]
        self.sent: list[str] = []

    def commit(self, name: str, *statements: str) -> None:
        with self.conn.cursor() as cur:
            for statement in statements:
                cur.execute(statement)
        for client in self.clients:
            client.transmit_log_entry_message(name.encode(), self.to)
        self.conn.commit()
        self.sent.append(name)

    def close(self) -> None:
        self.conn.close()


def logs(sink, client: str = "policy") -> list[str]:
    """The names of the transactions whose entries reached ``sink``'s receive queue, in order."""
    return [payload for kind, payload in queue(sink, "site-a", client) if kind == "log"]


def said(streaming: Streaming, sink: str, text: str, client: str = "policy") -> list[str]:
    """What the stream's ends and the cycles said of the session into ``sink`` that holds ``text``."""
    session = f"site-a->{sink}/{client}"
    errors = [e.error for e in streaming.streamer.ends if e.session == session]
    errors += [r.error for r in streaming.cycles if r.session == session]
    return [e for e in errors if e and text in e]


def forced_full_sync_of_site_b(source, streaming: Streaming) -> None:
    """An operator forces a full sync of site-b; back once it is applied and every session streams again."""
    conn = source.connect()
    full_sync.request_full_sync(conn, "site-b", "policy", "operator asked", forced=True)
    conn.close()
    applied = "SELECT count(*) FROM lr.full_sync_requests WHERE forced AND status = 'applied'"
    wait_for(lambda: source.query(applied) == [(1,)], 30, "the full sync")
    streaming.streaming()


def in_one_round_trip(trips: RoundTrips, sinks) -> None:
    """The stream wrote table changes into every sink in its one round trip (not only the general path)."""
    assert all(trips.batches[s.site_id] for s in sinks), dict(trips.batches)


def processed(sink) -> int:
    """The position the sink's session has processed."""
    return sink.query(
        "SELECT last_log_entry_processed FROM lr.sink_sessions WHERE source_site_id = 'site-a' "
        "AND client_name = 'policy'"
    )[0][0]


def carried_in_one_round_trip(streaming: Streaming, trips: RoundTrips, source, sinks, table: str, change) -> None:
    """``change`` (one source transaction) streamed into every sink, by the stream's one round trip."""
    marks = {s.site_id: processed(s) for s in sinks}
    change()
    streamed(streaming, source, sinks, table)
    wait_for(  # the spy notes a write once it returned: a moment after the sink's commit is visible
        lambda: all(any(p > marks[s] for batch in trips.batches[s] for p in batch) for s in marks),
        5,
        f"the change to be written in one round trip: {dict(trips.batches)}",
    )


def test_streamed_columns_named_like_lrs_words_apply_key_changes_updates_and_deletes(lr_sites, round_trips):
    """Columns named like every alias and column of lr's capture, apply and snapshot statements, and
    names only a quoted identifier spells (quotes, a backslash, 63 bytes), in the key and not:
    through the snapshot (binary COPY, and text COPY for a table with a ``regtype`` column), the
    stream, and a full sync asked while it streams."""
    source, *sinks = lr_sites
    topo = apply(lr_sites)
    hostile_table(source, "hostile", ["n"])
    hostile_table(source, "hostile2", ["nonkey", "select"])  # a composite key of hostile names
    odd_key = ['a"b', "l" * 63, "✓" * 21, "position"]
    hostile_table(source, "hostile3", odd_key)
    source.query('ALTER TABLE public.hostile3 ALTER COLUMN "it\'s" TYPE regtype USING NULL')  # copied as text
    key3 = ", ".join(map(quoted, odd_key))
    source.query("INSERT INTO public.hostile (n, nonkey) SELECT g, 'v' || g FROM generate_series(1, 5) g")
    source.query(
        f"INSERT INTO public.hostile3 ({key3}, \"it's\", v, x) SELECT g, -g, g, 1, 'integer', 'v', 'x' "
        "FROM generate_series(1, 5) g"
    )
    for table in ("public.hostile", "public.hostile2", "public.hostile3"):
        federate(source, table)
    with streaming_over(topo, lr_sites) as streaming:
        streaming.streaming()
        source.query(
            'INSERT INTO public.hostile (n, nonkey, op, "MixedCase", tags) '
            "SELECT g, 'new' || g, 'u', 'M', '{1}' FROM generate_series(6, 300) g"
        )
        streamed(streaming, source, sinks, "public.hostile")  # its target read: the next in one round trip
        source.query(
            "UPDATE public.hostile SET nonkey = 'changed', \"row\" = '{r}', data = '\"d\"', lr_row = '{1}', "
            "lr_image = '[1,  2]' WHERE n <= 150"
        )
        source.query("UPDATE public.hostile SET n = n + 5000 WHERE n BETWEEN 10 AND 20")  # key changes
        source.query("DELETE FROM public.hostile WHERE n BETWEEN 30 AND 40")
        source.query(
            "INSERT INTO public.hostile2 (nonkey, \"select\", n, k) SELECT g, g %% 3, 'x', 'y' "
            "FROM generate_series(1, 30) g"
        )
        source.query('UPDATE public.hostile2 SET "select" = "select" + 10 WHERE nonkey < 10')  # key changes
        source.query("UPDATE public.hostile2 SET lr = 'l', \"from\" = 'f', \"with space\" = 'w' WHERE nonkey >= 10")
        source.query("DELETE FROM public.hostile2 WHERE nonkey = 29")
        for column in ("lr_changed", "tg_op", "stream"):  # one column at a time: each its own statement
            source.query(f'UPDATE public.hostile SET "{column}" = %s WHERE n %% 7 = 0', (column,))
        odd = quoted("l" * 63)
        source.query(
            f"INSERT INTO public.hostile3 ({key3}, \"it's\", p, d) SELECT g, -g, g, 2, 'text[]', 'p', 'd' "
            "FROM generate_series(6, 9) g"
        )
        source.query(f"UPDATE public.hostile3 SET {odd} = {odd} + 100, t = 't', \"it's\" = 'pg_class' WHERE {odd} < 3")
        source.query(
            f'UPDATE public.hostile3 SET "a""b" = -"a""b", excluded = \'e\', "back\\slash" = \'b\' WHERE {odd} > 7'
        )
        source.query(f"DELETE FROM public.hostile3 WHERE {odd} IN (4, 6)")
        tables = ("public.hostile", "public.hostile2", "public.hostile3")
        streamed(streaming, source, sinks, *tables)
        forced_full_sync_of_site_b(source, streaming)
        source.query(f"UPDATE public.hostile3 SET {odd} = {odd} + 1000, lo = 'l', \"Ünï Cødé ✓\" = 'ü'")
        streamed(streaming, source, sinks, *tables)
    assert len(rows(source, "public.hostile")) == 300 - 11
    in_one_round_trip(round_trips, sinks)


def test_streamed_constraint_histories_apply_one_by_one_and_several_in_one_stream_batch(lr_sites, round_trips):
    source, *sinks = lr_sites
    topo = apply(lr_sites)
    on_every_site(lr_sites, PEOPLE)
    source.query(PEOPLE_ROWS)
    federate(source, "public.people")
    histories = [(what, statements) for what, statements in CONSTRAINT_SCENARIOS.items() if statements]
    with streaming_over(topo, lr_sites) as streaming:
        streaming.streaming()
        for what, statements in histories:  # each streamed before the next commits
            in_one_transaction(source, *statements)
            streamed(streaming, source, sinks, "public.people", what=what)
        in_one_transaction(source, "DELETE FROM public.people", PEOPLE_ROWS)
        streamed(streaming, source, sinks, "public.people")
        # the same histories back to back while the sinks' tables are locked: the stream's next
        # read takes the transactions committed meanwhile, several of them in one sink batch
        holds = [sink.connect() for sink in sinks]
        for hold in holds:
            with hold.cursor() as cur:
                cur.execute("LOCK TABLE public.people IN EXCLUSIVE MODE")
        for _, statements in histories:
            in_one_transaction(source, *statements)
        time.sleep(0.2)
        for hold in holds:
            hold.rollback()
            hold.close()
        streamed(streaming, source, sinks, "public.people")
    assert rows(source, "public.people")[0] == ("(101,e2,1,p1)",)
    for sink in sinks:
        assert max(len(batch) for batch in round_trips.batches[sink.site_id]) >= 2, sink.site_id


def test_every_built_in_type_streams_through_inserts_and_a_key_change(lr_sites, round_trips):
    source, *sinks = lr_sites
    topo = apply(lr_sites)
    for site in lr_sites:  # the sink requires the table's own types: lr does not create them
        if site is not source:  # ... and they have other oids there
            site.query("CREATE TYPE public.unrelated AS (x int); CREATE TYPE public.unrelated2 AS ENUM ('y')")
        for ddl in TYPES_DDL:
            site.query(ddl)
    every_type_table(source, "every_type")
    insert_every_type(source, "every_type", 1)  # carried by the snapshot
    columns = ", ".join(column for column, _, _, _ in TYPES)
    federate(source, "public.every_type")
    with streaming_over(topo, lr_sites) as streaming:
        streaming.streaming()
        insert_every_type(source, "every_type", 11)  # three transactions: the stream carries them
        streamed(streaming, source, sinks, "public.every_type")  # its target read: the next in one round trip
        changes = [
            lambda: source.query("INSERT INTO public.every_type (id) VALUES (21)"),
            lambda: source.query(
                "INSERT INTO public.every_type SELECT id + 10, "
                + columns
                + " FROM public.every_type WHERE id IN (12, 13)"
            ),
            lambda: source.query(
                "UPDATE public.every_type SET id = id + 100 WHERE id IN (12, 23)"
            ),  # every value moves
            lambda: in_one_transaction(  # a row of the snapshot deleted, another moved onto its key
                source,
                "DELETE FROM public.every_type WHERE id = 2",
                "UPDATE public.every_type SET id = 2 WHERE id = 22",
            ),
            lambda: source.query("DELETE FROM public.every_type WHERE id = 3"),
        ]
        for change in changes:
            carried_in_one_round_trip(streaming, round_trips, source, sinks, "public.every_type", change)
    assert [r[0] for r in source.query("SELECT id FROM public.every_type ORDER BY id")] == [1, 2, 11, 13, 21, 112, 123]
    for sink in sinks:
        assert type_differences(source, sink, "every_type") == []


def test_columns_of_not_null_domains_stream_inserts_updates_key_changes_and_deletes(lr_sites, round_trips):
    """Domains that refuse NULL (``NOT NULL``, a ``CHECK`` on it, over an array that travels as text)
    as non-key columns, and as a key. The apply read each row through a record of the table's type,
    whose columns the row does not carry are NULL: a delete (which carries the key) and every change
    of a column that travels as text were refused by the domain at every sink, for good."""
    source, *sinks = lr_sites
    topo = apply(lr_sites)
    for site in lr_sites:
        site.query(
            "CREATE DOMAIN public.qty AS int NOT NULL; CREATE DOMAIN public.codes AS int[] NOT NULL; "
            "CREATE DOMAIN public.label AS text CHECK (VALUE IS NOT NULL AND VALUE <> ''); "
            "CREATE TYPE public.mood AS ENUM ('sad', 'ok')"
        )
    source.query(
        "CREATE TABLE public.stock (id public.qty PRIMARY KEY, n public.qty, codes public.codes, "
        "name public.label, m public.mood, note text, q int, p text, lr_0 text)"  # named like the apply's aliases
    )
    source.query(
        "INSERT INTO public.stock SELECT g, g, ARRAY[g], 'n' || g, 'ok', NULL, g, 'p', 'l' FROM generate_series(1, 5) g"
    )
    federate(source, "public.stock")
    with streaming_over(topo, lr_sites) as streaming:
        streaming.streaming()
        source.query(
            "INSERT INTO public.stock VALUES (6, 6, '[0:1][1:2]={{1,2},{3,4}}', 'six', 'sad', 'x', 6, 'p', 'l')"
        )
        streamed(streaming, source, sinks, "public.stock")  # its target read: the next in one round trip
        changes = [
            "UPDATE public.stock SET n = n + 10, codes = '{7}', m = NULL, q = -q, p = 'pp', lr_0 = NULL WHERE id <= 3",
            "UPDATE public.stock SET id = id + 100 WHERE id IN (2, 6)",
            "DELETE FROM public.stock WHERE id IN (1, 102)",
        ]
        for change in changes:
            carried_in_one_round_trip(
                streaming, round_trips, source, sinks, "public.stock", lambda change=change: source.query(change)
            )
    assert [r[0] for r in source.query("SELECT id FROM public.stock ORDER BY id")] == [3, 4, 5, 106]
    assert not [r.error for r in streaming.cycles if r.error]


def test_columns_of_a_type_with_a_cast_to_json_stream_inserts_updates_key_changes_and_deletes(lr_sites, round_trips):
    """A type with a cast to json (a user's, as here, or an extension's: hstore, PostGIS geometry),
    in the key, alone and under a domain: ``to_jsonb`` writes a value of it as the cast returns it,
    which no sink reads back as the type. Before, every change of such a table was refused at every
    sink, for good (``invalid input value for enum level: "{"level": "high"}"``); the capture now
    carries such a column as its text (V0032)."""
    source, *sinks = lr_sites
    topo = apply(lr_sites)
    for site in lr_sites:
        site.query(
            "CREATE TYPE public.level AS ENUM ('low', 'high'); CREATE DOMAIN public.grade AS public.level; "
            "CREATE FUNCTION public.level_json(public.level) RETURNS json LANGUAGE sql "
            "AS $$ SELECT pg_catalog.json_build_object('level', $1::text) $$; "
            "CREATE CAST (public.level AS json) WITH FUNCTION public.level_json(public.level)"
        )
    source.query("CREATE TABLE public.levels (l public.level, n int, g public.grade, PRIMARY KEY (l, n))")
    source.query("INSERT INTO public.levels VALUES ('low', 1, 'high')")
    federate(source, "public.levels")
    with streaming_over(topo, lr_sites) as streaming:
        streaming.streaming()
        for change in (
            "INSERT INTO public.levels VALUES ('high', 2, 'low'), ('low', 3, NULL)",
            "UPDATE public.levels SET g = 'low' WHERE n = 1",
            "UPDATE public.levels SET l = 'high' WHERE n = 3",  # a key change
            "DELETE FROM public.levels WHERE n = 2",
        ):
            source.query(change)
            streamed(streaming, source, sinks, "public.levels", what=change)
    assert rows(source, "public.levels") == [("(high,3,)",), ("(low,1,low)",)]
    in_one_round_trip(round_trips, sinks)


def test_sink_tables_made_with_the_sources_always_identity_stream_every_change_and_a_full_sync(lr_sites, round_trips):
    """Every site made the tables with the source's DDL: a non-key ``GENERATED ALWAYS`` identity (one
    table with a ``DEFERRABLE`` key, the upsert's other path). PostgreSQL sets such a column in no
    ``UPDATE``: every change was refused at every sink, for good. Now the source's values arrive as
    PostgreSQL's own apply worker writes them: updates, ``SET ref = DEFAULT``, key changes, deletes,
    a TRUNCATE and a full sync, and the sinks' columns stay ``ALWAYS``."""
    source, *sinks = lr_sites
    topo = apply(lr_sites)
    tables = ("public.tickets", "public.stubs")
    on_every_site(
        lr_sites, "CREATE TABLE public.tickets (id int PRIMARY KEY, ref bigint GENERATED ALWAYS AS IDENTITY, v text)"
    )
    on_every_site(
        lr_sites,
        "CREATE TABLE public.stubs (id int PRIMARY KEY DEFERRABLE, ref int GENERATED ALWAYS AS IDENTITY, "
        "seq int GENERATED ALWAYS AS IDENTITY (START WITH 50), v text)",
    )
    for sink in sinks:  # the sinks' sequences elsewhere: a value a sink drew would show
        sink.query("SELECT setval(pg_get_serial_sequence('public.tickets', 'ref'), 900)")
    source.query("INSERT INTO public.tickets (id, v) SELECT g, 'v' || g FROM generate_series(1, 5) g")
    source.query("INSERT INTO public.stubs (id, v) SELECT g, 'v' || g FROM generate_series(1, 5) g")
    for table in tables:
        federate(source, table)
    with streaming_over(topo, lr_sites) as streaming:
        streaming.streaming()
        in_one_transaction(source, *(f"INSERT INTO {t} (id, v) VALUES (6, 'six'), (7, 'seven')" for t in tables))
        streamed(streaming, source, sinks, *tables)  # their targets read: the next in one round trip
        for table in tables:
            changes = [
                f"UPDATE {table} SET v = v || '!' WHERE id <= 3",
                f"UPDATE {table} SET ref = DEFAULT, v = 'again' WHERE id IN (2, 6)",
                f"UPDATE {table} SET id = id + 100 WHERE id >= 4",
                f"INSERT INTO {table} (id, ref, v) OVERRIDING SYSTEM VALUE VALUES (20, 777, 'given')",
                f"DELETE FROM {table} WHERE id = 1",
            ]
            for change in changes:
                carried_in_one_round_trip(
                    streaming, round_trips, source, sinks, table, lambda change=change: source.query(change)
                )
        forced_full_sync_of_site_b(source, streaming)
        source.query("UPDATE public.tickets SET ref = DEFAULT WHERE id = 3; TRUNCATE public.stubs")
        source.query("INSERT INTO public.stubs (id, v) VALUES (1, 'after')")
        streamed(streaming, source, sinks, *tables)
    assert not [r.error for r in streaming.cycles if r.error]
    for sink in sinks:
        assert sink.query(
            "SELECT count(*) FROM pg_attribute WHERE attrelid IN ('public.tickets'::regclass, 'public.stubs'::regclass) "
            "AND attidentity = 'a'"
        ) == [(3,)]


def test_tables_linked_by_foreign_keys_snapshot_stream_cascade_and_full_sync_with_no_violation_and_no_loss(
    lr_sites, round_trips
):
    """The sinks' tables have the source's foreign keys (a parent with ON DELETE CASCADE, a child
    named before it, a self-reference) and rows before they are federated. The snapshot used to be
    written table by table in name order: the child before its parent, refused for good
    (``ForeignKeyViolation``); a full sync cleared the parent after copying the child, cascading
    its rows away. Now each sink takes them in one transaction, children cleared first, parents
    copied first; streamed changes apply in the source's order, a cascade once, and a TRUNCATE of
    several tables clears them at once."""
    source, *sinks = lr_sites
    topo = apply(lr_sites)
    tables = ("public.parents", "public.children", "public.tree", "public.pets")
    on_every_site(lr_sites, "CREATE TABLE public.parents (id int PRIMARY KEY, name text)")
    on_every_site(
        lr_sites,
        "CREATE TABLE public.children (id int PRIMARY KEY, parent int NOT NULL REFERENCES public.parents "
        "ON DELETE CASCADE)",
    )
    on_every_site(lr_sites, "CREATE TABLE public.tree (id int PRIMARY KEY, up int REFERENCES public.tree)")
    on_every_site(lr_sites, "CREATE TABLE public.pets (id int PRIMARY KEY, parent int REFERENCES public.parents)")
    in_one_transaction(
        source,
        "INSERT INTO public.parents SELECT g, 'p' || g FROM generate_series(1, 10) g",
        "INSERT INTO public.children SELECT g, g % 10 + 1 FROM generate_series(1, 30) g",
        "INSERT INTO public.tree SELECT g, nullif(g - 1, 0) FROM generate_series(1, 10) g",
        "INSERT INTO public.pets SELECT g, g FROM generate_series(4, 10) g",
    )
    for table in tables:
        federate(source, table)
    with streaming_over(topo, lr_sites) as streaming:
        streaming.streaming()
        assert not [r.error for r in streaming.cycles if r.error]
        streamed(streaming, source, sinks, *tables)
        in_one_transaction(
            source,
            "INSERT INTO public.parents VALUES (11, 'k'), (12, 'l')",
            "INSERT INTO public.children VALUES (31, 11), (32, 12)",
        )
        streamed(streaming, source, sinks, *tables)
        in_one_transaction(
            source,
            "DELETE FROM public.children WHERE parent = 1",
            "DELETE FROM public.parents WHERE id = 1",
            "INSERT INTO public.parents VALUES (13, 'c')",
            "UPDATE public.children SET parent = 13 WHERE parent = 2",
        )
        in_one_transaction(
            source,
            "DELETE FROM public.parents WHERE id IN (3, 11)",  # cascaded at the source, captured, applied once
            "INSERT INTO public.tree VALUES (11, 10)",
            "UPDATE public.tree SET up = 11 WHERE id = 1",
        )
        streamed(streaming, source, sinks, *tables)
        in_one_round_trip(round_trips, sinks)
        forced_full_sync_of_site_b(source, streaming)
        source.query("INSERT INTO public.children VALUES (40, 12)")
        streamed(streaming, source, sinks, *tables)
        # the children's and pets' rows with it: cleared at the sink in one statement, as the TRUNCATE
        # at the source checked the foreign keys at its end (one by one, the parents' first, the pets'
        # key refused it for good)
        source.query("TRUNCATE public.parents CASCADE")
        source.query("INSERT INTO public.parents VALUES (1, 'again')")
        streamed(streaming, source, sinks, *tables)
    assert [len(rows(source, t)) for t in tables] == [1, 0, 11, 0]
    assert not [r.error for r in streaming.cycles if r.error]


TWO_CLIENTS = [{"source": "site-a", "sinks": ["site-b", "site-c"], "clients": ["policy", "other"]}]


def test_a_streamed_change_the_sink_refuses_holds_back_only_its_session_and_arrives_once_fixed(lr_sites, round_trips):
    """Each transaction also transmits for a second client: its session into the same sink is written
    in the same round trip as the refused one, and goes on."""
    source, sink, other = lr_sites
    topo = apply(lr_sites, TWO_CLIENTS)
    create_accounts(source, rows=20)
    federate(source)
    app = Application(source, [sink, other], clients=("policy", "other"))

    def everything_arrived(sites) -> bool:
        return all(rows(s) == rows(source) and logs(s) == logs(s, "other") == app.sent for s in sites)

    with streaming_over(topo, lr_sites, providers={"other": empty_provider}) as streaming:
        streaming.streaming()
        for n in (1, 2, 3):  # the first reads the table's target; the next are written in one round trip
            app.commit(f"before {n}", f"UPDATE public.accounts SET balance = balance + 1 WHERE id = {n}")
            streamed(streaming, source, [sink, other], "public.accounts")
            wait_for(lambda: everything_arrived([sink, other]), 10, f"before {n}")
        in_one_round_trip(round_trips, [sink, other])
        sink.query("ALTER TABLE public.accounts ADD CONSTRAINT small CHECK (balance < 1000)")  # the source has none
        app.commit("rich", "UPDATE public.accounts SET balance = 5000, owner = 'rich' WHERE id = 3")
        app.commit("after", "INSERT INTO public.accounts (id, owner) VALUES (100, 'after')")
        refusal = 'the sink refused table public.accounts: new row for relation "accounts" violates check constraint'
        wait_for(  # the stream's own report names the table (it does not wait for a cycle to say it)
            lambda: any(refusal in e.error for e in streaming.streamer.ends if "site-b/policy" in e.session),
            10,
            "the stream to report the refusal",
        )
        wait_for(lambda: any(refusal in line for line in status_text(source).splitlines()), 10, "lr status")
        shown = [line for line in status_text(source).splitlines() if "the sink refused" in line]
        assert len(shown) == 1 and "site-a->site-b/policy" in shown[0] and "fix it there" in shown[0], shown
        # only that session is held back: the other sink, and the other client into the same sink, go on
        wait_for(lambda: everything_arrived([other]), 10, "the other sink")
        wait_for(lambda: logs(sink, "other") == app.sent, 10, "the other client into the same sink")
        assert sink.query("SELECT owner FROM public.accounts WHERE id IN (3, 100) ORDER BY id") == [("owner3",)]
        assert logs(sink) == ["before 1", "before 2", "before 3"]
        assert said(streaming, "site-c", "") == said(streaming, "site-b", "", client="other") == []
        sink.query("ALTER TABLE public.accounts DROP CONSTRAINT small")
        wait_for(lambda: everything_arrived([sink]), 20, "the refused changes, once the sink is fixed")
        streaming.streaming()
        app.commit("later", "UPDATE public.accounts SET balance = 7, owner = 'later' WHERE id = 4")
        streamed(streaming, source, [sink, other], "public.accounts")
        wait_for(lambda: everything_arrived([sink, other]), 10, "later")
        wait_for(lambda: "the sink refused" not in status_text(source), 10, "the error cleared")
    app.close()
    for site in (sink, other):  # each exactly once
        assert logs(site) == logs(site, "other") == ["before 1", "before 2", "before 3", "rich", "after", "later"]
    assert said(streaming, "site-c", "") == said(streaming, "site-b", "", client="other") == []


class Utf8Reader(TestSite):
    """A site the test reads as UTF8 (a SQL_ASCII database's own client encoding is SQL_ASCII:
    psycopg2 would decode its bytes as ASCII)."""

    def connect(self) -> psycopg2.extensions.connection:
        return psycopg2.connect(self.dsn, client_encoding="UTF8")


@contextmanager
def sink_of_encoding(lr_sites, encoding: str) -> Iterator[tuple[list[TestSite], dict]]:
    """site-b's server holding a new database of ``encoding`` as site-b (lr init migrates it as
    lr connects), the only sink of site-a's client policy: (site-a and it, the topology)."""
    sink = Utf8Reader(lr_sites[1].server, f"{lr_sites[1].dbname}_{encoding.lower()}")
    create_database(sink.server, sink.dbname, encoding=encoding)
    try:
        conn = conninfo.from_dsn(sink.dsn).connect(Purpose.BULK)
        schema.init_site(conn, sink.site_id, sink.region)
        conn.close()
        sites = [lr_sites[0], sink]
        yield sites, apply(sites, [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}])
    finally:
        drop_database(sink.server, sink.dbname)


def test_a_latin1_sink_takes_what_its_encoding_holds_and_a_character_it_lacks_is_refused_naming_the_encoding(lr_sites):
    """site-b's database is LATIN1 (lr init migrates it: a migration's comment with a euro sign once
    failed it); lr's connections take UTF8, the stream sends the changes as text and the sink's
    server converts them: 'café' arrives as it is, and a euro sign LATIN1 has not is refused, the
    refusal saying the sink's encoding (before: that the sink's table had a constraint, trigger or
    privilege the source's has not, to fix there), its session held back, the entries before it once."""
    with sink_of_encoding(lr_sites, "LATIN1") as (sites, topo):
        source, sink = sites
        for site in sites:
            site.query("CREATE TABLE public.notes (id int PRIMARY KEY, body text NOT NULL)")
        federate(source, "public.notes")
        app = Application(source, [sink])
        with streaming_over(topo, sites, as_lr=True) as streaming:
            streaming.streaming()
            app.commit("café", "INSERT INTO public.notes VALUES (1, 'café ü')")
            streamed(streaming, source, [sink], "public.notes")
            app.commit("euro", "INSERT INTO public.notes VALUES (2, 'five €')")
            refusal = "the sink's database encoding cannot hold a character of the source's rows"
            wait_for(lambda: said(streaming, "site-b", refusal), 10, "the refusal naming the encoding")
            assert not said(streaming, "site-b", "constraint, trigger or privilege")
        app.close()
        assert rows(sink, "public.notes") == [('(1,"café ü")',)] and logs(sink) == ["café"]


def test_a_sql_ascii_sink_takes_a_table_whose_column_names_are_not_ascii(lr_sites):
    """site-b's database is SQL_ASCII (it stores bytes as given): a federated table with a column
    named "été" snapshots and streams there, every character as it is. Before, lr wrote the sink's
    column types as JSON with the name escaped (\u00e9), which a SQL_ASCII database's JSON parser
    refuses: every cycle of the session failed, for good."""
    with sink_of_encoding(lr_sites, "SQL_ASCII") as (sites, topo):
        source, sink = sites
        source.query('CREATE TABLE public.notes (id int PRIMARY KEY, "été" text NOT NULL)')
        source.query("INSERT INTO public.notes VALUES (1, 'café €')")
        federate(source, "public.notes")
        app = Application(source, [sink])
        with streaming_over(topo, sites, as_lr=True) as streaming:
            streaming.streaming()
            app.commit("more", "INSERT INTO public.notes VALUES (2, 'naïve ✓')")
            streamed(streaming, source, [sink], "public.notes")
        app.close()
        assert rows(sink, "public.notes") == rows(source, "public.notes") and logs(sink) == ["more"]
        assert sink.query('SELECT "été" FROM public.notes WHERE id = 2') == [("naïve ✓",)]


def test_a_sink_reached_by_a_plain_latin1_connection_applies_changes_of_columns_named_beyond_ascii(lr_sites):
    """An engine API caller's plain connections (not lr's, which talk UTF8) take the sink's default
    client encoding, LATIN1: the changes of a table with columns named "été" and "✓" apply there as
    at any sink. Before, psycopg2 composed "été" as "Ã©tÃ©" on such a connection (and could not
    write "✓" at all): every change of the table was refused at that sink, for good."""
    source, sink, _ = lr_sites
    topo = apply(lr_sites[:2], [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}])
    table = 'CREATE TABLE public.notes (id int PRIMARY KEY, "été" text NOT NULL, "✓" int)'
    for site in (source, sink):
        site.query(table)
    source.query("INSERT INTO public.notes VALUES (1, 'café', 1)")
    sink.query(f"ALTER DATABASE \"{sink.dbname}\" SET client_encoding = 'LATIN1'")
    federate(source, "public.notes")
    app = Application(source, [sink])
    with streaming_over(topo, lr_sites[:2]) as streaming:
        streaming.streaming()
        app.commit("more", "INSERT INTO public.notes VALUES (2, 'naïve', 2); UPDATE public.notes SET \"✓\" = 3")
        streamed(streaming, source, [sink], "public.notes")
    app.close()
    assert rows(sink, "public.notes") == [("(1,café,3)",), ("(2,naïve,3)",)]
    assert logs(sink) == ["more"]


ITEMS = "CREATE TABLE public.items (id int PRIMARY KEY, v text NOT NULL, n int NOT NULL)"
# a sink's own table and a trigger function that names it without its schema, as applications write them
SEEN = (
    "CREATE TABLE public.seen (id int); CREATE FUNCTION public.saw() RETURNS trigger LANGUAGE plpgsql "
    "AS $$BEGIN INSERT INTO seen VALUES (NEW.id); RETURN NULL; END$$"
)
SAW = "CREATE OR REPLACE FUNCTION public.saw() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN {} RETURN NULL; END$$"


def federated_items(lr_sites, count: int) -> tuple:
    """``public.items`` at site-a with ``count`` rows, federated to both sinks: (topology, the
    application that changes it and transmits an entry with each change)."""
    source, *sinks = lr_sites
    topo = apply(lr_sites)
    source.query(ITEMS)
    source.query(f"INSERT INTO public.items SELECT g, 'v' || g, 0 FROM generate_series(1, {count:d}) g")
    federate(source, "public.items")
    return topo, Application(source, sinks)


def test_a_sink_table_altered_between_streamed_changes_never_takes_one_by_a_stale_definition(lr_sites, round_trips):
    """Each change after the sink's table changed applies as a fresh apply would (the general path
    reads the target anew), or is refused saying why and arrives, once, when the sink is fixed."""
    source, sink, other = lr_sites
    topo, app = federated_items(lr_sites, 20)

    def arrives(what: str) -> None:  # at both sinks, exactly as at the source, its entry once
        wait_for(lambda: logs(sink) == logs(other) == app.sent, 20, what)
        for site in (sink, other):
            assert rows(site, "public.items") == rows(source, "public.items"), what

    def refused(why: str, before: list | None) -> None:  # at site-b only, nothing of it applied there
        wait_for(lambda: said(streaming, "site-b", why), 20, f"site-b to refuse: {why}")
        wait_for(lambda: logs(other) == app.sent, 20, "site-c")
        assert rows(other, "public.items") == rows(source, "public.items")
        assert logs(sink) == app.sent[:-1]
        assert before is None or rows(sink, "public.items") == before

    with streaming_over(topo, lr_sites, as_lr=True) as streaming:  # as lr sync connects (its search_path)
        streaming.streaming()
        for n in (1, 2, 3):
            app.commit(f"warm {n}", f"UPDATE public.items SET n = n + 1 WHERE id = {n}")
            arrives(f"warm {n}")
        in_one_round_trip(round_trips, [sink, other])  # composed from the targets the stream read before

        # a column added: the composed statement would still run, setting it NULL; a fresh apply
        # keeps the sink's value of a column only the sink has (as PostgreSQL's apply does)
        sink.query("ALTER TABLE public.items ADD COLUMN extra int DEFAULT 5")
        app.commit("column added", "UPDATE public.items SET v = 'x', n = n + 1 WHERE id = 4")
        wait_for(lambda: logs(sink) == logs(other) == app.sent, 20, "column added")
        assert sink.query("SELECT id, v, n, extra FROM public.items WHERE id = 4") == source.query(
            "SELECT id, v, n, 5 FROM public.items WHERE id = 4"
        )
        sink.query("ALTER TABLE public.items DROP COLUMN extra")
        arrives("column added, then dropped")
        streaming.streaming()

        # a column added and dropped between two changes: the same shape, the change applies
        sink.query("ALTER TABLE public.items ADD COLUMN extra int; ALTER TABLE public.items DROP COLUMN extra")
        app.commit("column come and gone", "UPDATE public.items SET v = 'y', n = n + 1 WHERE id = 5")
        arrives("column come and gone")

        # a rule that rewrites lr's delete (DO INSTEAD NOTHING) would keep the row, silently (it did,
        # and lr status said nothing): refused, naming the rule, until it is dropped; then it arrives
        sink.query("CREATE RULE keep AS ON DELETE TO public.items DO INSTEAD NOTHING")
        app.commit("rule", "DELETE FROM public.items WHERE id = 19")
        refused("the sink's table public.items has rules that rewrite lr's writes to it (keep)", None)
        sink.query("DROP RULE keep ON public.items")
        arrives("rule dropped")
        # made unlogged: a crash of the sink would empty it while lr's position stays; refused, saying so
        sink.query("ALTER TABLE public.items SET UNLOGGED")
        app.commit("unlogged", "UPDATE public.items SET n = n + 1 WHERE id = 17")
        refused("the sink's table public.items is unlogged: a crash of the sink's server empties it", None)
        sink.query("ALTER TABLE public.items SET LOGGED")
        arrives("logged again")

        # a trigger of the sink's whose function names a table without its schema fails lr's write
        # (lr writes with search_path pg_catalog): the refusal says so and what to do (before: to fix a
        # constraint, trigger or privilege, where the user found none); given its path, the change arrives
        sink.query(
            SEEN + "; CREATE TRIGGER saw AFTER INSERT OR UPDATE ON public.items FOR EACH ROW EXECUTE FUNCTION saw()"
        )
        app.commit("trigger", "UPDATE public.items SET n = n + 1 WHERE id = 18")
        refused("lr writes with search_path = pg_catalog (as PostgreSQL's replication workers do): qualify", None)
        sink.query("ALTER FUNCTION public.saw() SET search_path = public")
        arrives("the trigger's function given its path")
        # one that fails lr's write otherwise (a copy of the source's, writing again what the source
        # replicates): the refusal says how it skips lr's apply; so made, the change arrives
        sink.query(SAW.format("RAISE EXCEPTION 'not by lr';"))
        app.commit("trigger again", "UPDATE public.items SET n = n + 1 WHERE id = 18")
        refused("a trigger that does again what the source's did (writes rows the source replicates too)", None)
        skip = "IF pg_catalog.current_setting('lr.applying', true) = 'on' THEN RETURN COALESCE(NEW, OLD); END IF;"
        assert said(streaming, "site-b", skip[:-1])
        sink.query(SAW.format(skip + " RAISE EXCEPTION 'not by lr';"))
        arrives("the trigger skips lr's apply")
        sink.query(SAW.format("INSERT INTO seen VALUES (NEW.id);"))

        # the table dropped: refused; created again with its shape and rows: the change arrives
        kept = sink.query("SELECT id, v, n FROM public.items ORDER BY id")
        sink.query("DROP TABLE public.items")
        app.commit(
            "table dropped", "UPDATE public.items SET n = n + 1 WHERE id = 6", "DELETE FROM public.items WHERE id = 20"
        )
        refused("table public.items no longer exists on the sink", None)
        restore = ", ".join(f"({i}, '{v}', {n})" for i, v, n in kept)
        in_one_transaction(sink, ITEMS, f"INSERT INTO public.items VALUES {restore}")
        arrives("table created again")
        streaming.streaming()

        # dropped and created again, same shape and rows, between two changes (a restore)
        in_one_transaction(
            sink,
            "CREATE TABLE public.items_copy AS SELECT * FROM public.items",
            "DROP TABLE public.items",
            ITEMS,
            "INSERT INTO public.items SELECT * FROM public.items_copy",
            "DROP TABLE public.items_copy",
        )
        app.commit(
            "table restored",
            "UPDATE public.items SET n = n + 1 WHERE id = 7",
            "INSERT INTO public.items VALUES (21, 'new', 0)",
        )
        arrives("table restored")

        # the sink opens the table as not federated (its session's row turns 'conflict'): the change is
        # dropped there, its entry arrives
        in_one_transaction(
            sink,
            "UPDATE lr.registry SET is_federated = false WHERE stream_name = 'public.items'",
            "UPDATE lr.sink_tables SET state = 'conflict' WHERE table_name = 'public.items'",
        )
        before = rows(sink, "public.items")
        app.commit("conflict", "UPDATE public.items SET v = 'dropped at site-b', n = n + 1 WHERE id = 8")
        wait_for(lambda: logs(sink) == logs(other) == app.sent, 20, "the conflict's entry")
        assert rows(sink, "public.items") == before and rows(other, "public.items") == rows(source, "public.items")
        # ... and federated again: lr takes a new snapshot of it (refused by the trigger, saying so, until
        # its function has its path) and streams on
        sink.query(
            "ALTER FUNCTION public.saw() RESET search_path; CREATE TRIGGER saw AFTER INSERT ON public.items "
            "FOR EACH ROW EXECUTE FUNCTION public.saw()"
        )
        sink.query("UPDATE lr.registry SET is_federated = true WHERE stream_name = 'public.items'")
        wait_for(
            lambda: said(
                streaming,
                "site-b",
                'the sink refused the snapshot of table public.items: relation "seen" does not exist',
            ),
            20,
            "the snapshot refused",
        )
        assert said(streaming, "site-b", "ALTER FUNCTION ... SET search_path = public), and the next cycle takes")
        sink.query("ALTER FUNCTION public.saw() SET search_path = public")
        wait_for(lambda: rows(sink, "public.items") == rows(source, "public.items"), 20, "the new snapshot")
        streaming.streaming()
        app.commit("conflict lifted", "UPDATE public.items SET v = 'z', n = n + 1 WHERE id = 9")
        arrives("conflict lifted")
    app.close()
    assert (
        logs(sink)
        == logs(other)
        == [
            "warm 1",
            "warm 2",
            "warm 3",
            "column added",
            "column come and gone",
            "rule",
            "unlogged",
            "trigger",
            "trigger again",
            "table dropped",
            "table restored",
            "conflict",
            "conflict lifted",
        ]
    )


def test_a_full_sync_requested_while_writers_change_a_streamed_table_leaves_every_sink_equal_to_the_source(
    lr_sites, round_trips
):
    source, sink, other = lr_sites
    topo = apply(lr_sites)
    create_accounts(source, rows=200)
    federate(source)
    with streaming_over(topo, lr_sites) as streaming:
        streaming.streaming()
        with TableWriter(source) as writer:
            wait_for(lambda: writer.transactions >= 30, 30, "writes streamed")
            forced_full_sync_of_site_b(source, streaming)
            wait_for(lambda: any("full sync" in e.reason for e in streaming.streamer.ends), 10, "the hand-back")
            streamed_before, done = len(round_trips.batches["site-b"]), writer.transactions
            wait_for(lambda: writer.transactions >= done + 30, 30, "writes after the full sync")
        wait_for(lambda: all(rows(s) == rows(source) for s in (sink, other)), 30, "every sink equal to the source")
    assert len(round_trips.batches["site-b"]) > streamed_before, "streamed in one round trip after the full sync"
    assert [e.session for e in streaming.streamer.ends if e.handed_back] == ["site-a->site-b/policy"]


def test_a_column_added_at_the_source_while_streaming_is_refused_until_the_sink_has_it_then_arrives_once(
    lr_sites, round_trips
):
    source, sink, other = lr_sites
    topo, app = federated_items(lr_sites, 10)
    with streaming_over(topo, lr_sites) as streaming:
        streaming.streaming()
        for n in (1, 2, 3):
            app.commit(f"warm {n}", f"UPDATE public.items SET n = n + 1 WHERE id = {n}")
            wait_for(lambda: logs(sink) == logs(other) == app.sent, 10, f"warm {n}")
        in_one_round_trip(round_trips, [sink, other])
        source.query("ALTER TABLE public.items ADD COLUMN note text")
        app.commit("noted", "UPDATE public.items SET note = 'n', n = n + 1 WHERE id = 4")
        app.commit("deleted", "DELETE FROM public.items WHERE id = 5")
        for site in (sink, other):
            # naming the column and what to do (before: only the sink's columns, the user to guess which)
            why = "do not fit the sink's table (columns id, v, n): they carry column(s) note, which the sink's table lacks"
            wait_for(lambda: said(streaming, site.site_id, why), 10, f"{site.site_id}")
        assert logs(sink) == logs(other) == ["warm 1", "warm 2", "warm 3"]
        assert sink.query("SELECT count(*) FROM public.items WHERE id = 5") == [(1,)]  # nothing of the batch
        sink.query("ALTER TABLE public.items ADD COLUMN note text")  # one sink gets the column: it goes on
        wait_for(lambda: logs(sink) == app.sent, 20, "site-b, once it has the column")
        assert rows(sink, "public.items") == rows(source, "public.items") and logs(other) == app.sent[:3]
        other.query("ALTER TABLE public.items ADD COLUMN note text")
        wait_for(lambda: logs(other) == app.sent, 20, "site-c, once it has the column")
        streaming.streaming()
        app.commit("later", "UPDATE public.items SET note = 'later' WHERE id BETWEEN 6 AND 8")
        streamed(streaming, source, [sink, other], "public.items")
        wait_for(lambda: logs(sink) == logs(other) == app.sent, 10, "later")
    app.close()
    assert logs(sink) == logs(other) == ["warm 1", "warm 2", "warm 3", "noted", "deleted", "later"]


# Functions and operators named like built-ins lr's statements call, of *other* argument types than
# PostgreSQL's: each is a better match than the built-in for some argument (``unnest(text[])`` beats
# ``unnest(anyarray)``, ``pg_advisory_xact_lock(integer)`` an integer literal's ``bigint``), wherever
# its schema is on the path. Each raises: a statement that reaches one fails, naming it.
LOOKALIKES = (
    ("unnest", "text[]", "SETOF text"),
    ("unnest", "integer[]", "SETOF integer"),
    ("unnest", "bigint[]", "SETOF bigint"),
    ("array_agg", "text", "text[]"),
    ("array_agg", "integer", "integer[]"),
    ("count", "text", "bigint"),
    ("count", "bigint", "bigint"),
    ("jsonb_agg", "jsonb", "jsonb"),
    ("jsonb_build_object", "text, text", "jsonb"),
    ("pg_advisory_xact_lock", "integer", "void"),
    ("pg_try_advisory_xact_lock", "integer", "boolean"),
    ("pg_advisory_xact_lock", "integer, bigint", "void"),
    ("to_timestamp", "integer", "timestamptz"),
    ("length", "varchar", "integer"),
    ("lower", "varchar", "text"),
)
LOOKALIKE_OPERATORS = (("=", "oid", "integer"), ("=", "text", "varchar"), ("||", "text", "integer"))
# Lookalikes of the *same* argument types as the built-ins: they win only where their schema comes
# before pg_catalog on the path, as an application's own connection may have it.
SAME_OPERATORS = (
    ("=", "text", "text"),
    ("=", "bigint", "bigint"),
    ("=", "integer", "integer"),
    ("=", "oid", "oid"),
    ("=", "name", "name"),
    ("<", "bigint", "bigint"),
    (">", "bigint", "bigint"),
    ("<=", "integer", "integer"),
    (">=", "bigint", "bigint"),
    ("<>", "text", "text"),
    ("~~", "text", "text"),
    ("#>>", "jsonb", "text[]"),
    ("->", "jsonb", "text"),
    ("-", "timestamptz", "timestamptz"),
)


def lookalikes(schema: str, same: bool = False) -> str:
    """The SQL that plants the lookalikes in ``schema`` (``same``: the same-type operators there too)."""
    made = [f"CREATE SCHEMA {schema}"]
    for n, (name, args, returns) in enumerate(LOOKALIKES):
        made.append(
            f"CREATE FUNCTION {schema}.{name}({args}) RETURNS {returns} LANGUAGE plpgsql "
            f"AS $$ BEGIN RAISE EXCEPTION 'lookalike {schema}.{name}({args}) called (%%)', {n}; END $$"
        )
    for n, (op, left, right) in enumerate(LOOKALIKE_OPERATORS + (SAME_OPERATORS if same else ())):
        made.append(
            f"CREATE FUNCTION {schema}.op{n}({left}, {right}) RETURNS boolean LANGUAGE plpgsql "
            f"AS $$ BEGIN RAISE EXCEPTION 'lookalike operator {schema}.{op}({left}, {right}) called'; END $$"
        )
        made.append(f"CREATE OPERATOR {schema}.{op} (LEFTARG = {left}, RIGHTARG = {right}, FUNCTION = {schema}.op{n})")
    return "; ".join(made)


@pytest.mark.parametrize("connections", ["lr's own", "keeping the site's path"])
def test_sites_whose_search_path_puts_lookalike_built_ins_before_pg_catalog_still_open_snapshot_and_stream(
    lr_sites, connections
):
    """A schema named before pg_catalog in a site's search_path, holding functions named like the
    built-ins lr's statements call (a ``jsonb_array_elements`` that returns nothing at a sink, an
    ``unnest`` that returns nothing at the source): before, the sink's position moved past every
    streamed change it skipped, silently, and ``lr tables open`` at the source said "no primary key".
    lr's own connections search pg_catalog alone, and the tables' statements name the built-ins with
    their schema (so they hold on a connection that keeps the site's path, as an engine API caller's
    may): the tables stay equal and nothing is refused. Such a caller's full-sync request and
    ``status.site_status`` on that connection call none of its same-type lookalikes (before, both
    failed there: ``lookalike.=(text, text) called``, ``extract(unknown, boolean)``).

    On lr's own connections the sites also hold lookalikes of *other* argument types (which win
    PostgreSQL's overload resolution wherever they are on the path: ``unnest(text[])`` over
    ``unnest(anyarray)``, operators too), each raising when called, and the application's own
    connections (its transmits, its subscriber) search a schema of same-type operators before
    pg_catalog: streaming, the table's snapshot, a transmit, a full sync, the subscriber and
    ``lr status`` never call one. Those sites' sessions also read a backslash in a string as an
    escape (``standard_conforming_strings = off``, a legacy application's): lr's connections read
    their SQL as written, and its statements mean the same on a connection that keeps it (before, every sync of the source failed there, for good: its
    ``'\\x00'::bytea`` read as a NUL character, "invalid byte sequence for encoding UTF8: 0x00")."""
    source, sink_b, sink_c = lr_sites
    topo = apply(lr_sites)
    trap = (
        "CREATE SCHEMA trap; "
        "CREATE FUNCTION trap.jsonb_array_elements(jsonb) RETURNS SETOF jsonb LANGUAGE sql "
        "AS $$ SELECT NULL::jsonb WHERE false $$; "
        "CREATE FUNCTION trap.unnest(anyarray) RETURNS SETOF anyelement LANGUAGE sql "
        "AS $$ SELECT NULL WHERE false $$"
    )
    create_accounts(source, rows=5)
    own = connections == "lr's own"
    for site in (source, sink_b):
        site.query(trap)
        path = "trap, pg_catalog, public"
        if own:
            site.query(lookalikes("lookalike"))
            site.query(lookalikes("apptrap", same=True))
            path = "trap, lookalike, pg_catalog, public"
        site.query(f'ALTER DATABASE "{site.dbname}" SET search_path = {path}')
        # a legacy application's default: a backslash in a string is an escape
        site.query(f'ALTER DATABASE "{site.dbname}" SET standard_conforming_strings = off')
    infos = {s.site_id: conninfo.from_dsn(s.dsn) for s in lr_sites}  # as `lr` connects
    # the application's connections: its own path, a schema of same-type operators first
    apps = {
        s.site_id: conninfo.from_dsn(s.dsn + " options='-c search_path=apptrap,trap,lookalike,pg_catalog,public'")
        for s in lr_sites
    }

    def connect(site: str) -> psycopg2.extensions.connection:
        return infos[site].connect() if own else psycopg2.connect(infos[site].dsn)

    if own:
        lrs = connect("site-a")
    else:  # an engine API caller's connection searching operators of the built-ins' own types first
        source.query(lookalikes("lookalike", same=True))
        lrs = psycopg2.connect(infos["site-a"].dsn, options="-c search_path=lookalike,trap,pg_catalog,public")
    try:
        registry.open_table(lrs, "public.accounts", "policy", True)
        if not own:  # the caller's full-sync request (the cycles take it up) and status on that connection
            full_sync.request_full_sync(lrs, "site-c", "policy", "asked by the application")
            assert "site-c" in status.render(status.site_status(lrs))
    finally:
        lrs.close()
    repl = Replicator(topo, connect, settings=SessionSettings(lease_seconds=2.0))
    with Streaming(repl, FAST) as streaming:
        streaming.streaming()
        source.query("UPDATE public.accounts SET balance = 7 WHERE id < 3")
        source.query("INSERT INTO public.accounts (id, owner) VALUES (50, 'new')")
        streamed(streaming, source, [sink_b, sink_c], "public.accounts")
        if own:
            app = apps["site-a"].connect(Purpose.APPLICATION)
            client = RoutingQueueClient(app, "policy")
            with app.cursor() as cur:
                cur.execute("UPDATE public.accounts SET balance = 8 WHERE id = 4")
            ticket = client.transmit_log_entry_message(b"sent", ["site-b", "site-c"])
            app.commit()
            assert client.serve_full_sync_requests(empty_provider) == []
            client.wait_until_safe(ticket, timeout=20)
            client.wait_until_ready(["site-b", "site-c"], timeout=20)
            assert client.delivery(ticket)
            with app.cursor() as cur:  # the application's path is its own again
                cur.execute("SHOW search_path")
                assert cur.fetchone() == ("apptrap,trap,lookalike,pg_catalog,public",)
            app.close()
            streamed(streaming, source, [sink_b, sink_c], "public.accounts")
            wait_for(lambda: ("log", "sent") in queue(sink_b, "site-a"), 20, "the transmit")
            sub = RoutingQueueSubscriber(apps["site-b"], client_name="policy")
            recorder = Recorder()
            sub.poll(recorder)
            assert recorder.of("site-a") == [("start", ""), ("end", ""), ("log", "sent")], recorder.errors
            sub.close()
            for site in lr_sites:
                conn = infos[site.site_id].connect()
                try:
                    assert "public.accounts" in status.render(status.site_status(conn))
                finally:
                    conn.close()
        assert not [r.error for r in streaming.cycles if r.error] and not [
            e for e in streaming.streamer.ends if e.error
        ]
