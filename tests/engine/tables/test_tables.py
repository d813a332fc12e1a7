"""Federated tables: captured in the writer's transaction, snapshotted from one exported
snapshot, applied at every sink in commit order; the registry's rules and the seam."""

from __future__ import annotations

import time

import pytest

from airflow_provider_lr.client import RoutingQueueClient
from airflow_provider_lr.engine.errors import FullSyncError, TableError
from airflow_provider_lr.engine.site import status
from airflow_provider_lr.engine.source import full_sync
from airflow_provider_lr.engine.tables import closed_notes, handover, registry
from airflow_provider_lr.engine.vocabulary import SessionKey
from tests.support.session import apply, apply_to, queue, replicator, run_crashing_replicator, wait_for
from tests.support.tables import (
    TableWriter,
    create_accounts,
    cycle_errors,
    federate,
    rows,
    site_status,
    status_text,
    sync,
    two_sources_into_one_sink,
)


def test_rows_before_federation_and_changes_during_and_after_reach_both_sinks_row_for_row(lr_sites):
    source, *sinks = lr_sites
    topo = apply(lr_sites)
    create_accounts(source, rows=500)
    federate(source)
    repl = replicator(topo, lr_sites)
    with TableWriter(source) as writer:
        for _ in range(6):
            repl.run_cycle()
        deadline = time.monotonic() + 30
        while writer.transactions <= 50:  # more than 50 changes during the cycles, however fast they ran
            assert time.monotonic() < deadline, f"the writer made {writer.transactions} changes in 30 s"
            repl.run_cycle()
    sync(repl)
    expected = rows(source)
    assert writer.transactions > 50
    for sink in sinks:
        assert rows(sink) == expected


def test_a_transaction_that_changes_a_table_and_transmits_arrives_whole_in_one_order(lr_sites):
    source, sink, _ = lr_sites
    topo = apply(lr_sites)
    create_accounts(source)
    federate(source)
    repl = replicator(topo, lr_sites)
    sync(repl)
    conn = source.connect()
    client = RoutingQueueClient(conn, "policy")
    for i in range(1, 6):
        with conn.cursor() as cur:
            cur.execute("INSERT INTO public.accounts (id, owner) VALUES (%s, 'x')", (i,))
        client.transmit_log_entry_message(f"row {i}".encode(), [sink.site_id])
        conn.commit()
    with conn.cursor() as cur:  # rolled back: neither the row nor the message
        cur.execute("INSERT INTO public.accounts (id, owner) VALUES (99, 'gone')")
    client.transmit_log_entry_message(b"gone", [sink.site_id])
    conn.rollback()
    conn.close()
    # one sink transaction per batch: row i and message i are applied together
    sync(repl)
    assert [r[0] for r in sink.query("SELECT id FROM public.accounts ORDER BY id")] == [1, 2, 3, 4, 5]
    assert [p for k, p in queue(sink) if k == "log"] == [f"row {i}" for i in range(1, 6)]
    # a writer in session_replication_role = replica (a superuser's restore, another replication
    # tool's apply) skipped every trigger not ENABLE ALWAYS: its changes were not captured (the sink
    # kept the old rows, nothing said) and its transmit drew no commit position (never delivered)
    conn = source.connect()
    with conn.cursor() as cur:
        cur.execute("SET session_replication_role = replica")
        cur.execute("INSERT INTO public.accounts (id, owner) VALUES (10, 'restored')")
        cur.execute("UPDATE public.accounts SET owner = 'changed' WHERE id = 1")
        cur.execute("DELETE FROM public.accounts WHERE id = 2")
        RoutingQueueClient(conn, "policy").transmit_log_entry_message(b"under replica", [sink.site_id])
        conn.commit()
        cur.execute("TRUNCATE public.accounts; INSERT INTO public.accounts (id, owner) VALUES (7, 'after')")
    conn.commit()
    conn.close()
    sync(repl)
    assert rows(sink) == rows(source) and len(rows(sink)) == 1
    assert [p for k, p in queue(sink) if k == "log"][5:] == ["under replica"]
    # a restore with --disable-triggers disables them (enabled at its end): while they are, lr status says so
    source.query("ALTER TABLE public.accounts DISABLE TRIGGER ALL")
    said = [d.describe() for d in diverged(source)]
    assert said == [
        "public.accounts DIVERGED (client policy): captured here but its capture trigger(s) lr_capture_delete, "
        "lr_capture_insert, lr_capture_truncate, lr_capture_update are disabled: changes are not replicated (reopen "
        "it: lr tables open, which enables them; or its owner: ALTER TABLE public.accounts ENABLE ALWAYS TRIGGER ...)"
    ], said
    federate(source)  # opened again: enabled (always), the same federation
    assert diverged(source) == [] and rows(sink) == rows(source)


