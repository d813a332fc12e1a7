"""Federated tables (issue 14): lr's table snapshot, capture cost and table-change lag, each beside
native logical replication on the same servers in the same run.

Servers: 3 embedded PostgreSQL servers (``SiteManager``: the project's PostgreSQL, default
durability, ``wal_level=logical``): site-a → site-b, site-c. lr's sites are fresh databases
(``fanout_lr.LrSites``: lr schema, topology site-a → [site-b, site-c] for client ``bench``, both
sessions through their empty full sync); native's subscribers are other databases on the same
sink servers. The table: ``(id bigint PRIMARY KEY, grp int, created timestamptz, payload text)``,
payload 164 characters: ~210 bytes a row on disk (measured and printed).

1. **Snapshot** of the table (``--rows``, default 1M) to both sinks:
   * ``lr in-process (cycle)``: one ``Replicator.run_cycle()`` (``lr sync``'s engine): each
     session's cycle snapshots the table it lacks (``TableSnapshot`` open/write, one sink after
     the other, the source read once per sink);
   * ``lr in-process (tee)``: ``parallel.run_table_snapshot`` with ``local_ranges`` and one range:
     the source read once, streamed to both sinks at the same time, in this process;
   * ``lr Spark``: ``spark_jobs/lr_table_snapshot.snapshot_tables`` on a ``local[*]`` SparkSession
     made here (its start and the first warm-up are reported apart), one task per key range
     (``--parts``: the engine's default of ~100k rows a range, and 2/4/8);
   * ``lr spark-submit``: the job as the DAG runs it (``spark-submit lr_table_snapshot.py``), wall
     time with the JVM and Spark start;
   * ``native``: one publication; on each sink server a subscription ``WITH (binary = true)``
     (PG ≥ 16 copies the initial table data in binary too), both created at once; timed from
     CREATE SUBSCRIPTION until both tables' sync state is ``r``.
   At ``--rows``, native, tee, Spark (auto) and cycle run ``--rounds`` times in rotated order
   (medians, and lr ÷ native within each round); the other ``--parts`` and spark-submit once.
   Every run starts from sinks without the table (lr creates it; native's is created empty, with
   its primary key, before the clock starts), is checked row for row (count and a hash of every
   row) against the source, and is followed by a quiet checkpoint. rows/s = table rows / seconds
   (each row reaches 2 sinks). At ``--rows`` the bench also times the parts of the copy: the
   source's binary COPY out (raw, and through psycopg2's ``copy_expert`` as the engine reads it),
   one sink's COPY in with and without the primary key, and the raw tee into both sinks.
2. **Writer overhead of capture**: the same transactions on tables of that shape (20k rows each)
   on site-a: ``plain`` (no capture); ``native`` (a publication, both subscriptions streaming it);
   ``lr streaming`` (federated, ``lr sync`` running in its own process and carrying it to both
   sinks); ``lr capture`` (federated: lr's statement-level triggers, no replicator running); ``lr
   capture, args`` (bench-only: lr's statement-level capture for INSERT and UPDATE with what
   ``lr.capture_table_changes`` looks up in every statement (client id, the sinks' tags, the
   non-key columns) passed as trigger arguments instead); ``row trigger`` (bench-only plpgsql
   ``FOR EACH ROW`` trigger: one ``lr.log_entries`` row per changed row, stream 3, the client's id
   and tags and a table id of its own as trigger arguments, so it looks nothing up either). The
   bench-only tables' entries carry a table id no sink has synced: no replicator applies them. Workloads: single-row INSERT and single-row UPDATE transactions from 1
   and 4 threads (updates on disjoint keys), and one 1000-row multi-row INSERT statement per
   transaction; ``--writer-seconds`` each, ``--writer-rounds`` rounds on fresh databases (median).
   Transactions/s, latency per transaction (statement + commit, as the writer sees it), and CPU
   per transaction: user + system time of every bench process (the 3 servers' processes, this
   process, ``lr sync``) over the window ÷ transactions, whoever spent it (/proc, ``CpuMeter``).
3. **Table-change lag**: single-row UPDATE transactions at ``--lag-rate``/s from ``--lag-writers``
   threads (``streaming_bench.Writers``, paced) for ``--lag-seconds`` after 2 s of warm-up: lr
   (``lr sync`` in its own process, its default streaming mode) vs native streaming (``binary =
   true``). Each sink table has an AFTER INSERT OR UPDATE trigger (``ENABLE ALWAYS``) that records
   ``clock_timestamp()`` for the row's (writer, seq); lag = that − the writer's clock just before
   its commit (both inside the delivering transaction, as in ``streaming_bench.py``); p50/p95/p99
   over both sinks; every update must arrive once at each sink (lost, duplicated counted).
5. **Sink transaction** of a table change (``sink``, after the lag): ``--sink-transactions`` one-row
   UPDATE changes of a synced federated table, each applied in its own sink transaction
   (committed without waiting for the WAL flush, as a stream's) on one connection, as the stream's
   sink end does, alternating two paths: ``general`` (``writes.apply_log_stream``: the session's row
   read under its lock, then written) and ``stream`` (``stream_batch.stream_batches``, the way a stream
   writes a session it wrote before: one round trip, composed from the targets the connection's
   last transaction read; the general path when it declines): the sink's share of the lag, without the read, the
   wake-up or a second process. Time per transaction as this process sees it, the first tenth as
   warm-up; each change's row checked at the end.
4. **Threshold** for ``TABLE_SPARK_MIN_ROWS``: from the in-process runs (cycle, and tee) and the
   Spark run (auto parts) at each of ``--sizes`` and ``--rows`` (medians): straight lines t = a + b·rows fitted to each, break-even where
   in-process = Spark start + Spark run (cold: the DAG's job starts its own Spark; start from
   spark-submit when run, else SparkSession start + warm-up).

Run: .venv/bin/python bench/table_bench.py [--rows 1000000] [--sizes 100000,300000,3000000]
     [--parts auto,2,4,8] [--rounds 3] [--writer-seconds 3] [--writer-rounds 2]
     [--lag-rate 500] [--lag-seconds 10] [--sink-transactions 3000]
     [--skip snapshot,writers,lag,sink,spark,spark-submit] [--quick]
Writes bench/results/table_bench.json (``--quick``: table_bench_quick.json) and prints markdown.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psycopg
import psycopg2
import psycopg2.extras

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
for _p in (REPO, BENCH, REPO / "spark_jobs"):
    sys.path.insert(0, str(_p))

from fanout_anchors import BenchEnv, _names, coalesced, drop_replication, execute, settle, subscriptions_ready
from fanout_lr import CLIENT, LrSites, spark_submit
from streaming_common import LR_STOP_S, Plan, Writers, figures, lr_command, lr_preexec, percentiles

from airflow_provider_lr.embedded.sites import SiteManager
from airflow_provider_lr.engine.bulk import parallel_tables as parallel
from airflow_provider_lr.engine.sink import stream_batch, writes
from airflow_provider_lr.engine.source.log_reader import LogBatch, LogRecord
from airflow_provider_lr.engine.tables import registry

SITES = ["site-a", "site-b", "site-c"]
SOURCE, SINK_SITES = SITES[0], SITES[1:]
TABLE = "bench_rows"
PAYLOAD_CHARS = 164
COLUMNS = "(id bigint PRIMARY KEY, grp integer NOT NULL, created timestamptz NOT NULL, payload text NOT NULL)"
NATIVE_DB = "native_tables"
LR_LOG = logging.getLogger("table_bench")


# --- plumbing -----------------------------------------------------------------------------------
def create_table(dsn: str, table: str, rows: int = 0) -> None:
    execute(dsn, f"DROP TABLE IF EXISTS {table}", f"CREATE TABLE {table} {COLUMNS}")
    if rows:
        add_rows(dsn, table, 1, rows)


def add_rows(dsn: str, table: str, first: int, last: int) -> None:
    """Rows ``first..last``, not captured (``lr.applying``: the capture triggers skip them), then
    VACUUM ANALYZE (hint bits, visibility map, ``reltuples`` for the range planner)."""
    execute(
        dsn,
        "SELECT set_config('lr.applying', 'on', false)",
        f"INSERT INTO {table} SELECT g, g % 1000, timestamptz '2026-01-01 00:00:00+00' + g * interval '1 second', "
        f"substr(repeat(md5(g::text), 6), 1, {PAYLOAD_CHARS}) FROM generate_series({first}, {last}) g",
        f"VACUUM (ANALYZE) {table}",
    )


def checksum(dsn: str, table: str) -> tuple[int, str]:
    """(rows, a hash of every row): equal on two sites = the same rows, row for row."""
    ((n, h),) = execute(
        dsn,
        "SET TIME ZONE 'UTC'",
        f"SELECT count(*), coalesce(sum(hashtextextended(t::text, 0)), 0)::text FROM {table} t",
    )
    return n, h


def verify(source_dsn: str, sink_dsns: list[str], table: str, what: str) -> None:
    want = checksum(source_dsn, table)
    got = [checksum(dsn, table) for dsn in sink_dsns]
    if any(g != want for g in got):
        raise AssertionError(f"{what}: sinks hold {got}, the source {want}")


def row_bytes(dsn: str, table: str) -> float:
    return float(execute(dsn, f"SELECT avg(pg_column_size(t.*)) FROM (SELECT * FROM {table} LIMIT 10000) t")[0][0])


def table_mib(dsn: str, table: str) -> dict[str, float]:
    ((heap, idx),) = execute(dsn, f"SELECT pg_table_size('{table}'), pg_indexes_size('{table}')")
    return {"heap_mib": round(heap / 2**20, 1), "index_mib": round(idx / 2**20, 1)}


@contextlib.contextmanager
def env_var(name: str, value: str) -> Iterator[None]:
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def quiet(env: BenchEnv) -> float:
    """No autovacuum worker on any server, then a checkpoint everywhere (``settle``)."""
    return round(settle(env), 1)


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares line y = a + b·x (a single point: through it, a = 0)."""
    if len(xs) == 1:
        return 0.0, ys[0] / xs[0]
    b, a = np.polyfit(np.array(xs, dtype=float), np.array(ys, dtype=float), 1)
    return float(a), float(b)


