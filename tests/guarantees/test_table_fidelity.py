"""Federated tables carry what the writer wrote, whatever the table: column names like the words of
lr's own SQL never break the writer's statement, a valid source transaction always applies at the
sink (in the source's order), and every built-in type arrives exactly."""

from __future__ import annotations

from airflow_provider_lr.engine.tables import sink as table_sink
from tests.support.session import apply, replicator
from tests.support.tables import (
    CONSTRAINT_SCENARIOS,
    PEOPLE,
    PEOPLE_ROWS,
    TYPES_DDL,
    create_accounts,
    cycle_errors,
    every_type_table,
    federate,
    hostile_table,
    in_one_transaction,
    insert_every_type,
    on_every_site,
    rows,
    status_text,
    sync,
    type_differences,
)


def test_a_table_whose_columns_are_named_like_the_capture_triggers_words_is_captured_and_applied(lr_sites):
    source, *sinks = lr_sites
    topo = apply(lr_sites)
    hostile_table(source, "hostile", ["n"])
    hostile_table(source, "hostile2", ["nonkey", "select"])  # a composite key of hostile names
    source.query(
        "INSERT INTO public.hostile (n, nonkey, \"with space\") SELECT g, 'v' || g, 's' FROM generate_series(1, 5) g"
    )
    federate(source, "public.hostile")
    federate(source, "public.hostile2")
    repl = replicator(topo, lr_sites)
    sync(repl)
    # every kind of statement, in the writer's transaction: none may fail
    source.query(
        'INSERT INTO public.hostile (n, nonkey, op, "MixedCase", tags) '
        "SELECT g, 'new' || g, 'u', 'M', '{1}' FROM generate_series(6, 1200) g"
    )  # several entries
    source.query(
        "UPDATE public.hostile SET nonkey = 'changed', \"row\" = '{r}', data = '\"d\"', lr_row = '{1}', "
        "lr_image = '[1,  2]' WHERE n <= 600"
    )
    source.query("UPDATE public.hostile SET n = n + 5000 WHERE n BETWEEN 10 AND 20")  # key changes
    source.query("DELETE FROM public.hostile WHERE n BETWEEN 30 AND 40")
    source.query(
        "INSERT INTO public.hostile2 (nonkey, \"select\", n, k) SELECT g, g %% 3, 'x', 'y' "
        "FROM generate_series(1, 30) g"
    )
    source.query('UPDATE public.hostile2 SET "select" = "select" + 10 WHERE nonkey < 10')  # key changes
    source.query("UPDATE public.hostile2 SET lr = 'l', \"from\" = 'f' WHERE nonkey >= 10")
    source.query("DELETE FROM public.hostile2 WHERE nonkey = 29")
    assert cycle_errors(sync(repl)) == []
    for sink in sinks:
        assert rows(sink, "public.hostile") == rows(source, "public.hostile")
        assert rows(sink, "public.hostile2") == rows(source, "public.hostile2")
    assert len(rows(source, "public.hostile")) == 1200 - 11


def test_transactions_valid_at_the_source_apply_at_a_sink_with_the_same_constraints(lr_sites):
    source, *sinks = lr_sites
    topo = apply(lr_sites)
    on_every_site(lr_sites, PEOPLE)
    source.query(PEOPLE_ROWS)
    federate(source, "public.people")
    repl = replicator(topo, lr_sites)
    sync(repl)
    for what, statements in CONSTRAINT_SCENARIOS.items():
        if statements:
            in_one_transaction(source, *statements)
        assert cycle_errors(sync(repl)) == [], what
        for sink in sinks:
            assert rows(sink, "public.people") == rows(source, "public.people"), what
    # the same history again from the start, all of it in one batch (one sink transaction)
    in_one_transaction(
        source,
        "DELETE FROM public.people",
        PEOPLE_ROWS,
    )
    for statements in CONSTRAINT_SCENARIOS.values():
        if statements:
            in_one_transaction(source, *statements)
    assert cycle_errors(sync(repl)) == []
    for sink in sinks:
        assert rows(sink, "public.people") == rows(source, "public.people")