def diverged(site) -> list:
    """What ``lr status`` says of a site's tables that do not replicate (``handover.diverged``)."""
    conn = site.connect()
    try:
        return handover.diverged(conn)
    finally:
        conn.close()


def test_updates_key_changes_deletes_and_truncate_apply_exactly(lr_sites):
    source, sink, _ = lr_sites
    topo = apply(lr_sites)
    create_accounts(source, rows=50)
    federate(source)
    repl = replicator(topo, lr_sites)
    sync(repl)
    source.query("UPDATE public.accounts SET id = id + 1000")  # every key changes
    source.query("UPDATE public.accounts SET id = id - 1000 WHERE id > 1040")  # ... and some back to old keys
    source.query("UPDATE public.accounts SET id = id - 1030 WHERE id BETWEEN 1031 AND 1035")  # 1..5 again
    source.query("UPDATE public.accounts SET balance = -1 WHERE id %% 7 = 0")
    source.query("DELETE FROM public.accounts WHERE id BETWEEN 10 AND 20")
    sync(repl)
    assert rows(sink) == rows(source)
    source.query("BEGIN; TRUNCATE public.accounts; INSERT INTO public.accounts (id, owner) VALUES (1, 'after'); COMMIT")
    sync(repl)
    assert rows(sink) == rows(source) == [(r[0],) for r in source.query("SELECT t::text FROM public.accounts t")]
    assert len(rows(sink)) == 1


def test_opening_a_table_without_primary_key_or_for_an_unknown_client_is_refused(lr_sites):
    source = lr_sites[0]
    apply(lr_sites)
    source.query("CREATE TABLE public.nokey (a int)")
    with pytest.raises(TableError, match="no primary key"):
        federate(source, "public.nokey")
    # a key each site computes itself: every change after the snapshot would be refused at the sinks
    source.query("CREATE TABLE public.genkey (a int NOT NULL, id int GENERATED ALWAYS AS (a * 10) STORED PRIMARY KEY)")
    with pytest.raises(TableError, match=r"primary key has generated columns \(id\)"):
        federate(source, "public.genkey")
    # a type binary COPY cannot carry (aclitem has no binary output), alone or in an array or a domain:
    # before, opened, and then every snapshot of the table failed at every cycle, for good
    source.query("CREATE DOMAIN public.grant_list AS aclitem[]")
    source.query("CREATE TABLE public.grants (id int PRIMARY KEY, a aclitem, g public.grant_list, ok int[])")
    with pytest.raises(TableError, match=r"column\(s\) a \(aclitem\), g \(aclitem\) have a type without binary"):
        federate(source, "public.grants")
    create_accounts(source)
    with pytest.raises(TableError, match="not in the topology"):
        federate(source, client="nobody")
    with pytest.raises(TableError, match="does not exist"):
        federate(source, "public.missing")
    assert registry.list_tables(source.connect()) == []
    # a client this site gave away (its source moved to site-b): its changes would reach no session
    apply(lr_sites, [{"source": "site-b", "sinks": ["site-a", "site-c"], "clients": ["policy"]}])
    with pytest.raises(TableError, match="not replicated from this site: it is replicated from site site-b now"):
        federate(source, client="policy")
    assert registry.list_tables(source.connect()) == []


