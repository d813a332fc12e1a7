"""Replication sessions end to end against real sites: negotiation, snapshot sync, log-entry sync."""

from __future__ import annotations

import threading
import time

import psycopg2
import pytest

from airflow_provider_lr.engine.db import schema
from airflow_provider_lr.engine.errors import FencedError, StaleBatchError
from airflow_provider_lr.engine.faults import on_fault
from airflow_provider_lr.engine.session import lease
from airflow_provider_lr.engine.sink import writes
from airflow_provider_lr.engine.source.log_reader import LogBatch, LogReader
from airflow_provider_lr.engine.vocabulary import SessionKey
from tests.support.session import (
    App,
    Streaming,
    apply,
    empty_provider,
    final_state,
    queue,
    replicator,
    source_state,
    table_provider,
    wait_for,
)


def test_first_contact_with_client_data_then_deltas(lr_sites):
    source, sink_b, sink_c = lr_sites
    topo = apply(lr_sites, [{"source": "site-a", "sinks": ["site-b", "site-c"], "clients": ["policy"]}])
    app = App(source)
    for i in range(5):
        app.put(f"k{i}", i, ["site-b", "site-c"])
    repl = replicator(topo, lr_sites, providers={"policy": table_provider})
    reports = repl.run(max_cycles=3, until_idle=True, interval=0.01)
    assert all(not r.error for r in reports), reports
    for sink in (sink_b, sink_c):
        q = queue(sink, "site-a")
        assert q[0] == ("start", "") and q[-1] == ("end", ""), q
        assert sorted(p for k, p in q if k == "snap") == [f"k{i}={i}" for i in range(5)]
        assert [k for k, _ in q].count("log") == 0  # covered by the snapshot: not sent again
    app.put("k1", 100, ["site-b"])
    app.put("k9", 9, ["site-b", "site-c"])
    repl.run(max_cycles=3, until_idle=True, interval=0.01)
    assert [p for k, p in queue(sink_b, "site-a") if k == "log"] == ["k1=100", "k9=9"]
    assert [p for k, p in queue(sink_c, "site-a") if k == "log"] == ["k9=9"]
    assert final_state(queue(sink_b, "site-a")) == source_state(source)
    repl.close()
    app.close()


def test_first_contact_without_client_data_then_deltas(lr_sites):
    source, sink_b, _ = lr_sites
    topo = apply(lr_sites, [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}])
    app = App(source)
    repl = replicator(topo, lr_sites, providers={"policy": empty_provider})
    repl.run(max_cycles=3, until_idle=True, interval=0.01)
    assert queue(sink_b, "site-a") == [("start", ""), ("end", "")]
    for i in range(3):
        app.put("k", i, ["site-b"])
    repl.run(max_cycles=3, until_idle=True, interval=0.01)
    assert queue(sink_b, "site-a") == [("start", ""), ("end", ""), ("log", "k=0"), ("log", "k=1"), ("log", "k=2")]
    status = sink_b.query("SELECT data_consistent, last_log_entry_processed >= snapshot_applied FROM lr.sink_sessions")
    assert status == [(True, True)]
    repl.close()
    app.close()


def test_two_sinks_only_one_addressed_gets_exactly_its_entries(lr_sites):
    source, sink_b, sink_c = lr_sites
    topo = apply(lr_sites, [{"source": "site-a", "sinks": ["site-b", "site-c"], "clients": ["policy"]}])
    app = App(source)
    repl = replicator(topo, lr_sites, providers={"policy": empty_provider})
    repl.run(max_cycles=3, until_idle=True, interval=0.01)
    for i in range(20):
        app.put(f"k{i}", i, ["site-b"])
    repl.run(max_cycles=3, until_idle=True, interval=0.01)
    assert [p for k, p in queue(sink_b, "site-a") if k == "log"] == [f"k{i}={i}" for i in range(20)]
    assert [k for k, _ in queue(sink_c, "site-a")] == ["start", "end"]
    remaining = source.query(
        "SELECT sink_site_id, remaining_entries, acked_position > 0 FROM lr.source_sessions ORDER BY 1"
    )
    assert remaining == [("site-b", 0, True), ("site-c", 0, True)]
    repl.close()
    app.close()