def _ms(seconds: list[float]) -> dict[str, float | int | None]:
    return percentiles(np.array(seconds) * 1000.0)


# --- 1. snapshot --------------------------------------------------------------------------------
@dataclass
class SnapshotRun:
    method: str
    rows: int
    seconds: float  # what the rows/s is of
    details: dict[str, Any]

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else float("nan")

    def as_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "rows": self.rows,
            "seconds": round(self.seconds, 3),
            "rows_per_s": round(self.rows_per_s),
            **self.details,
        }


class SnapshotBench:
    """The table on lr's source (site-a) and every way of snapshotting it to site-b and site-c."""

    def __init__(self, env: BenchEnv, home: Path, meter: CpuMeter) -> None:
        self.env, self.home, self.meter = env, home, meter
        self.sites = LrSites(env, "tables_snap", SITES)
        self.src = self.sites.dsns[SOURCE]
        self.sinks = [self.sites.dsns[s] for s in SINK_SITES]
        for dsn in env.sink_dsns:
            execute(dsn, f"DROP DATABASE IF EXISTS {NATIVE_DB} WITH (FORCE)", f"CREATE DATABASE {NATIVE_DB}")
        self.native = [psycopg2.extensions.make_dsn(dsn, dbname=NATIVE_DB) for dsn in env.sink_dsns]
        self.rows = 0
        self.spark: Any = None
        self.spark_start: dict[str, float] = {}
        create_table(self.src, TABLE)
        with contextlib.closing(psycopg2.connect(self.src)) as conn:
            registry.open_table(conn, f"public.{TABLE}", CLIENT)

    def grow(self, rows: int) -> None:
        if rows > self.rows:
            add_rows(self.src, TABLE, self.rows + 1, rows)
            self.rows = rows

    def reset_sinks(self) -> None:
        """lr's sinks as before any snapshot of the table: no table, no table state."""
        for dsn in self.sinks:
            execute(
                dsn,
                f"DROP TABLE IF EXISTS {TABLE}",
                "DELETE FROM lr.sink_table_ranges",
                "DELETE FROM lr.sink_tables",
                "DELETE FROM lr.table_row_origin",
                "DELETE FROM lr.registry WHERE kind = 'table'",
            )

    def _measured(self, method: str, run: Callable[[], tuple[float, dict[str, Any]]], sinks: list[str]) -> SnapshotRun:
        waited = quiet(self.env)
        cpu = self.meter()
        seconds, details = run()
        cpu = self.meter() - cpu
        verify(self.src, sinks, TABLE, method)
        out = SnapshotRun(method, self.rows, seconds, {**details, "cpu_s": round(cpu, 2), "settled_s": waited})
        print(
            f"  {method:<34} {self.rows:>9,} rows {seconds:7.2f} s {out.rows_per_s:>10,.0f} rows/s, CPU {cpu:.2f} s",
            flush=True,
        )
        return out

    # lr, in process
    def cycle(self) -> SnapshotRun:
        def run() -> tuple[float, dict[str, Any]]:
            repl = self.sites.replicator()
            try:
                started = time.perf_counter()
                reports = repl.run_cycle()
                seconds = time.perf_counter() - started
            finally:
                repl.close()
            states = [t for r in reports for t in r.tables]
            errors = [r.error for r in reports if r.error]
            if errors or len(states) != len(SINK_SITES) or not all(s.endswith("synced") for s in states):
                raise RuntimeError(f"cycle snapshot: {errors or states}")
            return seconds, {"sessions": len(reports)}

        try:
            return self._measured("lr in-process (cycle)", run, self.sinks)
        finally:
            self.reset_sinks()

    def parallel_run(
        self,
        method: str,
        map_ranges: parallel.MapRanges,
        parts: int | None,
        extra: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ) -> SnapshotRun:
        def run() -> tuple[float, dict[str, Any]]:
            with env_var("LR_CONNECTIONS_FILE", str(self.sites.connections)):
                result = parallel.run_table_snapshot(self.sites.topology, SOURCE, CLIENT, map_ranges, parts=parts)
            if len(result.sessions) != len(SINK_SITES) or result.rows != self.rows * len(SINK_SITES):
                raise RuntimeError(f"{method}: {result.as_dict()}")
            details = {"ranges": result.ranges, "phases_s": result.seconds}
            return result.seconds["total"], {**details, **(extra(details) if extra else {})}

        try:
            return self._measured(method, run, self.sinks)
        finally:
            self.reset_sinks()

    def tee(self) -> SnapshotRun:
        return self.parallel_run("lr in-process (tee, 1 range)", parallel.local_ranges, 1)

    # lr, Spark
    def start_spark(self) -> dict[str, float]:
        from pyspark.sql import SparkSession

        for name, value in (
            ("SPARK_LOCAL_IP", "127.0.0.1"),
            ("PYSPARK_PYTHON", sys.executable),
            ("PYSPARK_DRIVER_PYTHON", sys.executable),
        ):
            os.environ.setdefault(name, value)
        started = time.perf_counter()
        self.spark = (
            SparkSession.builder.master("local[*]")
            .appName("lr-table-bench")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .getOrCreate()
        )
        self.spark.sparkContext.setLogLevel("ERROR")
        session_s = time.perf_counter() - started
        import lr_spark

        self.spark_start = {
            "session_s": round(session_s, 3),
            "warmup_s": lr_spark.warm_up(self.spark),
            "parallelism": self.spark.sparkContext.defaultParallelism,
        }
        print(
            f"  Spark local[*] ({self.spark_start['parallelism']} slots): session {session_s:.2f} s, "
            f"first warm-up {self.spark_start['warmup_s']:.2f} s",
            flush=True,
        )
        return self.spark_start

    def spark_run(self, parts: int | None) -> SnapshotRun:
        import lr_table_snapshot

        label = "auto" if parts is None else str(parts)
        return self.parallel_run(f"lr Spark local[*] (parts {label})", lr_table_snapshot.spark_map(self.spark), parts)

    def spark_submit_run(self) -> SnapshotRun:
        def run() -> tuple[float, dict[str, Any]]:
            result_file = self.home / "lr_table_snapshot.json"
            result_file.unlink(missing_ok=True)
            note = ""
            started = time.perf_counter()
            try:
                spark_submit(
                    "lr_table_snapshot.py",
                    [
                        "--source",
                        SOURCE,
                        "--client",
                        CLIENT,
                        "--topology",
                        str(self.sites.topology_file),
                        "--result-file",
                        str(result_file),
                    ],
                    self.sites.connections,
                    master="local[*]",
                )
            except RuntimeError as exc:  # judged by the result below: the rows must all be there
                note = str(exc).splitlines()[0]
            wall = time.perf_counter() - started
            result = json.loads(result_file.read_text()) if result_file.exists() else {}
            if result.get("rows") != self.rows * len(SINK_SITES):
                raise RuntimeError(f"spark-submit: {note} {result}")
            return wall, {
                "ranges": result["ranges"],
                "phases_s": result["seconds"],
                "exit": note or "0",
                "start_s": round(wall - result["seconds"]["total"], 3),
            }

        try:
            return self._measured("lr spark-submit (wall)", run, self.sinks)
        finally:
            self.reset_sinks()

    # native
    def native_initial(self) -> SnapshotRun:
        pub = _names(TABLE, 0)[0]
        subs = [_names(TABLE, i)[1] for i in range(len(self.native))]
        env = BenchEnv(self.src, self.native)

        def run() -> tuple[float, dict[str, Any]]:
            errors: list[str] = []

            def subscribe(dsn: str, sub: str) -> None:
                try:
                    conn = psycopg2.connect(dsn)
                    conn.autocommit = True
                    with conn.cursor() as cur:
                        cur.execute(
                            f"CREATE SUBSCRIPTION {sub} CONNECTION %s PUBLICATION {pub} "
                            "WITH (binary = true, copy_data = true)",
                            (self.src,),
                        )
                    conn.close()
                except Exception as exc:  # noqa: BLE001 - reported below
                    errors.append(f"{sub}: {exc!r}")

            threads = [threading.Thread(target=subscribe, args=(dsn, sub)) for dsn, sub in zip(self.native, subs)]
            started = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            created = time.perf_counter() - started
            if errors:
                raise RuntimeError(errors[0])
            per_sink = subscriptions_ready(self.native, TABLE, timeout_s=1800)
            seconds = time.perf_counter() - started
            return seconds, {
                "create_subscriptions_s": round(created, 3),
                "per_sink_ready_s": [round(created + s, 3) for s in per_sink],
                "binary": True,
            }

        drop_replication(env)
        execute(self.src, f"CREATE PUBLICATION {pub} FOR TABLE {TABLE}")
        for dsn in self.native:
            create_table(dsn, TABLE)
        try:
            return self._measured("native initial sync (binary)", run, self.native)
        finally:
            drop_replication(env)
            for dsn in self.native:
                execute(dsn, f"DROP TABLE IF EXISTS {TABLE}")

    # where the time goes
    def profile(self) -> dict[str, Any]:
        """The copy's parts at this size: source out, one sink in (with and without the key's index),
        and the raw tee into both sinks (the ceiling of lr's one-read design)."""
        quiet(self.env)
        out: dict[str, Any] = {}
        cols = "id, grp, created, payload"
        copy_out = f"COPY (SELECT {cols} FROM {TABLE}) TO STDOUT (FORMAT binary)"
        blocks: list[bytes] = []
        with psycopg.connect(self.src) as src:
            started = time.perf_counter()
            with src.cursor().copy(copy_out) as copy:
                blocks = list(coalesced(copy))
            out["source_copy_out_s"] = round(time.perf_counter() - started, 3)
        out["binary_mib"] = round(sum(map(len, blocks)) / 2**20, 1)

        class _Null:
            calls = 0

            def write(self, data: bytes) -> int:
                self.calls += 1
                return len(data)

        null = _Null()
        with contextlib.closing(psycopg2.connect(self.src)) as conn, conn.cursor() as cur:
            started = time.perf_counter()
            cur.copy_expert(copy_out, null)
            out["source_copy_out_psycopg2_s"] = round(time.perf_counter() - started, 3)
            out["psycopg2_write_calls"] = null.calls
            conn.rollback()
        sink = self.sinks[0]

        def load(table: str, index_after: bool) -> float:
            create_table(sink, table)
            if index_after:
                execute(sink, f"ALTER TABLE {table} DROP CONSTRAINT {table}_pkey")
            execute(sink, "CHECKPOINT")
            with psycopg.connect(sink) as conn:
                started = time.perf_counter()
                with conn.cursor().copy(f"COPY {table} ({cols}) FROM STDIN (FORMAT binary)") as copy:
                    for block in blocks:
                        copy.write(block)
                if index_after:
                    conn.execute(f"ALTER TABLE {table} ADD PRIMARY KEY (id)")
                conn.commit()
                seconds = time.perf_counter() - started
            execute(sink, f"DROP TABLE {table}")
            return round(seconds, 3)

        out["sink_copy_in_with_pk_s"] = load("prof_pk", False)
        out["sink_copy_in_then_pk_s"] = load("prof_nopk", True)
        out["raw_tee_2_sinks_s"] = self._raw_tee(copy_out, cols, index_after=False)
        out["raw_tee_2_sinks_then_pk_s"] = self._raw_tee(copy_out, cols, index_after=True)
        print("  profile: " + ", ".join(f"{k} {v}" for k, v in out.items()), flush=True)
        return out

    def _raw_tee(self, copy_out: str, cols: str, index_after: bool) -> float:
        """One binary COPY out of the source, its blocks written to both sinks' COPY in (psycopg 3, one
        thread; the sink servers ingest concurrently); ``index_after``: into tables without their
        primary key, which is then built on both sinks at once."""
        for dsn in self.sinks:
            create_table(dsn, "prof_tee")
            if index_after:
                execute(dsn, "ALTER TABLE prof_tee DROP CONSTRAINT prof_tee_pkey")
            execute(dsn, "CHECKPOINT")
        with psycopg.connect(self.src) as src, contextlib.ExitStack() as stack:
            conns = [stack.enter_context(psycopg.connect(dsn)) for dsn in self.sinks]
            started = time.perf_counter()
            with contextlib.ExitStack() as copies:
                into = [
                    copies.enter_context(c.cursor().copy(f"COPY prof_tee ({cols}) FROM STDIN (FORMAT binary)"))
                    for c in conns
                ]
                with src.cursor().copy(copy_out) as copy:
                    for block in coalesced(copy):
                        for c in into:
                            c.write(block)
            if index_after:
                threads = [
                    threading.Thread(target=c.execute, args=("ALTER TABLE prof_tee ADD PRIMARY KEY (id)",))
                    for c in conns
                ]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            for c in conns:
                c.commit()
            seconds = round(time.perf_counter() - started, 3)
        for dsn in self.sinks:
            execute(dsn, "DROP TABLE prof_tee")
        return seconds

    def close(self) -> None:
        if self.spark is not None:
            self.spark.stop()
        with contextlib.suppress(psycopg2.Error):
            drop_replication(BenchEnv(self.src, self.native))
        for dsn in self.env.sink_dsns:
            with contextlib.suppress(psycopg2.Error):
                execute(dsn, f"DROP DATABASE IF EXISTS {NATIVE_DB} WITH (FORCE)")
        with contextlib.suppress(psycopg2.Error):
            self.sites.drop()