def test_changes_of_two_tables_apply_in_the_source_order_across_tables(lr_sites):
    source, *sinks = lr_sites
    topo = apply(lr_sites)
    on_every_site(lr_sites, "CREATE TABLE public.parents (id int PRIMARY KEY, name text)")
    on_every_site(
        lr_sites, "CREATE TABLE public.children (id int PRIMARY KEY, parent int NOT NULL REFERENCES public.parents)"
    )
    federate(source, "public.parents")
    federate(source, "public.children")
    repl = replicator(topo, lr_sites)
    sync(repl)
    in_one_transaction(
        source,
        "INSERT INTO public.parents VALUES (1, 'a'), (2, 'b')",
        "INSERT INTO public.children VALUES (10, 1), (20, 2)",
    )
    sync(repl)
    in_one_transaction(
        source,
        "DELETE FROM public.children WHERE parent = 1",
        "DELETE FROM public.parents WHERE id = 1",
        "INSERT INTO public.parents VALUES (3, 'c')",
        "UPDATE public.children SET parent = 3",
    )
    assert cycle_errors(sync(repl)) == []
    for sink in sinks:
        assert rows(sink, "public.parents") == rows(source, "public.parents")
        assert rows(sink, "public.children") == rows(source, "public.children")


def test_a_batch_the_sink_refuses_shows_in_status_and_applies_by_itself_once_the_sink_is_fixed(lr_sites):
    source, sink, other = lr_sites
    topo = apply(lr_sites)
    create_accounts(source, rows=20)
    federate(source)
    repl = replicator(topo, lr_sites)
    sync(repl)
    sink.query("ALTER TABLE public.accounts ADD CONSTRAINT small CHECK (balance < 1000)")  # the source has none
    source.query("UPDATE public.accounts SET balance = 5000, owner = 'rich' WHERE id = 3")
    source.query("INSERT INTO public.accounts (id, owner) VALUES (100, 'after')")
    errors = cycle_errors(sync(repl, cycles=3))
    assert errors and all("site-a->site-b/policy" in e for e in errors)
    assert any(
        'the sink refused table public.accounts: new row for relation "accounts" violates check constraint "small"' in e
        for e in errors
    )
    shown = [line for line in status_text(source).splitlines() if "the sink refused" in line]
    assert len(shown) == 1 and "fix it there" in shown[0]  # one line, naming the fix
    assert sink.query("SELECT owner FROM public.accounts WHERE id IN (3, 100) ORDER BY id") == [("owner3",)]
    assert rows(other) == rows(source)  # the other sink is not held back
    sink.query("ALTER TABLE public.accounts DROP CONSTRAINT small")
    assert cycle_errors(sync(repl)) == []
    assert rows(sink) == rows(source)
    assert "the sink refused" not in status_text(source)


# Every built-in type (and user-defined enum, composite, domain, in and out of arrays) with its
# edge values. (column, type, SQL value of row 2, of row 3); row 1 is NULL in every column.
def test_every_built_in_type_round_trips_through_the_snapshot_and_through_changes(lr_sites):
    source, *sinks = lr_sites
    topo = apply(lr_sites)
    for site in lr_sites:  # the sink requires the table's own types: lr does not create them
        if site is not source:  # ... and they have other oids there (binary COPY must not carry them)
            site.query("CREATE TYPE public.unrelated AS (x int); CREATE TYPE public.unrelated2 AS ENUM ('y')")
        for ddl in TYPES_DDL:
            site.query(ddl)
    every_type_table(source, "every_type")
    insert_every_type(source, "every_type", 1)  # carried by the snapshot (binary COPY)
    federate(source, "public.every_type")
    repl = replicator(topo, lr_sites)
    assert cycle_errors(sync(repl)) == []
    for sink in sinks:
        assert type_differences(source, sink, "every_type") == []
    insert_every_type(source, "every_type", 11)  # carried as changes
    source.query("UPDATE public.every_type SET id = id + 100 WHERE id = 12")  # a key change moves every value
    assert cycle_errors(sync(repl)) == []
    for sink in sinks:
        assert type_differences(source, sink, "every_type") == []