@pytest.mark.parametrize("mode", ["cycles", "streaming"])
def test_snapshot_hand_off_while_writers_keep_writing(lr_sites, mode):
    """Guarantee 6 (docs/architecture.md): writers run before, during and after the full sync; every key's values
    arrive as snapshot value, then exactly each later value once, in order (streaming: the stream
    starts right after the apply, reading past the base snapshot's split)."""
    source, sink_b, _ = lr_sites
    topo = apply(lr_sites, [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}])
    keys = [f"k{i}" for i in range(4)]
    seed = App(source)
    for k in keys:
        seed.put(k, 0, ["site-b"])
    stop = threading.Event()

    def writer(key: str) -> None:
        app = App(source)
        value = 0
        while not stop.is_set():
            value += 1
            with app.conn.cursor() as cur:  # read-modify-write of the same row: commit order matters
                cur.execute("UPDATE app_state SET v = v + 1 WHERE k = %s RETURNING v", (key,))
                value = cur.fetchone()[0]
            app.client.transmit_log_entry_message(f"{key}={value}".encode(), ["site-b"])
            app.conn.commit()
        app.close()

    def slow_provider(ctx) -> None:
        table_provider(ctx)
        time.sleep(0.5)  # writers keep committing while the full sync's transaction is open

    threads = [threading.Thread(target=writer, args=(k,)) for k in keys for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    repl = replicator(topo, lr_sites, providers={"policy": slow_provider})
    if mode == "cycles":
        repl.run(max_cycles=4, interval=0.05)
        stop.set()
        for t in threads:
            t.join()
        repl.run(max_cycles=10, until_idle=True, interval=0.05)
    else:
        with Streaming(repl):
            time.sleep(1.5)
            stop.set()
            for t in threads:
                t.join()
            wait_for(lambda: final_state(queue(sink_b, "site-a")) == source_state(source), 30, "the stream to catch up")
    entries = queue(sink_b, "site-a")
    kinds = [k for k, _ in entries]
    assert kinds[0] == "start" and "end" in kinds and kinds.index("end") < kinds.index("log")
    seen: dict[str, list[int]] = {}
    for kind, payload in entries:
        if kind in ("snap", "log"):
            k, v = payload.split("=")
            seen.setdefault(k, []).append(int(v))
    final = source_state(source)
    for k in keys:
        values = seen[k]
        assert values == list(range(values[0], final[k] + 1)), f"{k}: {values[:10]}... (lost, duplicated or reordered)"
    assert sum(len(v) for v in seen.values()) > len(keys) * 3  # the writers really wrote during the sync
    repl.close()
    seed.close()


def test_duplicate_overlapping_and_gapped_batches(lr_sites):
    source, sink_b, _ = lr_sites
    topo = apply(lr_sites, [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}])
    app = App(source)
    repl = replicator(topo, lr_sites, providers={"policy": empty_provider})
    repl.run(max_cycles=2, until_idle=True, interval=0.01)
    for i in range(6):
        app.put(f"k{i}", i, ["site-b"])
    meta = writes.read_metadata(sink_b.connect(), "site-a", "policy")
    src = source.connect()
    reader = LogReader(src, "site-b", client_name="policy")
    batch = reader.read_stream(meta.last_log_entry_processed).collect()
    first, rest = batch.records[:3], batch.records[3:]
    mid = first[-1].position
    epoch = source.query("SELECT lease_epoch FROM lr.source_sessions")[0][0]
    conn = sink_b.connect()
    apply_batch = lambda after, end, records, base=meta.snapshot_applied: writes.apply_log_stream(  # noqa: E731
        conn, "site-a", "policy", epoch, LogBatch(after, end, list(records)), base
    )
    assert apply_batch(batch.after, mid, first) == mid
    assert apply_batch(batch.after, mid, first) == mid  # duplicate: no-op
    with pytest.raises(StaleBatchError, match="only processed up to"):
        apply_batch(rest[0].position, batch.end, rest[1:])  # would leave a gap
    with pytest.raises(StaleBatchError, match="base"):
        apply_batch(mid, batch.end, rest, base=meta.snapshot_applied + 1)  # another snapshot's batch
    assert apply_batch(batch.after, batch.end, batch.records) == batch.end  # overlaps: only new ones
    assert [p for k, p in queue(sink_b, "site-a") if k == "log"] == [f"k{i}={i}" for i in range(6)]
    conn.close()
    src.close()
    repl.close()
    app.close()


