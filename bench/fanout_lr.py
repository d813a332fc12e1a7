"""lr's own runs for the fan-out benchmark (merged into ``fanout_bench.MEASUREMENTS``).

* ``lr_catchup``   the Spark fan-out job (``spark_jobs/lr_fanout.py --tasks 1``: the ordered tee in
                   one task) submitted with ``spark-submit --master local[2]``, moving the whole
                   backlog from the source's shared log into the 3 sinks' receive queues.
* ``lr_staged_1core`` / ``lr_staged_2cores`` the staged fan-out (``--tasks 2``: chunks teed at
                   once, staged, published in order) on ``local[1]`` (one task at a time) and on
                   ``local[2]`` (two at once): the 1-vs-N-tasks figure. Timed inside the job from plan to
                   the last commit (the Spark session is up, its first job is included); the
                   wall time with the Spark start is in the details, with peak memory of the
                   driver (Python, JVM) and the executors' Python workers.
* ``lr_inprocess`` the same backlog moved by in-process session cycles (``lr sync``'s engine,
                   log-entry batches of 10,000), for the in-process/Spark threshold.
* ``lr_sync``      the same backlog by ``lr sync``'s engine as shipped: a backlog of at least
                   ``tee_min_backlog`` is caught up by the in-process tee, then session cycles.
* ``lr_inprocess_tee`` the fan-out's tee (``engine.fanout.run_fanout`` with ``local_map``) run in
                   this process, no Spark: what the catch-up costs without the Spark start.

Each run gets fresh databases (``lr_<variant>``) on the bench's 4 servers, the lr schema, a
topology source → 3 sinks, every session through an (empty) full sync, then the backlog: the
bench's ``fanout_entries`` rows (same payloads, same destination bits) written to the shared log
as ``transmit`` writes them, ``Workload.batch`` entries per transaction. Deliveries are checked:
per-sink counts, source order of ``seq`` and a sample of payloads byte for byte.

Must not import ``fanout_bench`` (run as ``__main__`` it would be a second copy).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg2
import psycopg2.extensions

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fanout_anchors import BACKLOG_TABLE, SINKS, BenchEnv, Measurement, Workload, cpu_window, execute  # noqa: E402

from airflow_provider_lr.client import RoutingQueueClient  # noqa: E402
from airflow_provider_lr.engine.bulk import pgcopy
from airflow_provider_lr.engine.db import schema
from airflow_provider_lr.engine.session.settings import SessionSettings  # noqa: E402
from airflow_provider_lr.engine.sink import queue_rows
from airflow_provider_lr.engine.site import topology
from airflow_provider_lr.engine.site.replicator import Replicator  # noqa: E402
from airflow_provider_lr.engine.store import topology as topologies
from airflow_provider_lr.engine.vocabulary import STREAM_LOG_ENTRIES  # noqa: E402
from airflow_provider_lr.proto import lr_pb2  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SOURCE_ID = "bench-src"
SINK_IDS = [f"bench-s{i}" for i in range(SINKS)]
CLIENT = "bench"
SPARK_MASTER = os.environ.get("LR_BENCH_SPARK_MASTER", "local[2]")


def _dsn(dsn: str, dbname: str) -> str:
    return psycopg2.extensions.make_dsn(dsn, dbname=dbname)


class LrSites:
    """Fresh lr databases on the bench servers, a topology over them and a connections file."""

    def __init__(
        self,
        env: BenchEnv,
        name: str,
        site_ids: list[str] | None = None,
        providers: dict[str, str] | None = None,
        initial_sync: bool = True,
        clients: list[str] | None = None,
        settings: dict[str, Any] | None = None,
    ) -> None:
        """``site_ids``: the source's, then one per sink of ``env`` (default ``bench-src`` and 3
        sinks); ``providers``: the topology's (``client: "module:function"``); ``initial_sync``:
        bring every session through its (empty) full sync here, in process; ``clients``: each
        client replicates to every sink (default: ``bench``); ``settings``: the topology's (default:
        10-minute leases, so no lease runs out under a long measurement)."""
        self.name = name
        self.admin = [env.source_dsn, *env.sink_dsns]
        site_ids = site_ids or [SOURCE_ID, *SINK_IDS]
        if len(site_ids) != len(self.admin):
            raise ValueError(f"{len(site_ids)} site ids for {len(self.admin)} servers")
        self.dbnames = [f"{name}_{i}" for i in range(len(self.admin))]  # distinct even on one server
        for dsn, db in zip(self.admin, self.dbnames):
            execute(dsn, f"DROP DATABASE IF EXISTS {db} WITH (FORCE)", f"CREATE DATABASE {db}")
        self.dsns = {site: _dsn(dsn, db) for site, dsn, db in zip(site_ids, self.admin, self.dbnames)}
        self.dir = Path(tempfile.mkdtemp(prefix="lr-bench-"))
        conns = {}
        for site, dsn in self.dsns.items():
            p = psycopg2.extensions.parse_dsn(dsn)
            conns[site] = {
                "conn_type": "lr_site",
                "host": p.get("host"),
                "port": int(p.get("port", 5432)),
                "login": p.get("user"),
                "password": p.get("password"),
                "schema": p["dbname"],
                "extra": {"site_id": site},
            }
        self.connections = self.dir / "connections.json"
        self.connections.write_text(json.dumps(conns))
        self.connections.chmod(0o600)
        doc = {
            "sites": [{"id": s, "conn_id": s} for s in self.dsns],
            "replication": [{"source": site_ids[0], "sinks": site_ids[1:], "clients": clients or [CLIENT]}],
            "settings": {"lease_seconds": 600} if settings is None else settings,
        }
        if providers:
            doc["providers"] = providers
        self.topology = topologies.from_document(doc)
        self.topology_file = self.dir / "topology.json"  # JSON is YAML
        self.topology_file.write_text(json.dumps(doc))
        for site, dsn in self.dsns.items():
            conn = psycopg2.connect(dsn)
            schema.init_site(conn, site)
            topology.apply_to_site(conn, self.topology, site)
            conn.close()
        if not initial_sync:
            return
        repl = self.replicator()
        try:
            reports = repl.run(max_cycles=5, until_idle=True, interval=0.01)
            if any(r.error or r.state != "IN_LOG_ENTRY_SYNC" for r in reports):
                raise RuntimeError(f"sessions not in log-entry sync: {reports}")
        finally:
            repl.close()

    def replicator(self, tee_min_backlog: int = 0) -> Replicator:
        """``lr sync``'s engine; by default session cycles only (``tee_min_backlog`` 0)."""
        settings = SessionSettings(
            barrier_timeout=5.0, max_batches=1_000_000, lease_seconds=600, tee_min_backlog=tee_min_backlog
        )
        return Replicator(
            self.topology,
            lambda site: psycopg2.connect(self.dsns[site]),
            settings=settings,
            providers={CLIENT: lambda ctx: None},
        )

    def fill_backlog(self, env: BenchEnv, workload: Workload) -> None:
        """The bench table's rows as log entries, written as ``transmit`` writes them (one entry per
        row whatever its sinks), ``workload.batch`` per transaction, by binary COPY."""
        src = psycopg2.connect(self.dsns[SOURCE_ID])
        client = RoutingQueueClient(src, CLIENT)
        bench = psycopg2.connect(env.source_dsn)
        copy_sql = "COPY lr.log_entries (stream, tag_ids, client_id, message) FROM STDIN (FORMAT binary)"
        tags = {}
        with src.cursor() as cur:
            cur.execute("SELECT site_id, tag_id FROM lr.remote_sites")
            tags = dict(cur.fetchall())
        head = pgcopy._I16.pack(4) + pgcopy._I32.pack(2) + pgcopy._I16.pack(STREAM_LOG_ENTRIES)
        client_field = pgcopy._I32.pack(4) + pgcopy._I32.pack(client.client_id)
        try:
            with bench.cursor(name="lr_bench_fill") as read:
                read.itersize = workload.batch
                read.execute(f"SELECT dests, payload FROM {BACKLOG_TABLE} ORDER BY id")
                block, rows = bytearray(pgcopy.HEADER), 0
                for dests, payload in read:
                    names = [SINK_IDS[i] for i in range(SINKS) if dests >> i & 1]
                    message = lr_pb2.RoutingTableEntryMsg(
                        destinations=names,
                        type=lr_pb2.LOG_ENTRY_SYNC,
                        opaque_payload=bytes(payload),
                        source_site_id=SOURCE_ID,
                        client_name=CLIENT,
                    ).SerializeToString()
                    block += head + _int_array([tags[n] for n in names]) + client_field
                    block += pgcopy._I32.pack(len(message)) + message
                    rows += 1
                    if rows % workload.batch == 0:
                        _copy_commit(src, copy_sql, block)
                        block = bytearray(pgcopy.HEADER)
                if len(block) > len(pgcopy.HEADER):
                    _copy_commit(src, copy_sql, block)
        finally:
            bench.close()
            src.close()
        execute(self.dsns[SOURCE_ID], "VACUUM (ANALYZE) lr.log_entries", "VACUUM (ANALYZE) lr.log_commits")

    def checkpoint(self) -> None:
        for dsn in self.dsns.values():
            execute(dsn, "CHECKPOINT")

    def verify(self, env: BenchEnv, name: str) -> list[int]:
        """Per-sink entry counts equal the bench's, rows follow source order, and a sample of rows
        holds, byte for byte, the payloads of the sink's entries that end at the row's last entry."""
        expected = [
            execute(env.source_dsn, f"SELECT count(*) FROM {BACKLOG_TABLE} WHERE dests & {1 << i} <> 0")[0][0]
            for i in range(SINKS)
        ]
        got, out_of_order = [], []
        for sink in SINK_IDS:
            ((count, disorder),) = execute(
                self.dsns[sink],
                """
                SELECT coalesce(sum(entry_count), 0), count(*) FILTER (WHERE prev >= (source_position, source_entry_id))
                FROM (SELECT entry_count, source_position, source_entry_id,
                             lag((source_position, source_entry_id)) OVER (ORDER BY seq) AS prev
                      FROM lr.receive_queue WHERE kind = 1) q""",
            )
            got.append(int(count))
            out_of_order.append(disorder)
        if got != expected or any(out_of_order):
            raise AssertionError(f"{name}: sinks hold {got} entries (expected {expected}), out of order {out_of_order}")
        tags = dict(execute(self.dsns[SOURCE_ID], "SELECT site_id, tag_id FROM lr.remote_sites"))
        for sink in SINK_IDS:
            for last_id, count, message in execute(
                self.dsns[sink],
                "SELECT source_entry_id, entry_count, message FROM lr.receive_queue WHERE kind = 1 AND seq % 211 = 1",
            ):
                sent = execute(
                    self.dsns[SOURCE_ID],
                    f"SELECT message FROM lr.log_entries WHERE entry_id <= {last_id} "
                    f"AND tag_ids @> ARRAY[{tags[sink]}] ORDER BY entry_id DESC LIMIT {count}",
                )
                want = [lr_pb2.RoutingTableEntryMsg.FromString(bytes(m)).opaque_payload for (m,) in reversed(sent)]
                have = [
                    lr_pb2.RoutingTableEntryMsg.FromString(e).opaque_payload
                    for e in queue_rows.unpack(count, bytes(message))
                ]
                if have != want:
                    raise AssertionError(f"{name}: the row ending at entry {last_id} differs on {sink}")
        return got

    def drop(self) -> None:
        for dsn, db in zip(self.admin, self.dbnames):
            execute(dsn, f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
        shutil.rmtree(self.dir, ignore_errors=True)  # the connections file and topology


def _int_array(values: list[int]) -> bytes:
    """An int4[] field in binary COPY form (1 dimension, no nulls)."""
    body = pgcopy._I32.pack(1) + pgcopy._I32.pack(0) + pgcopy._I32.pack(23)  # ndim, has-nulls, int4 oid
    body += pgcopy._I32.pack(len(values)) + pgcopy._I32.pack(1)  # length, lower bound
    body += b"".join(pgcopy._I32.pack(4) + pgcopy._I32.pack(v) for v in values)
    return pgcopy._I32.pack(len(body)) + body


def _copy_commit(conn: psycopg2.extensions.connection, copy_sql: str, block: bytearray) -> None:
    block += pgcopy.TRAILER
    with conn.cursor() as cur:
        cur.copy_expert(copy_sql, io.BytesIO(block), size=len(block))
    conn.commit()


def spark_submit(job: str, args: list[str], connections: Path, master: str = SPARK_MASTER) -> dict[str, Any]:
    """Run a job with spark-submit; its parsed ``LR_RESULT`` plus ``wall_s`` (Spark start included)."""
    import pyspark

    spark_home = Path(pyspark.__file__).resolve().parent
    env = {
        **os.environ,
        "SPARK_HOME": str(spark_home),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "LR_CONNECTIONS_FILE": str(connections),
        "PYTHONPATH": str(REPO),
    }
    cmd = [
        str(spark_home / "bin" / "spark-submit"),
        "--master",
        master,
        "--driver-memory",
        "1g",
        "--conf",
        "spark.ui.enabled=false",
        str(REPO / "spark_jobs" / job),
        *args,
    ]
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - started
    lines = [line for line in proc.stdout.splitlines() if line.startswith("LR_RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{job} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return {**json.loads(lines[-1][len("LR_RESULT ") :]), "wall_s": round(wall, 3)}


def spark_catchup(name: str, master: str, tasks: int):
    """A Spark fan-out measurement: ``spark_jobs/lr_fanout.py --tasks N`` on ``master``."""

    def measure(env: BenchEnv, workload: Workload) -> Measurement:
        sites = LrSites(env, f"lr_{workload.variant}")
        try:
            sites.fill_backlog(env, workload)
            sites.checkpoint()
            result = spark_submit(
                "lr_fanout.py",
                ["--source", SOURCE_ID, "--topology", str(sites.topology_file), "--tasks", str(tasks)],
                sites.connections,
                master,
            )
            got = sites.verify(env, name)
        finally:
            sites.drop()
        seconds = result["seconds"]["total"]
        delivered = result["total_deliveries"]
        if delivered != sum(got):
            raise AssertionError(f"{name} reported {delivered} deliveries, sinks hold {sum(got)}")
        mib = {k: round(v / 1024, 1) for k, v in result["peak_rss_kb"].items()}
        return Measurement(
            name,
            workload.variant,
            workload.entries,
            delivered,
            seconds,
            {
                "master": master,
                "tasks": tasks,
                "staged": tasks > 1,
                "partitions": result["partitions"],
                "phases_s": result["seconds"],
                "wall_with_spark_start_s": result["wall_s"],
                "spark_start_s": round(result["wall_s"] - seconds, 2),
                "deliveries_per_s_with_spark_start": round(delivered / result["wall_s"], 1),
                "peak_mib": mib,
            },
        )

    measure.__name__ = name
    return measure


# the ordered tee in one task; the staged fan-out with 2 chunks at once on 1 core, then on 2
lr_catchup = spark_catchup("lr_catchup", SPARK_MASTER, tasks=1)
lr_staged_1core = spark_catchup("lr_staged_1core", "local[1]", tasks=2)
lr_staged_2cores = spark_catchup("lr_staged_2cores", "local[2]", tasks=2)


def lr_inprocess(env: BenchEnv, workload: Workload) -> Measurement:
    return _replicate(env, workload, "lr_inprocess", tee_min_backlog=0)


def lr_sync(env: BenchEnv, workload: Workload) -> Measurement:
    return _replicate(env, workload, "lr_sync", tee_min_backlog=SessionSettings().tee_min_backlog)


def _replicate(env: BenchEnv, workload: Workload, name: str, tee_min_backlog: int) -> Measurement:
    """The backlog moved by ``Replicator.run`` until idle, as ``lr sync`` does it."""
    sites = LrSites(env, f"lr_{workload.variant}")
    previous = os.environ.get("LR_CONNECTIONS_FILE")
    os.environ["LR_CONNECTIONS_FILE"] = str(sites.connections)  # the tee resolves the sites' DSNs
    try:
        sites.fill_backlog(env, workload)
        sites.checkpoint()
        repl = sites.replicator(tee_min_backlog)
        try:
            started = time.perf_counter()
            repl.run(until_idle=True, interval=0.01)
            seconds = time.perf_counter() - started
            teed = sum(repl.teed.values())
        finally:
            repl.close()
        got = sites.verify(env, name)
    finally:
        _restore_env("LR_CONNECTIONS_FILE", previous)
        sites.drop()
    return Measurement(
        name,
        workload.variant,
        workload.entries,
        sum(got),
        seconds,
        {"batch_entries": SessionSettings().max_entries, "tee_min_backlog": tee_min_backlog, "by_tee": teed},
    )


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def lr_inprocess_tee(env: BenchEnv, workload: Workload) -> Measurement:
    from airflow_provider_lr.engine.bulk import fanout

    sites = LrSites(env, f"lr_{workload.variant}")
    previous = os.environ.get("LR_CONNECTIONS_FILE")
    os.environ["LR_CONNECTIONS_FILE"] = str(sites.connections)
    try:
        sites.fill_backlog(env, workload)
        sites.checkpoint()
        driver = fanout.FanoutDriver(sites.topology, SOURCE_ID)
        try:
            with cpu_window(env) as cpu:
                result = fanout.run_fanout(driver, fanout.local_map)
        finally:
            driver.close()
        got = sites.verify(env, "lr_inprocess_tee")
    finally:
        _restore_env("LR_CONNECTIONS_FILE", previous)
        sites.drop()
    delivered = sum(result.deliveries.values())
    if not result.ok or delivered != sum(got):
        raise AssertionError(f"lr_inprocess_tee: {result.errors or delivered} (sinks hold {sum(got)})")
    return Measurement(
        "lr_inprocess_tee",
        workload.variant,
        workload.entries,
        delivered,
        result.seconds["total"],
        {"chunks": result.partitions, "phases_s": result.seconds, "python_cpu_s": cpu["client"], "cpu_s": cpu},
    )  # python_cpu_s: this process, sender threads included


MEASUREMENTS = {
    "lr_catchup": lr_catchup,
    "lr_staged_1core": lr_staged_1core,
    "lr_staged_2cores": lr_staged_2cores,
    "lr_inprocess": lr_inprocess,
    "lr_inprocess_tee": lr_inprocess_tee,
    "lr_sync": lr_sync,
}