def _parts(text: str) -> list[int | None]:
    return [None if p == "auto" else int(p) for p in text.split(",") if p]


def snapshot_part(env: BenchEnv, home: Path, args: argparse.Namespace, meter: CpuMeter) -> dict[str, Any]:
    """Every size: in-process cycle, in-process tee, Spark (auto parts). At ``--rows``: ``--rounds``
    rounds of those and native (order rotated each round), the other ``--parts`` once, spark-submit
    once, the profile."""
    sizes = sorted({*args.sizes, args.rows})
    bench = SnapshotBench(env, home, meter)
    runs: list[SnapshotRun] = []
    out: dict[str, Any] = {"sizes": sizes, "rows": args.rows, "rounds": args.rounds}
    spark = "spark" not in args.skip
    try:
        if spark:
            out["spark_start"] = bench.start_spark()
        for size in sizes:
            bench.grow(size)
            print(
                f"table of {size:,} rows ({row_bytes(bench.src, TABLE):.0f} bytes a row, "
                f"{table_mib(bench.src, TABLE)})",
                flush=True,
            )
            bench.tee()  # not recorded: the sinks' first write of this much (new WAL segments) bills no method
            key: list[Callable[[], SnapshotRun]] = [bench.cycle, bench.tee]
            if spark:
                key.append(lambda: bench.spark_run(None))
            if size != args.rows:
                runs += [run() for run in key]
                continue
            out["row_bytes"] = round(row_bytes(bench.src, TABLE), 1)
            out["table_mib"] = table_mib(bench.src, TABLE)
            key.insert(0, bench.native_initial)
            for round_no in range(args.rounds):
                shift = round_no % len(key)
                runs += [run() for run in key[shift:] + key[:shift]]
            if spark:
                runs += [bench.spark_run(parts) for parts in args.parts if parts is not None]
                if "spark-submit" not in args.skip:
                    runs.append(bench.spark_submit_run())
            out["profile"] = bench.profile()
    finally:
        bench.close()
    out["runs"] = [r.as_dict() for r in runs]
    out["summary"] = summarize(runs)
    out["paired_ratio_to_native"] = paired_ratios(runs, args.rows)
    out["threshold"] = threshold(out["summary"], out.get("spark_start"))
    return out