def test_a_sink_that_opened_the_table_as_not_federated_keeps_out_and_shows_the_conflict(lr_sites):
    source, refusing, taking = lr_sites
    topo = apply(lr_sites)
    create_accounts(source, rows=20)
    create_accounts(refusing)
    refusing.query("INSERT INTO public.accounts (id, owner) VALUES (1, 'local')")
    federate(refusing, federated=False)
    federate(source)
    repl = replicator(topo, lr_sites)
    sync(repl)
    source.query("UPDATE public.accounts SET owner = 'changed' WHERE id < 5")
    sync(repl)
    assert rows(taking) == rows(source)
    assert refusing.query("SELECT id, owner FROM public.accounts") == [(1, "local")]  # nothing applied
    assert refusing.query(
        "SELECT is_federated, source_site_id FROM lr.registry WHERE stream_name = 'public.accounts'"
    ) == [(False, None)]  # its registry entry is not overwritten
    shown = status_text(refusing)
    assert "public.accounts" in shown and "conflict from site-a->site-b/policy" in shown
    assert "not federated (its data from sources is dropped here)" in shown


def test_a_sink_holding_a_copy_that_opens_the_table_as_not_federated_keeps_out_from_then_on(lr_sites):
    """docs/tables.md's example, in its order: the table opened at the source, then kept out at a sink
    (``lr tables open ... --no-federated --site site-c``). With a replicator running, that sink holds
    its copy by then; before, the copy stayed ``synced`` and every later change was applied there,
    though the sink had said it keeps out (and ``lr status`` said synced)."""
    source, refusing, taking = lr_sites
    topo = apply(lr_sites)
    create_accounts(source, rows=10)
    federate(source)
    repl = replicator(topo, lr_sites)
    sync(repl)
    assert rows(refusing) == rows(source)  # the copy, taken before the sink keeps out
    federate(refusing, federated=False)
    source.query("UPDATE public.accounts SET owner = 'changed' WHERE id < 5")
    sync(repl)
    assert rows(taking) == rows(source)
    assert refusing.query("SELECT count(*) FROM public.accounts WHERE owner = 'changed'") == [(0,)]  # kept out
    assert refusing.query("SELECT count(*) FROM public.accounts") == [(10,)]  # its rows kept, its own now
    shown = status_text(refusing)
    assert "conflict from site-a->site-b/policy" in shown, shown
    assert "not federated (its data from sources is dropped here)" in shown


def test_a_table_the_sink_never_opened_is_created_registered_and_applied(lr_sites):
    source, sink, _ = lr_sites
    topo = apply(lr_sites)
    create_accounts(source, rows=30)
    federate(source)
    sync(replicator(topo, lr_sites))
    assert rows(sink) == rows(source)
    assert sink.query(
        "SELECT kind, is_federated, source_site_id, client_name FROM lr.registry WHERE stream_name = 'public.accounts'"
    ) == [("table", True, "site-a", "policy")]
    shape = (
        "SELECT column_name, data_type, is_nullable FROM information_schema.columns "
        "WHERE table_name = 'accounts' ORDER BY ordinal_position"
    )
    assert sink.query(shape) == source.query(shape)
    assert "synced from site-a->site-b/policy, 30 rows in its snapshot" in status_text(sink)