def test_topology_id_mismatch_refuses_until_the_same_topology_is_applied(lr_sites):
    source, sink_b, _ = lr_sites
    replication = [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}]
    topo = apply(lr_sites, replication)
    other = apply(lr_sites, replication, settings={"lease_seconds": 61}, only=[sink_b])
    assert other.topology_config_id != topo.topology_config_id
    app = App(source)
    app.put("k", 1, ["site-b"])
    repl = replicator(topo, lr_sites, providers={"policy": table_provider})
    (report,) = repl.run(max_cycles=2, interval=0.01)
    assert report.decision == "refuse" and "mismatch" in report.error
    assert queue(sink_b, visible_only=False) == []
    assert source.query("SELECT count(*) FROM lr.full_sync_requests") == [(0,)]
    assert "mismatch" in source.query("SELECT last_error FROM lr.source_sessions")[0][0]
    apply(lr_sites, replication)
    repl.run(max_cycles=3, until_idle=True, interval=0.01)
    assert final_state(queue(sink_b, "site-a")) == {"k": 1}
    repl.close()
    app.close()


def test_fencing_a_replicator_whose_lease_was_taken_over_cannot_write(lr_sites):
    source, sink_b, _ = lr_sites
    topo = apply(lr_sites, [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}])
    app = App(source)
    first = replicator(topo, lr_sites, owner="replicator-1", providers={"policy": empty_provider})
    first.run(max_cycles=2, until_idle=True, interval=0.01)
    old = first._runners[SessionKey("site-a", "site-b", "policy")].lease
    second = replicator(topo, lr_sites, owner="replicator-2")
    (report,) = second.run_cycle()
    assert report.skipped  # the lease is held
    source.query("UPDATE lr.source_sessions SET lease_expires_at = now() - interval '1 second'")  # replicator-1 stalls
    app.put("k", 1, ["site-b"])
    (report,) = second.run_cycle()
    assert report.delivered == 1 and not report.error
    new_epoch = source.query("SELECT lease_epoch FROM lr.source_sessions")[0][0]
    assert new_epoch == old.epoch + 1
    app.put("k", 2, ["site-b"])  # the stale replicator wakes up and tries to deliver it
    src = source.connect()
    batch = LogReader(src, "site-b", client_name="policy").read_stream(report.acked_position).collect()
    base = sink_b.query("SELECT snapshot_applied FROM lr.sink_sessions")[0][0]
    with pytest.raises(FencedError):
        writes.apply_log_stream(sink_b.connect(), "site-a", "policy", old.epoch, batch, base)
    with pytest.raises(FencedError):
        lease.update_session(src, old, acked_position=batch.end)
    (report,) = first.run_cycle()
    assert report.skipped and not report.delivered
    second.run(max_cycles=2, until_idle=True, interval=0.01)
    assert [p for k, p in queue(sink_b, "site-a") if k == "log"] == ["k=1", "k=2"]
    src.close()
    first.close()
    second.close()
    app.close()