def summarize(runs: list[SnapshotRun]) -> list[dict[str, Any]]:
    """Median, min and max seconds per (method, rows), in first-seen order."""
    groups: dict[tuple[str, int], list[SnapshotRun]] = {}
    for r in runs:
        groups.setdefault((r.method, r.rows), []).append(r)
    out = []
    for (method, rows), rs in groups.items():
        secs = [r.seconds for r in rs]
        med = float(np.median(secs))
        out.append(
            {
                "method": method,
                "rows": rows,
                "n": len(rs),
                "median_s": round(med, 3),
                "min_s": round(min(secs), 3),
                "max_s": round(max(secs), 3),
                "rows_per_s": round(rows / med),
                "ranges": rs[0].details.get("ranges"),
                "start_s": rs[0].details.get("start_s"),
                "cpu_s": round(float(np.median([r.details["cpu_s"] for r in rs])), 2),
            }
        )
    return out


def paired_ratios(runs: list[SnapshotRun], rows: int) -> dict[str, dict[str, Any]]:
    """lr rows/s ÷ native rows/s within each round (the same load on the machine), per method."""
    at = [r for r in runs if r.rows == rows]
    natives = [r for r in at if r.method.startswith("native")]
    out: dict[str, dict[str, Any]] = {}
    for method in dict.fromkeys(r.method for r in at if not r.method.startswith("native")):
        mine = [r for r in at if r.method == method]
        if len(mine) != len(natives) or len(natives) < 2:
            continue
        ratios = [n.seconds / m.seconds for m, n in zip(mine, natives)]
        out[method] = {"median": round(float(np.median(ratios)), 2), "rounds": [round(x, 2) for x in ratios]}
    return out


def threshold(summary: list[dict[str, Any]], spark_start: dict[str, float] | None) -> dict[str, Any]:
    """Break-even rows of in-process (the cycle as ``lr sync`` runs it, and the tee) against the
    Spark job (auto parts) plus its cold start (spark-submit's when measured, else SparkSession +
    warm-up), from a line fitted to all sizes and from the line through the two largest."""
    by = {(s["method"], s["rows"]): s for s in summary}
    spk = {rows: s["median_s"] for (m, rows), s in by.items() if m == "lr Spark local[*] (parts auto)"}
    if not spk or not spark_start:
        return {}
    starts = {"sparksession": spark_start["session_s"] + spark_start["warmup_s"]}
    submit = [s for (m, _), s in by.items() if m == "lr spark-submit (wall)"]
    if submit:
        starts["spark_submit"] = submit[0]["start_s"]
    sizes = sorted(spk)
    out: dict[str, Any] = {"start_s": {k: round(v, 3) for k, v in starts.items()}, "sizes": sizes}
    for label, method in (("cycle", "lr in-process (cycle)"), ("tee", "lr in-process (tee, 1 range)")):
        ip = {rows: s["median_s"] for (m, rows), s in by.items() if m == method and rows in spk}
        if sorted(ip) != sizes:
            continue
        out[label] = {}
        for span, pts in (("all sizes", sizes), ("two largest", sizes[-2:])):
            a_ip, b_ip = fit(pts, [ip[n] for n in pts])
            a_sp, b_sp = fit(pts, [spk[n] for n in pts])
            gain = b_ip - b_sp  # seconds Spark saves per row
            out[label][span] = {
                "in_process_per_1m_s": round(b_ip * 1e6, 2),
                "spark_per_1m_s": round(b_sp * 1e6, 2),
                "break_even_rows": {
                    name: (None if gain <= 0 else max(0, int(round((start + a_sp - a_ip) / gain, -4))))
                    for name, start in {**starts, "warm": 0.0}.items()
                },
            }
    return out


# --- 2. writer overhead -------------------------------------------------------------------------
def _capture_function(name: str, body: str, declare: str = "") -> str:
    """A bench-only capture trigger function: the client id, the sinks' tags and a table id come as
    trigger arguments; lr's own apply (``lr.applying``) is left alone, as lr's capture does."""
    return f"""
CREATE OR REPLACE FUNCTION public.{name}() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    cid  integer := TG_ARGV[0]::integer;
    tags integer[] := TG_ARGV[1]::integer[];
    tid  integer := TG_ARGV[2]::integer;{declare}
BEGIN
    IF current_setting('lr.applying', true) = 'on' THEN
        RETURN NULL;
    END IF;{body}
    RETURN NULL;
END
$$"""


ROW_TRIGGER = _capture_function(
    "bench_capture_row",
    """
    IF TG_OP = 'DELETE' OR (TG_OP = 'UPDATE' AND OLD.id IS DISTINCT FROM NEW.id) THEN
        INSERT INTO lr.log_entries (stream, tag_ids, client_id, table_id, message)
        VALUES (3, tags, cid, tid, convert_to(jsonb_build_object('op', 'd', 'rows',
                jsonb_build_array(jsonb_build_object('id', OLD.id)))::text, 'UTF8'));
    END IF;
    IF TG_OP <> 'DELETE' THEN
        INSERT INTO lr.log_entries (stream, tag_ids, client_id, table_id, message)
        VALUES (3, tags, cid, tid, convert_to(jsonb_build_object('op', 'u', 'rows',
                jsonb_build_array(to_jsonb(NEW)))::text, 'UTF8'));
    END IF;""",
)
# lr.capture_table_changes for INSERT and UPDATE, with what it looks up per statement as arguments
CAPTURE_ARGS = _capture_function(
    "bench_capture_args",
    """
    IF TG_OP = 'UPDATE' THEN  -- keys no new row has (a key change), as lr's capture sends them
        INSERT INTO lr.log_entries (stream, tag_ids, client_id, table_id, message)
        SELECT 3, tags, cid, tid, convert_to(jsonb_build_object('op', 'd', 'rows', jsonb_agg(g.k))::text, 'UTF8')
        FROM (SELECT k, (row_number() OVER () - 1) / 500 AS part FROM (SELECT to_jsonb(o) - nonkey AS k FROM lr_old o
              EXCEPT SELECT to_jsonb(n) - nonkey FROM lr_new n) x) g GROUP BY g.part;
    END IF;
    INSERT INTO lr.log_entries (stream, tag_ids, client_id, table_id, message)
    SELECT 3, tags, cid, tid, convert_to(jsonb_build_object('op', 'u', 'rows', jsonb_agg(g.r))::text, 'UTF8')
    FROM (SELECT to_jsonb(n) AS r, (row_number() OVER () - 1) / 500 AS part FROM lr_new n) g GROUP BY g.part;""",
    declare="\n    nonkey text[] := TG_ARGV[3]::text[];",
)
WRITER_PREFILL = 20_000
WORKLOADS = [  # (name, threads, rows per transaction, kind)
    ("insert 1 row", 1, 1, "insert"),
    ("insert 1 row", 4, 1, "insert"),
    ("update 1 row", 1, 1, "update"),
    ("update 1 row", 4, 1, "update"),
    ("insert 1000 rows (1 statement)", 1, 1000, "insert"),
]
VARIANTS = ["plain", "native", "lr streaming", "lr capture", "lr capture, args", "row trigger"]