def test_two_sources_into_one_sink_table_never_clear_each_others_rows(lr_sites):
    a, b, sink = lr_sites
    topo = two_sources_into_one_sink(lr_sites)
    create_accounts(a, rows=50)  # keys 1..50
    create_accounts(b, rows=50, start=1000)  # keys 1001..1050
    federate(a)
    repl = replicator(topo, lr_sites)
    sync(repl)
    federate(b)  # the second source's snapshot must not clear a's rows (CorfuDB #3502)
    sync(repl)
    assert rows(sink) == sorted(rows(a) + rows(b))
    # each source's snapshot again (re-federated: a new snapshot each), and a TRUNCATE at one
    federate(a, federated=False)
    federate(a)
    federate(b, federated=False)
    federate(b)
    sync(repl)
    assert rows(sink) == sorted(rows(a) + rows(b))
    b.query("TRUNCATE public.accounts")
    b.query("INSERT INTO public.accounts (id, owner) VALUES (2000, 'b')")
    a.query("UPDATE public.accounts SET owner = 'a2' WHERE id < 10")
    sync(repl)
    assert rows(sink) == sorted(rows(a) + rows(b))
    assert len(rows(sink)) == 51
    a.query("TRUNCATE public.accounts")
    sync(repl)
    assert rows(sink) == rows(b)
    # closed at a (the sink told, as lr tables close tells it), then b's snapshot again: the close is
    # a's, b's snapshot does not end it. Before, any snapshot of the table cleared the sink's mark, so
    # a failover of a's sessions promoting the sink federated the closed table again
    conn = a.connect()
    try:
        registry.close_table(conn, "public.accounts")
    finally:
        conn.close()
    conn = sink.connect()
    try:
        assert closed_notes.note_closed_copy(conn, "public.accounts", "site-a", "policy")
    finally:
        conn.close()
    federate(b, federated=False)
    federate(b)
    b.query("INSERT INTO public.accounts (id, owner) VALUES (2001, 'b')")
    sync(repl)
    assert rows(sink) == rows(b)
    conn = sink.connect()
    try:
        with conn.cursor() as cur:
            assert closed_notes.closed_copies(cur, "site-a", "policy") == {"public.accounts"}
            assert closed_notes.closed_copies(cur, "site-b", "policy") == set()
    finally:
        conn.close()


def test_a_sink_table_of_another_shape_refuses_the_session_until_it_is_fixed(lr_sites):
    source, sink, _ = lr_sites
    topo = apply(lr_sites)
    create_accounts(source, rows=10)
    sink.query("CREATE TABLE public.accounts (id bigint PRIMARY KEY, owner text NOT NULL)")  # columns missing
    federate(source)
    repl = replicator(topo, lr_sites)
    reports = sync(repl, cycles=3)
    assert any("differs between source and sink" in (r.error or "") for r in reports)
    assert sink.query("SELECT count(*) FROM public.accounts") == [(0,)]
    assert "column balance is missing on the sink" in status_text(source)
    sink.query("DROP TABLE public.accounts")
    sync(repl)
    assert rows(sink) == rows(source)
    # the source's table changes shape later: the batch is refused whole, then applies once fixed
    source.query("ALTER TABLE public.accounts ADD COLUMN region text")
    source.query("UPDATE public.accounts SET region = 'eu' WHERE id <= 3")
    source.query("INSERT INTO public.accounts (id, owner) VALUES (500, 'new')")
    reports = sync(repl, cycles=3)
    assert any("do not fit the sink's table" in (r.error or "") for r in reports)
    assert sink.query("SELECT count(*) FROM public.accounts WHERE id = 500") == [(0,)]
    sink.query("ALTER TABLE public.accounts ADD COLUMN region text")
    sync(repl)
    assert rows(sink) == rows(source)


def test_a_table_federated_during_a_snapshot_joins_at_the_next_one_with_nothing_lost(lr_sites, monkeypatch):
    from airflow_provider_lr.engine.tables import snapshot

    source, *sinks = lr_sites
    topo = apply(lr_sites)
    create_accounts(source, rows=40)
    source.query("CREATE TABLE public.orders (id int PRIMARY KEY, item text)")
    source.query("INSERT INTO public.orders SELECT g, 'i' || g FROM generate_series(1, 10) g")
    federate(source)
    opened = snapshot.TableSnapshot.open

    def open_then_federate(self):
        split = opened(self)
        if not any(str(t) == "public.orders" for t in self.definitions):
            federate(source, "public.orders")  # during the accounts snapshot: not in it
            source.query("INSERT INTO public.orders VALUES (11, 'during')")
        return split

    monkeypatch.setattr(snapshot.TableSnapshot, "open", open_then_federate)
    repl = replicator(topo, lr_sites)
    reports = sync(repl)
    assert any("public.orders" in " ".join(r.tables) for r in reports)
    source.query("UPDATE public.orders SET item = 'after' WHERE id = 1")
    sync(repl)
    for sink in sinks:
        assert rows(sink) == rows(source)
        assert rows(sink, "public.orders") == rows(source, "public.orders")