def test_a_statement_changing_large_rows_is_captured_in_entries_within_the_payload_limit_and_arrives(lr_sites):
    """7 rows of 1.5 MB changed by one UPDATE, in a table of plain columns and in one whose images
    carry a column as text (jsonb): the capture cuts a statement's rows at about 8 MiB too (an entry
    ends with the row that passes it), within the 16 MiB every reader's memory budget is built on
    (docs/memory.md). Before, each was one 10.5 MB entry, 500 rows of 1 MB one of 500 MB, and a
    statement whose rows passed 256 MiB failed in the writer's own statement (jsonb's limit)."""
    source, *sinks = lr_sites
    topo = apply(lr_sites)
    for table in ("public.docs", "public.docs_j"):
        extra = ", meta jsonb" if table == "public.docs_j" else ""
        source.query(f"CREATE TABLE {table} (id int PRIMARY KEY, body text{extra})")
        source.query(f"INSERT INTO {table} SELECT g, '' FROM generate_series(1, 7) g")
        federate(source, table)
    repl = replicator(topo, lr_sites)
    sync(repl)
    for table in ("public.docs", "public.docs_j"):
        source.query(f"UPDATE {table} SET body = repeat(id::text || '--', 500000)")  # 1.5 MB each
    sizes = source.query("SELECT octet_length(message) FROM lr.log_entries WHERE table_id IS NOT NULL")
    assert len(sizes) == 4 and max(size for (size,) in sizes) <= 10 * 1024 * 1024, sizes  # 6 rows, 1 row
    assert cycle_errors(sync(repl)) == []
    for sink in sinks:
        for table in ("public.docs", "public.docs_j"):
            digest = f"SELECT md5(string_agg(body, ',' ORDER BY id)) FROM {table}"
            assert sink.query(digest) == source.query(digest)


def test_a_sink_without_the_tables_own_types_is_refused_naming_them_until_it_creates_them(lr_sites):
    source, sink, other = lr_sites
    topo = apply(lr_sites)
    for site in (source, other):
        for ddl in TYPES_DDL:
            site.query(ddl)
    source.query("CREATE TABLE public.moods (id int PRIMARY KEY, m public.mood, p public.pair[], n numeric(12, 4))")
    source.query("INSERT INTO public.moods VALUES (1, 'ok', ARRAY[ROW(1, 'a', 'sad')::public.pair], 1.5)")
    federate(source, "public.moods")
    repl = replicator(topo, lr_sites)
    errors = cycle_errors(sync(repl, cycles=3))
    assert any(
        "site-a->site-b/policy: table public.moods uses type(s) public.mood, public.pair[] that the sink "
        "does not have" in e
        for e in errors
    ), errors
    assert sink.query("SELECT to_regclass('public.moods') IS NULL") == [(True,)]
    assert rows(other, "public.moods") == rows(source, "public.moods")
    for ddl in TYPES_DDL:
        sink.query(ddl)
    assert cycle_errors(sync(repl)) == []
    assert rows(sink, "public.moods") == rows(source, "public.moods")


TRAP = """
CREATE SCHEMA trap;
CREATE FUNCTION trap.pg_current_xact_id() RETURNS xid8 LANGUAGE sql AS $$ SELECT '1'::xid8 $$;
CREATE FUNCTION trap.to_jsonb(anyelement) RETURNS jsonb LANGUAGE sql AS $$ SELECT 'null'::jsonb $$;
CREATE DOMAIN trap.text AS pg_catalog.varchar(1);
CREATE TYPE trap.bytea AS (x int);
CREATE TABLE trap.pg_prepared_statements (name text);
INSERT INTO trap.pg_prepared_statements VALUES ('lr_transmit_v3');
CREATE TABLE trap.log_entries (x int);
CREATE TABLE trap.pg_locks (AS_OF int);
CREATE TABLE trap.pg_locks_like AS SELECT * FROM pg_catalog.pg_locks LIMIT 0;
DROP TABLE trap.pg_locks;
ALTER TABLE trap.pg_locks_like RENAME TO pg_locks;
"""