class CpuMeter:
    """CPU seconds (user + system) used so far by the bench's PostgreSQL servers (every process under
    each postmaster, and the backends that already exited: the postmaster's children's time), this
    process, and the process trees of ``extra`` roots (``lr sync``): what one transaction costs the
    whole machine, whoever spends it. Read from /proc (Linux)."""

    TICK = os.sysconf("SC_CLK_TCK")

    def __init__(self, pgdatas: list[str]) -> None:
        self.pgdatas = pgdatas
        self.extra: list[int] = []

    def __call__(self) -> float:
        stats: dict[int, list[str]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError):
                    stats[int(entry)] = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        postmasters = set()
        for pgdata in self.pgdatas:
            with contextlib.suppress(OSError, ValueError):
                postmasters.add(int(Path(pgdata, "postmaster.pid").read_text().split()[0]))
        roots = postmasters | {os.getpid(), *self.extra}
        children: dict[int, list[int]] = {}
        for pid, f in stats.items():
            children.setdefault(int(f[1]), []).append(pid)  # field 4 (ppid) is f[1] after the ')'
        ticks, todo = 0, [r for r in roots if r in stats]
        while todo:
            pid = todo.pop()
            f = stats[pid]
            ticks += int(f[11]) + int(f[12])  # utime, stime
            if pid in postmasters or pid in self.extra:
                ticks += int(f[13]) + int(f[14])  # cutime, cstime: exited backends, lr's children
            todo += children.get(pid, [])
        return ticks / self.TICK


def run_writers(
    dsn: str,
    table: str,
    threads: int,
    rows: int,
    kind: str,
    seconds: float,
    id_base: int,
    meter: Callable[[], float] | None = None,
) -> dict[str, Any]:
    """``threads`` connections, each committing transactions back to back for ``seconds``; with
    ``meter``, the CPU seconds the machine's bench processes used in that window too."""
    latencies: list[list[float]] = [[] for _ in range(threads)]
    errors: list[str] = []
    window = [0.0, 0.0, 0.0, 0.0]  # start, deadline, end; CPU at start (set as the writers are let go)
    cpu: list[float] = []

    def start() -> None:
        cpu.append(meter() if meter else 0.0)
        window[0] = time.perf_counter()
        window[1] = window[0] + seconds

    def end() -> None:  # every writer out of its loop, its connection still open
        window[2] = time.perf_counter()
        cpu.append(meter() if meter else 0.0)

    barrier = threading.Barrier(threads + 1, action=start)
    finished = threading.Barrier(threads, action=end)
    payload = "x" * PAYLOAD_CHARS

    def work(w: int) -> None:
        rng = random.Random(w)
        conn = psycopg2.connect(dsn)
        try:
            cur = conn.cursor()
            next_id = id_base + w * 100_000_000
            span = WRITER_PREFILL // threads
            barrier.wait()
            lat = latencies[w]
            while True:
                t0 = time.perf_counter()
                if t0 >= window[1]:
                    break
                if kind == "update":
                    cur.execute(
                        f"UPDATE {table} SET grp = grp + 1, payload = %s WHERE id = %s",
                        (payload, 1 + w * span + rng.randrange(span)),
                    )
                elif rows == 1:
                    cur.execute(
                        f"INSERT INTO {table} (id, grp, created, payload) VALUES (%s, %s, now(), %s)",
                        (next_id, w, payload),
                    )
                else:
                    psycopg2.extras.execute_values(
                        cur,
                        f"INSERT INTO {table} (id, grp, created, payload) VALUES %s",
                        [(next_id + i, w, payload) for i in range(rows)],
                        template="(%s, %s, now(), %s)",
                        page_size=rows,
                    )
                next_id += rows
                conn.commit()
                lat.append(time.perf_counter() - t0)
            finished.wait()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(f"writer {w}: {exc!r}")
            barrier.abort()
            finished.abort()
        finally:
            conn.close()

    pool = [threading.Thread(target=work, args=(w,), daemon=True) for w in range(threads)]
    for t in pool:
        t.start()
    barrier.wait(timeout=60)
    for t in pool:
        t.join()
    if errors:
        raise RuntimeError(errors[0])
    elapsed = window[2] - window[0]
    flat = [x for lat in latencies for x in lat]
    out = {
        "tps": round(len(flat) / elapsed, 1),
        "rows_per_s": round(len(flat) * rows / elapsed, 1),
        "txns": len(flat),
        "latency_ms": _ms(flat),
    }
    if meter:
        out["cpu_ms_per_txn"] = round((cpu[1] - cpu[0]) * 1000 / max(1, len(flat)), 3)
        out["cpu_cores_busy"] = round((cpu[1] - cpu[0]) / elapsed, 2)
    return out


class WriterBench:
    """One round: fresh lr databases, one table per variant on site-a (``lr streaming``'s in lr
    databases of its own, so that its log holds only its own entries), the workloads on each."""

    def __init__(self, env: BenchEnv, home: Path, round_no: int, meter: CpuMeter) -> None:
        self.env, self.home, self.round_no, self.meter = env, home, round_no, meter
        self.sites = LrSites(env, f"tables_w{round_no}", SITES)
        self.stream_sites = LrSites(env, f"tables_ws{round_no}", SITES)
        self.native = [psycopg2.extensions.make_dsn(dsn, dbname=f"{NATIVE_DB}_w") for dsn in env.sink_dsns]
        for dsn in env.sink_dsns:
            execute(dsn, f"DROP DATABASE IF EXISTS {NATIVE_DB}_w WITH (FORCE)", f"CREATE DATABASE {NATIVE_DB}_w")
        self.tables = {v: "w_" + "_".join(v.replace(",", "").split()) for v in VARIANTS}
        for variant, table in self.tables.items():
            create_table(self.dsn(variant), table, WRITER_PREFILL)
        for variant in ("lr capture", "lr streaming"):
            with contextlib.closing(psycopg2.connect(self.dsn(variant))) as conn:
                registry.open_table(conn, f"public.{self.tables[variant]}", CLIENT)
        src = self.dsn("row trigger")
        ((cid, tags, tid),) = execute(
            src,
            "SELECT c.client_id, array_agg(r.tag_id ORDER BY r.tag_id)::text, nextval('lr.table_id_seq') "
            "FROM lr.clients c JOIN lr.source_sessions s ON s.client_name = c.client_name "
            f"JOIN lr.remote_sites r ON r.site_id = s.sink_site_id WHERE c.client_name = '{CLIENT}' GROUP BY c.client_id",
        )
        self.row_trigger = {"client_id": cid, "tags": tags, "table_id": tid}
        execute(
            src,
            ROW_TRIGGER,
            f"CREATE TRIGGER bench_capture AFTER INSERT OR UPDATE OR DELETE ON {self.tables['row trigger']} "
            f"FOR EACH ROW EXECUTE FUNCTION public.bench_capture_row('{cid}', '{tags}', '{tid}')",
        )
        args = f"'{cid}', '{tags}', '{tid}', '{{grp,created,payload}}'"
        table = self.tables["lr capture, args"]
        execute(
            src,
            CAPTURE_ARGS,
            f"CREATE TRIGGER bench_capture_i AFTER INSERT ON {table} REFERENCING NEW TABLE AS lr_new "
            f"FOR EACH STATEMENT EXECUTE FUNCTION public.bench_capture_args({args})",
            f"CREATE TRIGGER bench_capture_u AFTER UPDATE ON {table} REFERENCING OLD TABLE AS lr_old NEW TABLE AS lr_new "
            f"FOR EACH STATEMENT EXECUTE FUNCTION public.bench_capture_args({args})",
        )

    def dsn(self, variant: str) -> str:
        return (self.stream_sites if variant == "lr streaming" else self.sites).dsns[SOURCE]

    @contextlib.contextmanager
    def replicating(self, variant: str) -> Iterator[dict[str, Any]]:
        """What runs beside the writers: native's subscriptions, or ``lr sync``, or nothing."""
        info: dict[str, Any] = {}
        table, src = self.tables[variant], self.dsn(variant)
        if variant == "native":
            native_streaming(src, self.native, table, COLUMNS)
            try:
                yield info
                info["sinks_caught_up_s"] = _caught_up(src, self.native, table)
            finally:
                drop_replication(BenchEnv(src, self.native))
            return
        if variant == "lr streaming":
            sinks = [self.stream_sites.dsns[s] for s in SINK_SITES]
            with lr_sync(self.stream_sites, self.home, f"writers-{self.round_no}") as proc:
                _wait(
                    lambda: all(_count(dsn, table) == WRITER_PREFILL for dsn in sinks),
                    300,
                    "the streamed table's snapshot",
                )
                self.meter.extra = [proc.pid]
                try:
                    yield info
                finally:
                    self.meter.extra = []
                info["sinks_caught_up_s"] = _caught_up(src, sinks, table)
            return
        yield info

    def close(self) -> None:
        with contextlib.suppress(psycopg2.Error):
            drop_replication(BenchEnv(self.dsn("native"), self.native))
        for dsn in self.env.sink_dsns:
            with contextlib.suppress(psycopg2.Error):
                execute(dsn, f"DROP DATABASE IF EXISTS {NATIVE_DB}_w WITH (FORCE)")
        for sites in (self.sites, self.stream_sites):
            with contextlib.suppress(psycopg2.Error):
                sites.drop()