def test_a_table_federated_again_gets_a_new_snapshot_with_the_changes_made_in_between(lr_sites):
    source, sink, _ = lr_sites
    topo = apply(lr_sites)
    create_accounts(source, rows=10)
    federate(source)
    repl = replicator(topo, lr_sites)
    sync(repl)
    federate(source, federated=False)
    source.query("DELETE FROM public.accounts WHERE id <= 5")  # not captured
    sync(repl)
    assert len(rows(sink)) == 10
    federate(source)
    sync(repl)
    assert rows(sink) == rows(source)


def test_a_sink_dropped_from_the_topology_then_added_back_takes_a_new_snapshot_of_the_changes_made_meanwhile(lr_sites):
    """While a topology leaves site-c out, the source has no session to it, so the table's changes
    are captured for site-b alone. Added back, site-c resumes from its own position: its copy must
    be snapshotted again. Before, it kept the stale copy (those changes were never sent to it) and
    went on from there, diverging silently, or for good once a later change collided with a row it
    should no longer have had."""
    source, sink_b, sink_c = lr_sites
    both = apply(lr_sites)
    create_accounts(source, rows=10)
    federate(source)
    repl = replicator(both, lr_sites)
    sync(repl)
    repl.close()
    apply(lr_sites, [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}])
    source.query("DELETE FROM public.accounts WHERE id <= 3")
    source.query("UPDATE public.accounts SET owner = 'meanwhile' WHERE id = 4")
    apply_to(lr_sites, both)
    source.query("INSERT INTO public.accounts (id, owner) VALUES (1, 'again')")
    repl = replicator(both, lr_sites)
    sync(repl)
    repl.close()
    assert rows(sink_c) == rows(sink_b) == rows(source)
    # closed (lr tables close tells the sinks), then site-c dropped and added back: its copy, whole
    # at the close, stays recorded so. Before, the re-added session forgot it: lr status called it
    # closed before it had every change, and lr tables list said it held no copy
    conn = source.connect()
    registry.close_table(conn, "public.accounts")
    conn.close()
    for sink in (sink_b, sink_c):
        conn = sink.connect()
        assert closed_notes.note_closed_copy(conn, "public.accounts", "site-a", "policy")
        conn.close()
    apply(lr_sites, [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}])
    apply_to(lr_sites, both)
    repl = replicator(both, lr_sites)
    sync(repl)
    repl.close()
    said = status.render_sites({s.site_id: site_status(s) for s in lr_sites})
    at_c = said[said.index("site-c:") :]
    assert "synced from site-a->site-c/policy" in at_c and "closed at site-a: this copy is kept" in at_c, said


def test_a_copy_a_full_sync_left_without_the_changes_made_before_its_tables_close_is_said_to_lack_them(lr_sites):
    """A table closed while site-b had not received its last changes, then a full sync of site-b:
    its base passes those changes and the table, closed, takes no snapshot, so site-b's copy is not
    the table as it was at the close (site-c's is). lr status says so on site-b's line; before, it
    called the table federated there, as if it were still replicated."""
    source, sink_b, sink_c = lr_sites
    topo = apply(lr_sites, providers={"policy": "tests.support.session:empty_provider"})
    create_accounts(source, rows=5)
    federate(source)
    repl = replicator(topo, lr_sites)
    sync(repl)
    source.query("UPDATE public.accounts SET owner = 'before the close'")
    at_close = rows(source)
    conn = source.connect()
    registry.close_table(conn, "public.accounts")
    full_sync.request_full_sync(conn, "site-b", "policy", forced=True)
    conn.close()
    sync(repl)
    repl.close()
    assert rows(sink_c) == at_close != rows(sink_b)
    said = status.render_sites({s.site_id: site_status(s) for s in lr_sites})
    at_b = said[said.index("site-b:") : said.index("site-c:")]
    assert "public.accounts" in at_b and "closed at site-a before this copy had every change" in at_b, said
    assert "closed at site-a: this copy is kept" in said[said.index("site-c:") :], said
    found = status.sites_as_dict({s.site_id: site_status(s) for s in lr_sites})["sites"]["site-b"]["tables"]
    assert [t["closed"] for t in found if t["table"] == "public.accounts"] == [True], found