def test_a_replicator_fenced_mid_cycle_leaves_no_error_on_the_session_its_successor_holds(lr_sites):
    """A replicator stalls in a catch-up, between two batches (a SIGSTOPped ``lr sync``); its lease
    is taken over and the successor delivers. Woken, its cycle is fenced: that is the session
    changing hands, not a failure of the session, so ``lr status`` must not show the successor's
    healthy session with the stale holder's FencedError as its last error."""
    source, sink_b, _ = lr_sites
    topo = apply(lr_sites, [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}])
    app = App(source)
    first = replicator(topo, lr_sites, owner="replicator-1", providers={"policy": empty_provider}, max_entries=5)
    second = replicator(topo, lr_sites, owner="replicator-2")
    first.run(max_cycles=2, until_idle=True, interval=0.01)
    for i in range(20):
        app.put("k", i, ["site-b"])

    took: list = []

    def take_over() -> None:  # the first batch only (the successor passes the point too)
        if not took:
            source.query("UPDATE lr.source_sessions SET lease_expires_at = now() - interval '1 second'")
            took.append(None)
            took.extend(second.run_cycle())

    with on_fault("after_sink_apply", take_over):
        (report,) = first.run_cycle()
    assert took[1].delivered and not took[1].error, took
    assert "FencedError" in report.error or report.skipped, report
    assert source.query("SELECT lease_owner, last_error FROM lr.source_sessions") == [("replicator-2", None)]
    assert [p for k, p in queue(sink_b, "site-a") if k == "log"] == [f"k={i}" for i in range(20)]
    first.close()
    second.close()
    app.close()


def test_a_replicator_whose_idle_connections_were_closed_still_releases_its_leases_when_it_stops(lr_sites):
    """While every session streams, ``lr sync`` closes the cycles' idle connections (``rest``) and
    forgets the runners on them; a session the stream handed back (a full sync asked) keeps its
    lease for its next cycle. Stopped then (SIGTERM), the replicator released only its runners'
    leases: that session stayed leased to a process gone, for ``lease_seconds`` (60 s), and the
    next ``lr sync`` skipped it meanwhile. Now a replicator releases every lease it holds."""
    source, _, _ = lr_sites
    topo = apply(lr_sites, [{"source": "site-a", "sinks": ["site-b", "site-c"], "clients": ["policy"]}])
    repl = replicator(topo, lr_sites, owner="replicator-1", providers={"policy": empty_provider})
    repl.run(max_cycles=2, until_idle=True, interval=0.01)
    held = "SELECT sink_site_id, lease_owner FROM lr.source_sessions ORDER BY 1"
    assert source.query(held) == [("site-b", "replicator-1"), ("site-c", "replicator-1")]
    repl.rest(idle_for=-1)  # every connection idle: closed, as while the sessions stream
    repl.close()
    assert source.query(held) == [("site-b", None), ("site-c", None)]


