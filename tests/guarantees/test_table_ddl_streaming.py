"""DDL done by hand at every site while ``lr sync`` streams a federated table (docs/tables.md,
"Limits": DDL is not replicated): a column added at the sinks first, as PostgreSQL's logical
replication wants it, then at the source; a key column renamed everywhere. The changes made in
between apply, and every sink ends with the source's rows."""

from __future__ import annotations

import time

from airflow_provider_lr.engine.tables import registry
from tests.guarantees.test_table_fidelity_streaming import streaming_over
from tests.support.session import Streaming, apply, wait_for
from tests.support.tables import federate, on_every_site, rows, status_text


def same_rows(source, sinks, what: str) -> None:
    wait_for(lambda: all(rows(s, "public.items") == rows(source, "public.items") for s in sinks), 30, what)


def streaming_items(lr_sites) -> Streaming:
    """``public.items`` (6 rows) federated from site-a to the other sites, to be streamed."""
    source = lr_sites[0]
    topo = apply(lr_sites)
    source.query("CREATE TABLE public.items (id int PRIMARY KEY, note text)")
    source.query("INSERT INTO public.items SELECT g, 'n' || g FROM generate_series(1, 6) g")
    federate(source, "public.items")
    return streaming_over(topo, lr_sites)


def test_a_column_added_at_the_sinks_first_takes_the_changes_made_before_the_source_has_it(lr_sites):
    source, *sinks = lr_sites
    with streaming_items(lr_sites) as streaming:
        streaming.streaming()
        on_every_site(sinks, "ALTER TABLE public.items ADD COLUMN extra int DEFAULT 7")
        # captured without the column: an insert takes the sink's default, an update keeps it
        source.query("UPDATE public.items SET note = 'between' WHERE id = 1")
        source.query("INSERT INTO public.items VALUES (10, 'inserted')")
        source.query("ALTER TABLE public.items ADD COLUMN extra int DEFAULT 7")
        source.query("UPDATE public.items SET extra = 8, id = 20 WHERE id = 2")
        source.query("DELETE FROM public.items WHERE id = 3")
        same_rows(source, sinks, "the changes before and after the source added the column")
        # a column's type changed at the source first: a sink keeping its type would take the values
        # by it (1.2345 rounded to 1.23, for good, and said nothing before); the change is refused,
        # naming the column, until the sink has the type, then arrives as it is
        on_every_site(lr_sites, "ALTER TABLE public.items ADD COLUMN amount numeric(10,2)")
        source.query("ALTER TABLE public.items ALTER COLUMN amount TYPE numeric(10,4)")
        source.query("UPDATE public.items SET amount = 1.2345 WHERE id = 1")
        refused = "column amount is numeric(10,4) on the source but numeric(10,2) on the sink"
        wait_for(lambda: status_text(source).count(refused) == 2, 30, "each sink's refusal in lr status")
        assert rows(sinks[0], "public.items") != rows(source, "public.items")  # nothing of it applied
        on_every_site(sinks, "ALTER TABLE public.items ALTER COLUMN amount TYPE numeric(10,4)")
        same_rows(source, sinks, "the change, once the sinks have the type")
        # widened at the sinks first (every value fits), then at the source less: its changes arrive
        on_every_site(sinks, "ALTER TABLE public.items ALTER COLUMN amount TYPE numeric(14,6)")
        source.query("ALTER TABLE public.items ALTER COLUMN amount TYPE numeric(12,5)")
        source.query("UPDATE public.items SET amount = 1234567.12345 WHERE id = 1")
        wait_for(
            lambda: all(
                s.query("SELECT amount = 1234567.12345 FROM public.items WHERE id = 1") == [(True,)] for s in sinks
            ),
            30,
            "the source's change into the sinks' wider column",
        )
    assert ("(10,inserted,7,)",) in rows(source, "public.items")
    assert ("(1,between,7,1234567.12345)",) in rows(source, "public.items")