def test_a_writer_whose_search_path_puts_lookalikes_of_lrs_names_first_transmits_and_is_captured(lr_sites):
    from airflow_provider_lr.client import LRMessageWithDestinations, RoutingQueueClient
    from tests.support.session import queue

    source, sink, _ = lr_sites
    topo = apply(lr_sites)
    create_accounts(source)
    federate(source)
    repl = replicator(topo, lr_sites)
    sync(repl)
    source.query(TRAP)
    conn = source.connect()
    try:
        with conn.cursor() as cur:  # the application's session: its schema before pg_catalog
            cur.execute("SET search_path = trap, pg_catalog, public")
        conn.commit()
        client = RoutingQueueClient(conn, "policy")
        with conn.cursor() as cur:
            cur.execute("INSERT INTO accounts (id, owner, tags, note) VALUES (1, 'trapped', '{a}', '{\"k\": 1}')")
            cur.execute("UPDATE accounts SET balance = 2 WHERE id = 1")
        ticket = client.transmit_log_entry_message(b"one", [sink.site_id])
        client.transmit_log_entry_messages(
            [LRMessageWithDestinations(b"two", [sink.site_id]), LRMessageWithDestinations(b"three", [sink.site_id])]
        )
        with conn.cursor() as cur:
            cur.execute("SELECT pg_catalog.pg_current_xact_id()::pg_catalog.text")
            (tx,) = cur.fetchone()
        conn.commit()
        assert ticket.tx == int(tx)
        assert client.delivery(ticket) is not None
    finally:
        conn.close()
    assert cycle_errors(sync(repl)) == []
    assert [p for k, p in queue(sink) if k == "log"] == ["one", "two", "three"]
    assert rows(sink) == rows(source) and len(rows(sink)) == 1


def test_the_commit_barrier_on_a_writers_connection_sees_commits_in_flight_whatever_its_search_path(lr_sites):
    """A client's full-sync supply waits for the commits in flight on the writer's connection: an
    empty table of the writer's named pg_locks must not hide a prepared transaction's commit."""
    from airflow_provider_lr.client import RoutingQueueClient
    from airflow_provider_lr.engine.source.commit_barrier import commit_barrier

    source, sink, _ = lr_sites
    apply(lr_sites)
    source.query(TRAP)
    prepared = source.connect()
    RoutingQueueClient(prepared, "policy").transmit_log_entry_message(b"prepared", [sink.site_id])
    with prepared.cursor() as cur:
        cur.execute("PREPARE TRANSACTION 'lr-trap-gid'")
    prepared.close()
    writer = source.connect()
    try:
        with writer.cursor() as cur:
            cur.execute("SET search_path = trap, pg_catalog, public")
        writer.commit()
        position, holders = commit_barrier(writer, timeout=0.3)
        assert position is None and [h.gid for h in holders] == ["lr-trap-gid"]
    finally:
        writer.close()
        admin = source.connect()
        admin.autocommit = True
        with admin.cursor() as cur:
            cur.execute("ROLLBACK PREPARED 'lr-trap-gid'")
        admin.close()


def test_money_is_captured_and_applied_under_one_lc_monetary_whatever_the_sites_sessions_have(lr_sites):
    """A change's money travels as its text: printed by the capture, read by the sink's apply. Both
    under lc_monetary C, not each site's session's: between sites whose lc_monetary differ, a sink
    read '1234.5' printed by a C writer as 12.345,00 € (de_DE), or refused '$1,234.50', that batch
    and every later change of the session, for good (reproduced with a de_DE locale, which the test
    servers do not have: here, that the capture and the apply pin it; a session of a writer or of
    the sink set to another locale (POSIX) does not change it)."""
    source, sink, _ = lr_sites
    config = source.query("SELECT proconfig FROM pg_proc WHERE oid = 'lr.capture_table_changes()'::regprocedure")
    assert "lc_monetary=C" in config[0][0]
    conn = sink.connect()
    try:
        with conn.cursor() as cur:
            cur.execute("SET lc_monetary = 'POSIX'")
            table_sink.applying(cur)
            cur.execute("SELECT current_setting('lc_monetary')")
            assert cur.fetchone() == ("C",)
    finally:
        conn.close()