def native_streaming(src: str, sinks: list[str], table: str, columns: str) -> None:
    """Native replication of ``table``: a publication on ``src``, the table and a subscription
    (``binary = true``, initial copy) on each sink; returns once every sink's copy is ready and its
    apply worker runs."""
    pub = _names(table, 0)[0]
    execute(src, f"CREATE PUBLICATION {pub} FOR TABLE {table}")
    for i, dsn in enumerate(sinks):
        execute(dsn, f"DROP TABLE IF EXISTS {table}", f"CREATE TABLE {table} {columns}")
        conn = psycopg2.connect(dsn)
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(
                f"CREATE SUBSCRIPTION {_names(table, i)[1]} CONNECTION %s PUBLICATION {pub} "
                "WITH (binary = true, copy_data = true)",
                (src,),
            )
        conn.close()
    subscriptions_ready(sinks, table, timeout_s=300, running=True)


def _count(dsn: str, table: str) -> int | None:
    try:
        return execute(dsn, f"SELECT count(*) FROM {table}")[0][0]
    except psycopg2.Error:
        return None


def _wait(predicate: Callable[[], bool], timeout: float, what: str) -> float:
    started = time.perf_counter()
    while not predicate():
        if time.perf_counter() - started > timeout:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.1)
    return round(time.perf_counter() - started, 2)


def _caught_up(src: str, sinks: list[str], table: str) -> float:
    """Seconds after the writers stopped until every sink holds the source's rows (checked whole)."""
    want = checksum(src, table)
    return _wait(lambda: all(checksum(dsn, table) == want for dsn in sinks), 300, f"the sinks to catch up on {table}")


@contextlib.contextmanager
def lr_sync(sites: LrSites, home: Path, tag: str) -> Iterator[subprocess.Popen]:
    """``lr sync`` as a user runs it (streaming mode, its own process and process group), on the
    sites' topology; its output in ``home/lr-sync-<tag>.log``. Stopped with SIGINT (it releases its
    sessions), then SIGTERM, then SIGKILL."""
    cmd = [*lr_command("lr sync"), "--topology", str(sites.topology_file)]
    env = {
        **os.environ,
        "LR_CONNECTIONS_FILE": str(sites.connections),
        "LR_HOME": str(home / "lr-home"),
        "PYTHONUNBUFFERED": "1",
    }
    with open(home / f"lr-sync-{tag}.log", "wb") as log:
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=home,
            start_new_session=True,
            preexec_fn=lr_preexec,
        )  # noqa: PLW1509 (as streaming_bench)
    try:
        yield proc
        if proc.poll() is not None:
            raise RuntimeError(f"lr sync exited ({proc.returncode}); see {home / f'lr-sync-{tag}.log'}")
    finally:
        for sig, wait in ((signal.SIGINT, LR_STOP_S), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            if proc.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=wait)


def writers_part(env: BenchEnv, home: Path, args: argparse.Namespace, pgdatas: list[str]) -> dict[str, Any]:
    """``--writer-rounds`` rounds, the variants in the listed order in even rounds and reversed in
    odd ones (a variant's place in the round must not decide its figure)."""
    meter = CpuMeter(pgdatas)
    rounds: list[dict[str, Any]] = []
    for round_no in range(args.writer_rounds):
        bench = WriterBench(env, home, round_no, meter)
        this: dict[str, Any] = {"row_trigger": bench.row_trigger, "variants": {}}
        try:
            for variant in VARIANTS if round_no % 2 == 0 else VARIANTS[::-1]:
                quiet(env)
                with bench.replicating(variant) as info:
                    got = {}
                    for n, (name, threads, rows, kind) in enumerate(WORKLOADS):
                        got[f"{name} x{threads}"] = run_writers(
                            bench.dsn(variant),
                            bench.tables[variant],
                            threads,
                            rows,
                            kind,
                            args.writer_seconds,
                            10_000_000 * (n + 1),
                            meter,
                        )
                this["variants"][variant] = {"workloads": got, "info": info}
                print(
                    f"  round {round_no + 1} {variant:<13} "
                    + ", ".join(f"{k} {v['tps']:,.0f}/s {v['cpu_ms_per_txn']} ms cpu" for k, v in got.items())
                    + f" {info or ''}",
                    flush=True,
                )
        finally:
            bench.close()
        rounds.append(this)
    summary: dict[str, dict[str, Any]] = {}
    for variant in VARIANTS:
        for key in rounds[0]["variants"][variant]["workloads"]:
            figs = [r["variants"][variant]["workloads"][key] for r in rounds]
            summary.setdefault(key, {})[variant] = {
                "tps": round(float(np.median([f["tps"] for f in figs])), 1),
                "tps_rounds": [f["tps"] for f in figs],
                "p50_ms": round(float(np.median([f["latency_ms"]["p50"] for f in figs])), 3),
                "p99_ms": round(float(np.median([f["latency_ms"]["p99"] for f in figs])), 3),
                "cpu_ms_per_txn": round(float(np.median([f["cpu_ms_per_txn"] for f in figs])), 3),
            }
    return {"seconds_each": args.writer_seconds, "rounds": rounds, "summary": summary}


# --- 3. table-change lag ------------------------------------------------------------------------
LAG_KEYS = 5000  # rows per writer: a key comes back only after LAG_KEYS of its writer's commits
ARRIVALS = """
CREATE TABLE IF NOT EXISTS public.lag_arrivals (writer int, seq bigint, at timestamptz);
CREATE OR REPLACE FUNCTION public.lag_arrival() RETURNS trigger LANGUAGE plpgsql SET search_path = pg_catalog AS
$$ BEGIN INSERT INTO public.lag_arrivals VALUES (NEW.grp, NEW.seq, clock_timestamp()); RETURN NULL; END $$"""
LAG_COLUMNS = "(id bigint PRIMARY KEY, grp integer NOT NULL, seq bigint NOT NULL, payload text NOT NULL)"


def _lag_table(dsn: str, table: str, writers: int) -> None:
    execute(
        dsn,
        f"DROP TABLE IF EXISTS {table}",
        f"CREATE TABLE {table} {LAG_COLUMNS}",
        f"INSERT INTO {table} SELECT g, -1, -1, 'init' FROM generate_series(0, {writers * LAG_KEYS - 1}) g",
        f"VACUUM (ANALYZE) {table}",
    )