def test_a_sink_column_narrowed_after_its_snapshot_refuses_the_changes_naming_it_instead_of_rounding_them(lr_sites):
    """The sinks narrow public.sized's columns after its snapshot (numeric(12,4) to (12,2), varchar(20)
    to (5), timestamp(6) to (0)): a change of them is refused, naming each, with nothing applied,
    until the sinks have the source's types again; then it arrives as it is. A column widened at the
    sinks first (numeric(12,4) to (14,6): every value fits) takes the changes. Before, the sinks took
    1.2345 as 1.23 and 00:00:00.623456 as 00:00:01, for good, and said nothing."""
    source, *sinks = lr_sites
    topo = apply(lr_sites)
    columns = {
        "n": "numeric(12,4)",
        "s": "varchar(20)",
        "ts": "timestamp(6)",
        "w": "numeric(12,4)",
        "a": "numeric(12,4)[]",
    }
    source.query(f"CREATE TABLE public.sized (id int PRIMARY KEY, {', '.join(f'{c} {t}' for c, t in columns.items())})")
    source.query("INSERT INTO public.sized VALUES (1, 1.5, 'x', '2026-01-01', 1, '{1.5}')")
    federate(source, "public.sized")
    with streaming_over(topo, lr_sites) as streaming:
        streaming.streaming()
        wait_for(lambda: all(rows(s, "public.sized") == rows(source, "public.sized") for s in sinks), 30, "snapshot")
        on_every_site(sinks, "ALTER TABLE public.sized ALTER w TYPE numeric(14,6)")  # wider: fine
        source.query("UPDATE public.sized SET w = 2.1234")
        wait_for(lambda: all(s.query("SELECT w = 2.1234 FROM public.sized") == [(True,)] for s in sinks), 30, "widened")
        narrow = "ALTER n TYPE numeric(12,2), ALTER s TYPE varchar(5), ALTER ts TYPE timestamp(0), ALTER a TYPE numeric(12,2)[]"
        on_every_site(sinks, f"ALTER TABLE public.sized {narrow}")
        source.query(
            "INSERT INTO public.sized VALUES (2, 1.2345, 'abcdefgh', '2026-01-01 00:00:00.623456', 3, '{1.2345}')"
        )
        refused = (
            "column n is numeric(12,4) on the source but numeric(12,2) on the sink; column s is character "
            "varying(20) on the source but character varying(5) on the sink; column ts is timestamp(6) without "
            "time zone on the source but timestamp(0) without time zone on the sink; column a is numeric(12,4)[] on "
            "the source but numeric(12,2)[] on the sink"
        )
        wait_for(lambda: status_text(source).count(refused) == 2, 30, "each sink's refusal in lr status")
        assert all(len(rows(s, "public.sized")) == 1 for s in sinks)  # nothing of it applied
        on_every_site(sinks, "ALTER TABLE public.sized " + ", ".join(f"ALTER {c} TYPE {t}" for c, t in columns.items()))
        wait_for(lambda: all(rows(s, "public.sized") == rows(source, "public.sized") for s in sinks), 30, "arrived")
    assert ('(2,1.2345,abcdefgh,"2026-01-01 00:00:00.623456",3.0000,{1.2345})',) in rows(source, "public.sized")


def test_a_key_column_renamed_at_the_source_first_is_refused_naming_it_then_goes_on_by_its_new_name(lr_sites):
    source, *sinks = lr_sites
    with streaming_items(lr_sites) as streaming:
        streaming.streaming()
        source.query("UPDATE public.items SET note = 'before' WHERE id = 5")
        same_rows(source, sinks, "a change before the rename")
        source.query("ALTER TABLE public.items RENAME COLUMN id TO item_id")  # at the source first
        source.query("UPDATE public.items SET item_id = item_id + 100 WHERE item_id <= 2")  # key changes
        # refused until the sinks have the name, saying which columns (before: the sink's, to guess from)
        why = "they carry column(s) item_id, which the sink's table lacks (added or renamed at the source"
        wait_for(lambda: status_text(source).count(why) == 2, 30, "each sink's refusal in lr status")
        assert "they lack the sink's key column(s) id (renamed or dropped at the source" in status_text(source)
        on_every_site(sinks, "ALTER TABLE public.items RENAME COLUMN id TO item_id")
        source.query("DELETE FROM public.items WHERE item_id = 3")
        source.query("UPDATE public.items SET note = 'kept' WHERE item_id = 4")
        same_rows(source, sinks, "the changes after the rename")
    assert len(rows(source, "public.items")) == 5