def test_a_full_sync_forced_after_a_close_lets_a_lagging_sink_take_the_changes_made_before_it_first(lr_sites):
    """site-b had not received public.accounts' last changes when the table was closed (lr sync was
    down). A full sync forced then passed them (the table, closed, takes no snapshot): site-b's
    copy lacked them for good. ``lr full-sync`` now refuses while no replicator streams the session,
    naming the table and what to do; once ``lr sync`` delivered them the full sync keeps that copy
    whole (``lr status`` says so: before, it said the copy lacked changes), and asked while it
    streams, right after a change and the close, it waits for the sink.
    Opened again, the table is snapshotted anew, with the changes made while it was closed."""
    from tests.guarantees.test_table_fidelity_streaming import streaming_over

    source, sink_b, sink_c = lr_sites
    by_id = {s.site_id: s for s in lr_sites}
    b = [SessionKey("site-a", "site-b", "policy")]
    topo = apply(lr_sites)
    create_accounts(source, rows=5)
    federate(source)

    def forced_full_sync() -> None:
        (request,) = full_sync.request_for_sessions(b, lambda site: by_id[site].connect(), "asked", 10).values()
        conn = source.connect()
        try:
            wait_for(
                lambda: full_sync.outcome(conn, request.request_id).outcome is full_sync.Outcome.APPLIED,
                30,
                "the full sync applied at site-b",
            )
        finally:
            conn.close()

    def close() -> list[tuple]:
        conn = source.connect()
        registry.close_table(conn, "public.accounts")
        conn.close()
        return rows(source)

    with streaming_over(topo, lr_sites) as streaming:
        streaming.streaming()
        wait_for(lambda: rows(sink_b) == rows(source) == rows(sink_c), 30, "the first snapshot")
    source.query("UPDATE public.accounts SET owner = 'before the close'")
    at_close = close()
    with pytest.raises(FullSyncError, match=r"has not received the changes of public.accounts .*no replicator holds"):
        full_sync.request_for_sessions(b, lambda site: by_id[site].connect(), "asked")
    with streaming_over(topo, lr_sites) as streaming:
        wait_for(lambda: rows(sink_b) == at_close == rows(sink_c), 30, "the changes made before the close")
        source.query("UPDATE public.accounts SET owner = 'after the close' WHERE id = 1")  # not captured
        forced_full_sync()
        assert rows(sink_b) == at_close
        said = status.render_sites({s.site_id: site_status(s) for s in lr_sites})
        at_b = said[said.index("site-b:") : said.index("site-c:")]
        # its copy is whole: before, the full sync dropped its record and lr status said it lacked changes
        assert "synced from site-a->site-b/policy" in at_b and "closed at site-a: this copy is kept" in at_b, said
        federate(source)  # opened again: a new snapshot, with the change made while it was closed
        wait_for(lambda: rows(sink_b) == rows(source) == rows(sink_c), 30, "the table opened again")
        source.query("UPDATE public.accounts SET owner = 'last' WHERE id = 2")
        at_close = close()
        forced_full_sync()  # at once: the request waits for site-b to acknowledge the change
        assert rows(sink_b) == at_close
    assert "closed at site-a: this copy is kept" in status.render_sites({s.site_id: site_status(s) for s in lr_sites})