def test_a_cycle_after_its_sites_server_restarted_reconnects_rather_than_fails(lr_sites):
    """The cycles keep one connection per site. A server restarted between two cycles (its backends
    gone, as here) left it dead: the next cycle failed on it (``server closed the connection
    unexpectedly``, ``connection already closed``) with the server up again, its error recorded as
    the session's, and ``lr sync`` backed the session off once more for it (to 30 s after a
    few seconds' restart). Now a cycle that fails on a connection made before it, for the
    connection's loss, runs again at once on new ones."""
    source, sink, _ = lr_sites
    topo = apply(lr_sites, [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}])
    App(source).put("k", 1, ["site-b"])
    repl = replicator(topo, lr_sites, providers={"policy": table_provider})
    try:
        repl.run(max_cycles=5, until_idle=True, interval=0.01)
        for site in (source, sink):  # every backend of the site's database ends, as in a restart
            site.query(
                "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        App(source).put("k", 2, ["site-b"])
        (report,) = repl.run_cycle()
        assert not report.error and report.delivered == 1, report
    finally:
        repl.close()
    assert final_state(queue(sink, "site-a")) == source_state(source) == {"k": 2}
    assert source.query("SELECT last_error FROM lr.source_sessions") == [(None,)]


class ExtraSite:
    """One more site as another database on an existing server (a site is a database)."""

    def __init__(self, base, site_id: str) -> None:
        self.site_id, self.region = site_id, "region-9"
        self.server, self.dbname = base.server, f"{base.dbname}_{site_id.replace('-', '_')}"
        admin = psycopg2.connect(base.server.dsn())
        admin.autocommit = True
        with admin.cursor() as cur:
            cur.execute(f'CREATE DATABASE "{self.dbname}"')
        admin.close()
        self.dsn = base.server.conninfo(self.dbname).dsn
        conn = self.connect()
        schema.init_site(conn, site_id, self.region)
        conn.close()

    def connect(self):
        return psycopg2.connect(self.dsn)

    def query(self, sql, params=()):
        conn = self.connect()
        with conn.cursor() as cur:
            cur.execute(sql, params)
            rows = cur.fetchall() if cur.description else []
        conn.commit()
        conn.close()
        return rows

    def drop(self) -> None:
        admin = psycopg2.connect(self.server.dsn())
        admin.autocommit = True
        with admin.cursor() as cur:
            cur.execute(f'DROP DATABASE IF EXISTS "{self.dbname}" WITH (FORCE)')
        admin.close()


def test_three_sources_to_one_sink_keep_their_queues_apart(lr_sites):
    site_a, site_b, sink_c = lr_sites
    site_d = ExtraSite(site_a, "site-d")
    try:
        all_sites = [site_a, site_b, sink_c, site_d]
        sources = [site_a, site_b, site_d]
        topo = apply(all_sites, [{"source": s.site_id, "sinks": ["site-c"], "clients": ["policy"]} for s in sources])
        apps = [App(s) for s in sources]
        for app in apps:
            app.put(f"{app.site.site_id}-seed", 0, ["site-c"])
        repl = replicator(topo, all_sites, providers={"policy": table_provider})
        repl.run(max_cycles=3, until_idle=True, interval=0.01)
        for i in range(1, 11):
            for app in apps:
                app.put(f"{app.site.site_id}-k", i, ["site-c"])
        repl.run(max_cycles=3, until_idle=True, interval=0.01)
        for app in apps:
            src = app.site.site_id
            q = queue(sink_c, src)
            assert [p for k, p in q if k == "snap"] == [f"{src}-seed=0"]
            assert [p for k, p in q if k == "log"] == [f"{src}-k={i}" for i in range(1, 11)]
        registered = sink_c.query("SELECT stream_name FROM lr.registry WHERE kind = 'receive_queue' ORDER BY 1")
        assert registered == [(f"LRQ_Recv_policy_{s.site_id}",) for s in sorted(sources, key=lambda s: s.site_id)]
        repl.close()
        for app in apps:
            app.close()
    finally:
        site_d.drop()


def test_a_stream_sets_all_its_sessions_in_one_statement_and_learns_which_were_taken_over(lr_sites):
    """``lease.update_sessions``: each session's own values in one statement; a session whose lease
    was taken over meanwhile is named with its FencedError and keeps its row as the new holder left it."""
    source, _, _ = lr_sites
    apply(lr_sites, [{"source": "site-a", "sinks": ["site-b", "site-c"], "clients": ["policy", "billing"]}])
    conn = source.connect()
    held = {
        (sink, client): lease.acquire(conn, sink, client, "replicator-1", 30)
        for sink in ("site-b", "site-c")
        for client in ("policy", "billing")
    }
    source.query(  # replicator-2 took one over
        "UPDATE lr.source_sessions SET lease_owner = 'replicator-2', lease_epoch = lease_epoch + 1 "
        "WHERE sink_site_id = 'site-c' AND client_name = 'billing'"
    )
    updates = [(held[k], {"acked_position": n, "last_error": None}) for n, k in enumerate(sorted(held))]
    lost = lease.update_sessions(conn, updates)
    assert list(lost) == [held[("site-c", "billing")]] and isinstance(lost[held[("site-c", "billing")]], FencedError)
    rows = dict(
        (tuple(r[:2]), r[2])
        for r in source.query("SELECT sink_site_id, client_name, acked_position FROM lr.source_sessions")
    )
    assert rows == {
        ("site-b", "billing"): 0,
        ("site-b", "policy"): 1,
        ("site-c", "billing"): -1,
        ("site-c", "policy"): 3,
    }
    conn.close()