def test_a_table_renamed_at_the_source_while_streaming_holds_its_sessions_saying_what_to_do_and_loses_nothing(
    lr_sites,
):
    """lr replicates a table by its name: a rename at the source stops its sessions at once, ``lr
    status`` saying so and what to do; renamed back, the changes made meanwhile arrive. Replicated
    under its new name (closed, opened), each sink takes a snapshot of it."""
    source, *sinks = lr_sites
    with streaming_items(lr_sites) as streaming:
        streaming.streaming()
        source.query("ALTER TABLE public.items RENAME TO things")
        said = "last error: StaleBatchError: federated table public.items was renamed to public.things"
        wait_for(lambda: status_text(source).count(said) == 2, 10, "lr status to say it of both sessions")
        ends = [e.reason for e in streaming.streamer.ends]  # what lr sync prints of the hand-back says it too
        assert any("was renamed to public.things" in reason for reason in ends), ends
        source.query("UPDATE public.things SET note = 'while renamed' WHERE id = 1")
        assert "lr tables close public.items, then lr tables open public.things" in status_text(source)
        time.sleep(1)  # held: nothing of the table applied meanwhile
        assert all(sink.query("SELECT note FROM public.items WHERE id = 1") == [("n1",)] for sink in sinks)
        source.query("ALTER TABLE public.things RENAME TO items")  # back: the change made meanwhile arrives
        same_rows(source, sinks, "renamed back")
        streaming.streaming()
        assert "DIVERGED" not in status_text(source)
        source.query("ALTER TABLE public.items RENAME TO things")
        source.query("DELETE FROM public.things WHERE id = 2")
        conn = source.connect()
        registry.close_table(conn, "public.items")  # replicated under its new name
        registry.open_table(conn, "public.things", "policy")
        conn.close()
        source.query("UPDATE public.things SET note = 'under its new name' WHERE id = 3")
        has = "SELECT to_regclass('public.things') IS NOT NULL"
        wait_for(lambda: all(s.query(has) == [(True,)] for s in sinks), 30, "a snapshot of public.things")
        wait_for(lambda: all(rows(s, "public.things") == rows(source, "public.things") for s in sinks), 30, "things")
        streaming.streaming()
    assert "DIVERGED" not in status_text(source)
    assert source.query("SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'lr_capture%%'") == [(4,)]


def test_a_sink_column_made_another_lossy_type_after_its_snapshot_refuses_the_changes_instead_of_changing_them(
    lr_sites,
):
    """The sinks make public.kinds' columns other types after its snapshot. Lossless widenings
    (integer to bigint, varchar(5) to text, real to double precision, smallint to numeric(6,0)) take
    the changes; timestamptz made timestamp (the zone dropped), double precision made real (digits
    rounded) and numeric made integer are refused, naming each column and both types, with nothing
    applied, until the sinks have the source's types again. Before, only a narrower modifier of the
    same type was refused: 2026-01-01 00:00+05 arrived as 2025-12-31 19:00 and 1.23456789012 as 1.2345679."""
    source, *sinks = lr_sites
    topo = apply(lr_sites)
    columns = {"t": "timestamptz", "d": "double precision", "n": "numeric", "w": "int", "v": "varchar(5)",
               "r": "real", "s": "smallint"}  # fmt: skip
    source.query(f"CREATE TABLE public.kinds (id int PRIMARY KEY, {', '.join(f'{c} {t}' for c, t in columns.items())})")
    source.query("INSERT INTO public.kinds VALUES (1, NULL, NULL, NULL, NULL, NULL, NULL, NULL)")
    federate(source, "public.kinds")

    def same() -> bool:
        return all(rows(s, "public.kinds") == rows(source, "public.kinds") for s in sinks)

    with streaming_over(topo, lr_sites) as streaming:
        streaming.streaming()
        wait_for(same, 30, "snapshot")
        wider = "ALTER w TYPE bigint, ALTER v TYPE text, ALTER r TYPE double precision, ALTER s TYPE numeric(6,0)"
        on_every_site(sinks, f"ALTER TABLE public.kinds {wider}")
        source.query("UPDATE public.kinds SET w = 2147483647, v = 'abcde', r = 1.5, s = -32768")
        wait_for(same, 30, "the change, into the widened columns")
        on_every_site(sinks, "ALTER TABLE public.kinds ALTER t TYPE timestamp, ALTER d TYPE real, ALTER n TYPE int")
        source.query("INSERT INTO public.kinds VALUES (2, '2026-01-01 00:00:00+05', 1.23456789012, 1.5, 1, 'x', 1, 1)")
        refused = (
            "column t is timestamp with time zone on the source but timestamp without time zone on the sink; "
            "column d is double precision on the source but real on the sink; column n is numeric on the source "
            "but integer on the sink"
        )
        wait_for(lambda: status_text(source).count(refused) == 2, 30, "each sink's refusal in lr status")
        assert all(s.query("SELECT 1 FROM public.kinds WHERE id = 2") == [] for s in sinks)  # refused, not changed
        on_every_site(sinks, "ALTER TABLE public.kinds " + ", ".join(f"ALTER {c} TYPE {t}" for c, t in columns.items()))
        wait_for(same, 30, "the change, once the sinks have the source's types")