def test_a_child_federated_after_its_parent_is_snapshotted_with_it_so_no_reference_is_missing(lr_sites):
    """The sinks' child table references the parent (ON DELETE CASCADE), which replicates already
    and is behind at the sinks (``lr sync`` was down while parent rows were added) when the child is
    federated. The child's snapshot, taken alone, referenced parents the sinks do not hold yet and
    was refused at the start of every cycle, for good (the parents never caught up behind it). The
    sinks now take the parent again with it, in one transaction, from the same snapshot."""
    source, *sinks = lr_sites
    topo = apply(lr_sites)
    for site in lr_sites:
        site.query(
            "CREATE TABLE public.parents (id int PRIMARY KEY, name text); CREATE TABLE public.children "
            "(id int PRIMARY KEY, parent int NOT NULL REFERENCES public.parents ON DELETE CASCADE)"
        )
    source.query("INSERT INTO public.parents SELECT g, 'p' || g FROM generate_series(1, 10) g")
    federate(source, "public.parents")
    repl = replicator(topo, lr_sites)
    try:
        assert cycle_errors(sync(repl)) == []
        source.query("INSERT INTO public.parents VALUES (11, 'late')")
        source.query("INSERT INTO public.children SELECT g, g %% 11 + 1 FROM generate_series(1, 30) g")
        federate(source, "public.children")
        assert cycle_errors(sync(repl)) == []
        source.query("DELETE FROM public.parents WHERE id IN (1, 11)")
        assert cycle_errors(sync(repl)) == []
    finally:
        repl.close()
    for sink in sinks:
        assert rows(sink, "public.parents") == rows(source, "public.parents")
        assert rows(sink, "public.children") == rows(source, "public.children")
    assert len(rows(source, "public.children")) == 26


def test_a_table_made_part_of_a_hierarchy_after_it_was_opened_snapshots_its_own_rows_and_shows_diverged(lr_sites):
    """``lr tables open`` refuses a table with inheritance children or partitions: its statement
    triggers miss writes naming another member. Given a child after the open, a snapshot read the
    child's rows with the table's, and a key both held refused every full sync, for good, while
    ``lr status`` called the table fine. The snapshot now reads the table's own rows (``ONLY``),
    and ``lr status`` marks the table DIVERGED saying why and what to do; so for a table attached
    as a partition."""
    source, sink, _ = lr_sites
    topo = apply(lr_sites)
    source.query(
        "CREATE TABLE public.animals (id int PRIMARY KEY, name text); INSERT INTO public.animals VALUES (1, 'a'); "
        "CREATE TABLE public.plants (id int PRIMARY KEY, name text); CREATE TABLE public.seeds (id int PRIMARY KEY)"
    )
    federate(source, "public.animals")
    federate(source, "public.plants")
    federate(source, "public.seeds")
    repl = replicator(topo, lr_sites)
    try:
        assert cycle_errors(sync(repl)) == []
        source.query(
            "CREATE TABLE public.cats (PRIMARY KEY (id)) INHERITS (public.animals); "
            "INSERT INTO public.cats VALUES (1, 'a cat'), (2, 'another'); "
            "CREATE TABLE public.garden (id int PRIMARY KEY, name text) PARTITION BY RANGE (id); "
            "ALTER TABLE public.garden ATTACH PARTITION public.plants FOR VALUES FROM (0) TO (100); "
            "ALTER TABLE public.seeds SET UNLOGGED"  # a crash of the source would empty it, capturing nothing
        )
        conn = source.connect()
        full_sync.request_full_sync(conn, "site-b", "policy", "operator asked", forced=True)
        conn.close()
        assert cycle_errors(sync(repl)) == []
    finally:
        repl.close()
    assert rows(sink, "public.animals") == source.query("SELECT t::text FROM ONLY public.animals t") == [("(1,a)",)]
    text = status_text(source)
    assert "public.animals DIVERGED" in text and "it has inheritance parents or children" in text, text
    assert "public.plants DIVERGED" in text and "it is partitioned or a partition" in text, text
    assert "NO INHERIT, DETACH PARTITION) or close it (lr tables close)" in text, text
    assert "public.seeds DIVERGED" in text and "it is unlogged: a crash of this server empties it" in text, text
    assert "(ALTER TABLE public.seeds SET LOGGED): it became so after lr tables open" in text, text