def _arrival_trigger(dsn: str, table: str) -> None:
    execute(
        dsn,
        ARRIVALS,
        "TRUNCATE lag_arrivals",
        f"CREATE TRIGGER lag_arrival AFTER INSERT OR UPDATE ON {table} FOR EACH ROW EXECUTE FUNCTION public.lag_arrival()",
        f"ALTER TABLE {table} ENABLE ALWAYS TRIGGER lag_arrival",
    )  # apply workers fire ALWAYS triggers


def _arrivals(sinks: dict[str, str]) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    out = {}
    for site, dsn in sinks.items():
        rows = execute(
            dsn, "SELECT writer, seq, (extract(epoch FROM at) * 1000000)::bigint FROM lag_arrivals WHERE seq >= 0"
        )
        a = np.array(rows, dtype=np.int64).reshape(-1, 3)
        out[site] = (a[:, 0], a[:, 1], a[:, 2] * 1000)
    return out


def _drain(sinks: dict[str, str], committed: int, timeout: float = 120.0) -> float:
    return _wait(
        lambda: all(
            execute(dsn, "SELECT count(*) FROM lag_arrivals WHERE seq >= 0")[0][0] >= committed
            for dsn in sinks.values()
        ),
        timeout,
        "the last updates at the sinks",
    )


def lag_part(env: BenchEnv, home: Path, args: argparse.Namespace) -> dict[str, Any]:
    plan = Plan(args.lag_rate, args.lag_writers, 2.0, args.lag_seconds)
    table = "lag_rows"
    out: dict[str, Any] = {"rate": args.lag_rate, "writers": args.lag_writers, "seconds": args.lag_seconds}

    def make_send(conn: Any) -> Callable[[int, int, bytes], None]:
        cur = conn.cursor()
        return lambda w, seq, payload: cur.execute(
            f"UPDATE {table} SET grp = %s, seq = %s, payload = %s WHERE id = %s",
            (w, seq, payload.hex()[:PAYLOAD_CHARS], w * LAG_KEYS + seq % LAG_KEYS),
        )

    def measure(system: str, src: str, sinks: dict[str, str]) -> dict[str, Any]:
        writers = Writers(plan, src, make_send)
        writers.run()
        drained = _drain(sinks, writers.committed)
        fig = figures(writers, _arrivals(sinks))
        lag = fig["lag_ms"]
        print(
            f"  {system:<7} {fig['achieved_per_s']:,.0f}/s p50 {lag['p50']} ms p95 {lag['p95']} ms p99 {lag['p99']} ms "
            f"(lost {fig['lost']}, duplicated {fig['duplicated']}, drained in {drained} s)",
            flush=True,
        )
        return {**fig, "drain_s": drained}

    # lr: federated table, its snapshot by the first cycle, then streaming
    sites = LrSites(env, "tables_lag", SITES)
    try:
        src, sinks = sites.dsns[SOURCE], {s: sites.dsns[s] for s in SINK_SITES}
        _lag_table(src, table, plan.writers)
        with contextlib.closing(psycopg2.connect(src)) as conn:
            registry.open_table(conn, f"public.{table}", CLIENT)
        quiet(env)
        with lr_sync(sites, home, "lag"):
            _wait(
                lambda: all(_count(dsn, table) == plan.writers * LAG_KEYS for dsn in sinks.values()),
                300,
                "the lag table's snapshot",
            )
            for dsn in sinks.values():
                _arrival_trigger(dsn, table)
            out["lr"] = measure("lr", src, sinks)
        verify(src, list(sinks.values()), table, "lr lag")
    finally:
        sites.drop()
    # native: publication, one subscription per sink server (binary), the same writers
    src = psycopg2.extensions.make_dsn(env.source_dsn, dbname=f"{NATIVE_DB}_lag")
    sinks = {
        s: psycopg2.extensions.make_dsn(dsn, dbname=f"{NATIVE_DB}_lag") for s, dsn in zip(SINK_SITES, env.sink_dsns)
    }
    for admin in (env.source_dsn, *env.sink_dsns):
        execute(admin, f"DROP DATABASE IF EXISTS {NATIVE_DB}_lag WITH (FORCE)", f"CREATE DATABASE {NATIVE_DB}_lag")
    nenv = BenchEnv(src, list(sinks.values()))
    try:
        _lag_table(src, table, plan.writers)
        native_streaming(src, list(sinks.values()), table, LAG_COLUMNS)
        for dsn in sinks.values():
            _arrival_trigger(dsn, table)
        quiet(env)
        out["native"] = measure("native", src, sinks)
        verify(src, list(sinks.values()), table, "native lag")
    finally:
        drop_replication(nenv)
        for admin in (env.source_dsn, *env.sink_dsns):
            with contextlib.suppress(psycopg2.Error):
                execute(admin, f"DROP DATABASE IF EXISTS {NATIVE_DB}_lag WITH (FORCE)")
    return out


# --- 5. the sink transaction of a table change ---------------------------------------------------
SINK_PATHS = ("general", "stream")