def test_a_federated_table_dropped_at_the_source_holds_a_full_sync_saying_how_and_closing_it_frees_it(lr_sites):
    source, sink, _ = lr_sites
    topo = apply(lr_sites)
    create_accounts(source, rows=10)
    source.query("CREATE TABLE public.gone (id int PRIMARY KEY)")
    federate(source)
    federate(source, "public.gone")
    repl = replicator(topo, lr_sites)
    sync(repl)
    source.query("DROP TABLE public.gone")
    conn = source.connect()
    full_sync.request_full_sync(conn, sink.site_id, "policy", forced=True)
    conn.close()
    errors = cycle_errors(sync(repl, cycles=3))
    assert errors and "lr tables open public.gone there, or lr tables close public.gone" in errors[-1]
    conn = source.connect()
    registry.close_table(conn, "public.gone")
    conn.close()
    assert cycle_errors(sync(repl)) == []
    assert rows(sink) == rows(source)


def test_a_replicator_killed_while_writing_a_table_snapshot_leaves_nothing_half_done(lr_sites):
    source, *sinks = lr_sites
    topo = apply(lr_sites)
    create_accounts(source, rows=2000)
    federate(source)
    with TableWriter(source, truncate=False) as writer:
        crashed = run_crashing_replicator(topo, lr_sites, "table_snapshot_before_commit")
        assert crashed.returncode == -9, crashed.stderr[-2000:]
        for sink in sinks:  # the rows were in the sink's open transaction: gone with the process
            assert sink.query("SELECT count(*) FROM lr.sink_tables WHERE state = 'synced'") == [(0,)]
        repl = replicator(topo, lr_sites)
        sync(repl, cycles=5)
    assert writer.transactions > 0
    sync(repl)
    for sink in sinks:
        assert rows(sink) == rows(source)


def test_generated_columns_are_computed_on_each_site_not_carried(lr_sites):
    source, sink, _ = lr_sites
    topo = apply(lr_sites)
    ddl = (
        "CREATE TABLE public.lines (id int PRIMARY KEY, qty int NOT NULL, price numeric NOT NULL, "
        "total numeric GENERATED ALWAYS AS (qty * price) STORED)"
    )
    source.query(ddl)
    sink.query(ddl)
    source.query("INSERT INTO public.lines (id, qty, price) VALUES (1, 2, 3.5)")
    federate(source, "public.lines")
    repl = replicator(topo, lr_sites)
    sync(repl)
    source.query("INSERT INTO public.lines (id, qty, price) VALUES (2, 4, 1)")
    source.query("UPDATE public.lines SET qty = 10 WHERE id = 1")
    sync(repl)
    assert rows(sink, "public.lines") == rows(source, "public.lines")
    assert sink.query("SELECT total FROM public.lines ORDER BY id") == [(35,), (4,)]


def test_streaming_carries_table_changes_and_a_table_federated_meanwhile_joins_through_a_cycle(lr_sites):
    from tests.support.session import Streaming, wait_for

    source, *sinks = lr_sites
    topo = apply(lr_sites)
    create_accounts(source, rows=20)
    source.query("CREATE TABLE public.orders (id int PRIMARY KEY, item text)")
    source.query("INSERT INTO public.orders VALUES (1, 'before')")
    federate(source)
    with Streaming(replicator(topo, lr_sites)) as streaming:
        streaming.streaming()
        with TableWriter(source, truncate=False):
            wait_for(lambda: len(streaming.cycles) > 0 and all(rows(s) for s in sinks), 30, "the first snapshot")
            federate(source, "public.orders")  # the stream hands back; a cycle snapshots it
            source.query("INSERT INTO public.orders VALUES (2, 'after')")
            wait_for(
                lambda: all(
                    s.query("SELECT count(*) FROM pg_class WHERE oid = to_regclass('public.orders')") == [(1,)]
                    and len(rows(s, "public.orders")) == 2
                    for s in sinks
                ),
                30,
                "the new table",
            )
        wait_for(lambda: all(rows(s) == rows(source) for s in sinks), 30, "the streamed changes")
    assert any("a table was federated" in e.reason for e in streaming.streamer.ends)
    for sink in sinks:
        assert rows(sink, "public.orders") == rows(source, "public.orders")