def sink_part(env: BenchEnv, args: argparse.Namespace) -> dict[str, Any]:
    table, n = "sink_rows", args.sink_transactions
    sites = LrSites(env, "tables_sink", SITES)
    try:
        src, sink = sites.dsns[SOURCE], sites.dsns[SINK_SITES[0]]
        _lag_table(src, table, 1)
        with contextlib.closing(psycopg2.connect(src)) as conn:
            registry.open_table(conn, f"public.{table}", CLIENT)
        repl = sites.replicator()
        try:
            repl.run_cycle()  # the table's snapshot
        finally:
            repl.close()
        ((tid, base, last, epoch),) = execute(
            sink,
            "SELECT t.source_table_id, s.snapshot_applied, s.last_log_entry_processed, s.lease_epoch "
            "FROM lr.sink_tables t JOIN lr.sink_sessions s USING (source_site_id, client_name) "
            f"WHERE t.table_name = 'public.{table}' AND t.state = 'synced'",
        )
        quiet(env)
        seconds: dict[str, list[float]] = {path: [] for path in SINK_PATHS}
        with contextlib.closing(psycopg2.connect(sink)) as conn:
            conn.autocommit = True  # as the stream's sink connection
            for i in range(n):
                row = {"id": i % LAG_KEYS, "grp": 0, "seq": i, "payload": f"{i:0{PAYLOAD_CHARS}d}"}
                message = json.dumps({"op": "u", "rows": [row]}).encode()
                batch = LogBatch(last, last + 1, [LogRecord(last + 1, 1, message, tid)])
                path = SINK_PATHS[i % 2]
                started = time.perf_counter()
                end = None
                if path == "stream":
                    (end,) = stream_batch.stream_batches(
                        conn, SOURCE, [stream_batch.StreamWrite(CLIENT, epoch, batch, base)]
                    )
                if end is None:
                    end = writes.apply_log_stream(
                        conn, SOURCE, CLIENT, epoch, batch, base, register=False, synchronous=False
                    )
                seconds[path].append(time.perf_counter() - started)
                last = end
        ((changed,),) = execute(
            sink, f"SELECT count(*) FROM {table} WHERE seq >= 0 AND payload = lpad(seq::text, 164, '0')"
        )
        if changed != min(n, LAG_KEYS):
            raise RuntimeError(f"sink transactions: {changed} rows changed of {min(n, LAG_KEYS)}")
        ms = {}
        for path, times in seconds.items():
            kept = np.array(times[len(times) // 10 :]) * 1000.0
            ms[path] = dict(
                zip(
                    ("p50", "p90", "p99", "max"),
                    (round(float(v), 3) for v in [*np.percentile(kept, [50, 90, 99]), kept.max()]),
                )
            )
            p = ms[path]
            print(
                f"  {len(times)} sink transactions, {path}: p50 {p['p50']} ms p90 {p['p90']} p99 {p['p99']}", flush=True
            )
        return {"transactions": n, "ms": ms}
    finally:
        sites.drop()


# --- report -------------------------------------------------------------------------------------
def markdown(result: dict[str, Any]) -> str:
    lines: list[str] = []
    snap = result.get("snapshot")
    if snap:
        summary = snap["summary"]
        native = next((r for r in summary if r["method"].startswith("native")), None)
        paired = snap.get("paired_ratio_to_native", {})
        lines += [
            "### Snapshot to 2 sinks (median of runs; min–max)",
            "",
            "| method | rows | runs | seconds | rows/s | × native | ranges | CPU s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in summary:
            ratio = ""
            if native and r["rows"] == native["rows"]:
                ratio = f"{native['median_s'] / r['median_s']:.2f}"
                if r["method"] in paired:
                    ratio += f" (paired {paired[r['method']]['median']:.2f})"
            spread = f"{r['median_s']:.2f}" + (f" ({r['min_s']:.2f}–{r['max_s']:.2f})" if r["n"] > 1 else "")
            lines.append(
                f"| {r['method']} | {r['rows']:,} | {r['n']} | {spread} | {r['rows_per_s']:,} | {ratio} | "
                f"{r['ranges'] or ''} | {r['cpu_s']} |"
            )
        if snap.get("spark_start"):
            s = snap["spark_start"]
            lines += [
                "",
                (
                    f"Spark local[*] start: session {s['session_s']} s + first warm-up {s['warmup_s']} s "
                    f"({s['parallelism']} task slots)."
                ),
            ]
        if snap.get("profile"):
            lines += [
                "",
                f"Profile at {snap['rows']:,} rows: " + ", ".join(f"{k} {v}" for k, v in snap["profile"].items()) + ".",
            ]
        th = snap.get("threshold")
        if th:
            lines += [
                "",
                f"Threshold (Spark auto parts + cold start {th['start_s']} s against in-process): "
                + "; ".join(f"{k}, {span}: {v}" for k in ("cycle", "tee") for span, v in th.get(k, {}).items())
                + ".",
            ]
        lines.append("")
    wr = result.get("writers")
    if wr:
        lines += [
            (
                "### Writer overhead (median of rounds: transactions/s (× plain); latency p50 / p99 ms; "
                "CPU ms per transaction, all bench processes)"
            ),
            "",
            "| workload | " + " | ".join(VARIANTS) + " |",
            "|---|" + "---:|" * len(VARIANTS),
        ]
        for key, by in wr["summary"].items():
            cells = []
            for v in VARIANTS:
                f = by[v]
                rel = f" ({f['tps'] / by['plain']['tps']:.0%})" if v != "plain" else ""
                cells.append(
                    f"{f['tps']:,.0f}{rel}<br>{f['p50_ms']:.2f} / {f['p99_ms']:.2f}<br>{f['cpu_ms_per_txn']:.2f}"
                )
            lines.append(f"| {key} | " + " | ".join(cells) + " |")
        lines.append("")
    lag = result.get("lag")
    if lag:
        lines += [
            (
                f"### Table-change lag ({lag['rate']}/s single-row updates, {lag['writers']} writers, "
                f"{lag['seconds']} s)"
            ),
            "",
            "| system | achieved/s | p50 ms | p95 ms | p99 ms | max ms | lost | dup |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for system in ("lr", "native"):
            if system in lag:
                f, p = lag[system], lag[system]["lag_ms"]
                lines.append(
                    f"| {system} | {f['achieved_per_s']:,.0f} | {p['p50']} | {p['p95']} | {p['p99']} | {p['max']} | "
                    f"{f['lost']} | {f['duplicated']} |"
                )
        lines.append("")
    sink = result.get("sink")
    if sink:
        lines += [
            f"### Sink transaction of a one-row table change ({sink['transactions']} on one connection, paths alternating)",
            "",
            "| path | p50 ms | p90 ms | p99 ms | max ms |",
            "|---|---:|---:|---:|---:|",
            *(f"| {path} | {m['p50']} | {m['p90']} | {m['p99']} | {m['max']} |" for path, m in sink["ms"].items()),
            "",
        ]
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of the snapshot table (largest size)")
    parser.add_argument(
        "--sizes",
        type=_ints,
        default=[100_000, 300_000, 3_000_000],
        help="other sizes for the in-process/Spark threshold (comma list; in-process and Spark only)",
    )
    parser.add_argument(
        "--parts",
        type=_parts,
        default=[None, 2, 4, 8],
        help="Spark key ranges to try at --rows (comma list; auto = the engine's default)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds of the key figures at --rows (native, tee, Spark auto, cycle; order rotated)",
    )
    parser.add_argument("--writer-seconds", type=float, default=3.0, help="seconds per writer workload and variant")
    parser.add_argument("--writer-rounds", type=int, default=2, help="rounds of the writer workloads (fresh databases)")
    parser.add_argument("--lag-rate", type=int, default=500, help="single-row updates per second, all writers")
    parser.add_argument("--lag-writers", type=int, default=2)
    parser.add_argument("--lag-seconds", type=float, default=10.0)
    parser.add_argument("--sink-transactions", type=int, default=3000, help="sink transactions of part 5")
    parser.add_argument("--skip", default="", help="comma list of: snapshot, writers, lag, sink, spark, spark-submit")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 20k rows, sizes 5k/10k/40k, parts auto/2, 2 rounds, 1 s writers, 1 round, 3 s of lag at 200/s, "
        "500 sink transactions",
    )
    parser.add_argument("--keep", action="store_true", help="leave the servers' data directory in place")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    args.skip = {s for s in args.skip.split(",") if s}
    parts = {"snapshot", "writers", "lag", "sink", "spark", "spark-submit"}
    if args.skip - parts:
        parser.error(f"--skip: unknown {sorted(args.skip - parts)}")
    if args.quick:
        args.rows, args.sizes, args.parts, args.rounds = 20_000, [5_000, 10_000, 40_000], [None, 2], 2
        args.writer_seconds, args.writer_rounds, args.lag_rate, args.lag_seconds = 1.0, 1, 200, 3.0
        args.sink_transactions = 500
    out_path = args.out or BENCH / "results" / ("table_bench_quick.json" if args.quick else "table_bench.json")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    signal.signal(signal.SIGTERM, _interrupt)
    load_before = os.getloadavg()
    wall = time.perf_counter()
    home = Path(tempfile.mkdtemp(prefix="lr-table-bench-"))
    print(
        f"machine: {os.cpu_count()} cores, load {load_before[0]:.2f}; {platform.platform()}; "
        f"python {platform.python_version()}",
        flush=True,
    )
    manager = SiteManager(home)
    result: dict[str, Any] = {}
    interrupted = False
    try:
        servers = manager.up(count=len(SITES))
        env = BenchEnv(servers[0].dsn(), [s.dsn() for s in servers[1:]], manager)
        keys = ("server_version", "synchronous_commit", "wal_level", "shared_buffers", "max_wal_size")
        result["server"] = dict(
            execute(env.source_dsn, f"SELECT name, setting FROM pg_settings WHERE name IN {keys!r}")
        )
        print(f"PostgreSQL {result['server']['server_version']} x3 under {home}", flush=True)
        if "snapshot" not in args.skip:
            print("\n1. snapshot", flush=True)
            result["snapshot"] = snapshot_part(env, home, args, CpuMeter([s.pgdata for s in servers]))
        if "writers" not in args.skip:
            print("\n2. writer overhead", flush=True)
            result["writers"] = writers_part(env, home, args, [s.pgdata for s in servers])
        if "lag" not in args.skip:
            print("\n3. table-change lag", flush=True)
            result["lag"] = lag_part(env, home, args)
        if "sink" not in args.skip:
            print("\n5. sink transaction of a table change", flush=True)
            result["sink"] = sink_part(env, args)
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted: stopping everything", file=sys.stderr, flush=True)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        manager.down(mode="fast", remove=not args.keep)
        if not args.keep:
            shutil.rmtree(home, ignore_errors=True)
    if result:
        git = subprocess.run(
            ["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True, text=True, check=False
        )
        result["run"] = {
            "argv": sys.argv[1:],
            "quick": args.quick,
            "git": git.stdout.strip(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "wall_s": round(time.perf_counter() - wall, 1),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        }
        text = markdown(result)
        print("\n" + text)
        print(f"wall {result['run']['wall_s']} s, load before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}")
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=2, default=str))
        print(f"wrote {out_path}")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
