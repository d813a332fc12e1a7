"""Full-sync transfer (issue 20): the session step's in-process transfer vs the Spark job
(``spark_jobs/lr_snapshot_transfer.py``), to set ``SNAPSHOT_SPARK_MIN_ENTRIES``.

Servers: 2 embedded PostgreSQL servers of ``fanout_anchors.start_env`` (the source and one sink;
the other two idle). Per size (``--sizes``, entries of ``--payload`` bytes): a fresh pair of
databases, a full-sync request supplied by a provider that transmits the entries in one
transaction, then the request moved to the sink and applied, timed from the supplied request to the
applied snapshot:

* ``in-process``: ``SessionRunner.snapshot_step()`` (what ``lr sync`` and the DAG's step run:
  chunks of ``SNAPSHOT_CHUNK`` messages read from the source and written to the sink);
* ``spark local[N]``: ``lr_snapshot_transfer.transfer`` on a SparkSession made here (its start is
  timed apart, the run excludes it): entry-id ranges staged in parallel tasks, then one
  server-side move into the receive queue;

checked each time: the sink's snapshot rows count equals the entries. Then straight lines
t = a + b·entries fitted to each, and the break-even where in-process = Spark start + Spark run.
Run: .venv/bin/python bench/snapshot_transfer_bench.py [--sizes 100000,300000,1000000] [--payload 256]
     [--master local[2] | local[1] | standalone:2 (a Master and 2 Workers of 1 core, started here)]
Writes bench/results/snapshot_transfer_bench.json and prints markdown.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import psycopg2

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "spark_jobs")]

from fanout_anchors import execute, start_env, stop_env  # noqa: E402

from airflow_provider_lr.engine.db import schema
from airflow_provider_lr.engine.session.lease import new_owner_id  # noqa: E402
from airflow_provider_lr.engine.session.runner import SessionRunner  # noqa: E402
from airflow_provider_lr.engine.session.settings import SessionSettings  # noqa: E402
from airflow_provider_lr.engine.site import topology
from airflow_provider_lr.engine.source import full_sync  # noqa: E402
from airflow_provider_lr.engine.source.transmit import RoutingQueueClient  # noqa: E402
from airflow_provider_lr.engine.store import topology as topologies
from airflow_provider_lr.engine.vocabulary import SessionKey  # noqa: E402

CLIENT = "bench"
KEY = SessionKey("src", "dst", CLIENT)


def _dsn(admin: str, db: str) -> str:
    return " ".join([p for p in admin.split() if not p.startswith("dbname=")] + [f"dbname={db}"])


def prepare(admins: dict[str, str], entries: int, payload: int) -> tuple[topologies.Topology, dict[str, str], str]:
    """Fresh databases, the topology applied, and a supplied full-sync request of ``entries``."""
    doc = {
        "sites": [{"id": "src"}, {"id": "dst"}],
        "replication": [{"source": "src", "sinks": ["dst"], "clients": [CLIENT]}],
        "settings": {"lease_seconds": 600},
    }
    topo = topologies.from_document(doc)
    dsns = {}
    for site, admin in admins.items():
        execute(admin, "DROP DATABASE IF EXISTS transfer_bench WITH (FORCE)", "CREATE DATABASE transfer_bench")
        dsns[site] = _dsn(admin, "transfer_bench")
        conn = psycopg2.connect(dsns[site])
        schema.init_site(conn, site)
        topology.apply_to_site(conn, topo, site)
        conn.close()
    body = os.urandom(payload)

    def provider(ctx) -> None:
        for _ in range(entries):
            ctx.transmit(body)

    conn = psycopg2.connect(dsns["src"])
    request = full_sync.request_full_sync(conn, "dst", CLIENT, reason="bench")
    RoutingQueueClient(conn, CLIENT).serve_full_sync_requests(provider)
    conn.close()
    return topo, dsns, request.request_id


def snapshot_rows(dsn: str) -> int:
    return execute(dsn, "SELECT coalesce(sum(entry_count), 0) FROM lr.receive_queue WHERE kind = 2")[0][0]


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(sum((x - mx) ** 2 for x in xs), 1e-9)
    return my - b * mx, b


def components(dsns: dict[str, str], request_id: str) -> dict[str, float]:
    """Per-entry costs (µs) of a staging task's parts, each alone, on the request just transferred:
    the source's ``COPY`` out parsed by ``RowReader`` (wall, and this process's CPU: the rest is the
    source server), destination stripping and packing in Python (CPU), and the sink's ``COPY`` in of
    the packed staging rows (wall)."""
    from airflow_provider_lr.engine import vocabulary
    from airflow_provider_lr.engine.bulk.pgcopy import RowReader, StagingWriter, staging_prefix, staging_row
    from airflow_provider_lr.engine.sink.queue_rows import Packer
    from airflow_provider_lr.engine.vocabulary import STREAM_SNAP_SYNC

    src = psycopg2.connect(dsns["src"])
    with src.cursor() as cur:
        cur.execute("SELECT supplied_tx FROM lr.full_sync_requests WHERE request_id = %s", (request_id,))
        (tx,) = cur.fetchone()
        rows: list[list] = []
        wall, cpu = time.monotonic(), time.process_time()
        cur.copy_expert(
            cur.mogrify(
                "COPY (SELECT c.position, e.entry_id, e.message FROM lr.log_entries e "
                "JOIN lr.log_commits c ON c.tx = e.tx WHERE e.tx = %s::xid8 AND e.stream = %s "
                "ORDER BY e.entry_id) TO STDOUT (FORMAT binary)",
                (tx, STREAM_SNAP_SYNC),
            ).decode(),
            RowReader(rows.append),
        )
        read_wall, read_cpu = time.monotonic() - wall, time.process_time() - cpu
    src.close()
    n = len(rows)
    staged: list[bytes] = []
    prefix = staging_prefix("src", CLIENT, request_id)
    packer = Packer(
        lambda r: staged.append(staging_row(prefix, r.position, r.entry_id, r.kind, r.entry_count, r.message))
    )
    cpu = time.process_time()
    for position, entry_id, message in rows:
        kind, body = vocabulary.strip_destinations(message or b"")
        packer.add(
            kind,
            int.from_bytes(position or b"", "big", signed=True),
            int.from_bytes(entry_id or b"", "big", signed=True),
            body,
        )
    packer.flush()
    pack_cpu = time.process_time() - cpu
    dst = psycopg2.connect(dsns["dst"])
    with dst.cursor() as cur:
        cur.execute("DELETE FROM lr.spark_staging")
    writer = StagingWriter(dst)
    wall = time.monotonic()
    for row in staged:
        writer.add(row)
    writer.close()
    dst.commit()
    ingest_wall = time.monotonic() - wall
    with dst.cursor() as cur:
        cur.execute("DELETE FROM lr.spark_staging")
    dst.commit()
    dst.close()
    us = 1e6 / n
    return {
        "entries": n,
        "staged_rows": len(staged),
        "source_read_wall_us": round(read_wall * us, 3),
        "source_read_client_cpu_us": round(read_cpu * us, 3),
        "source_read_server_us": round((read_wall - read_cpu) * us, 3),
        "strip_and_pack_cpu_us": round(pack_cpu * us, 3),
        "sink_ingest_wall_us": round(ingest_wall * us, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="100000,300000,1000000")
    parser.add_argument("--payload", type=int, default=256)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--out", default="snapshot_transfer_bench.json", help="file name under bench/results")
    parser.add_argument(
        "--components",
        action="store_true",
        help="also time a staging task's parts alone at the largest size (for the model)",
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    env = start_env(Path(tempfile.mkdtemp(prefix="lr-transfer-")))
    admins = {"src": env.source_dsn, "dst": env.sink_dsns[0]}
    runs: list[dict] = []
    stack = contextlib.ExitStack()
    try:
        import lr_snapshot_transfer
        from pyspark.sql import SparkSession

        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # executors import the engine too
        t0 = time.monotonic()
        if args.master.startswith("standalone:"):  # N workers of 1 core, started here (tests' helper)
            from tests.support.spark_env import cluster_spark_session, standalone_cluster

            workers = int(args.master.split(":")[1])
            cluster = stack.enter_context(
                standalone_cluster(Path(tempfile.mkdtemp(prefix="lr-spark-")), workers=workers)
            )
            spark = cluster_spark_session(cluster.url, "lr-transfer-bench", **{"spark.cores.max": str(workers)})
        else:
            spark = (
                SparkSession.builder.master(args.master)
                .appName("lr-transfer-bench")
                .config("spark.ui.enabled", "false")
                .getOrCreate()
            )
        spark.sparkContext.parallelize(range(4), 4).collect()
        spark_start = time.monotonic() - t0
        print(f"Spark {args.master} start (with a first task): {spark_start:.1f}s", flush=True)
        for entries in sizes:
            for method in ("in-process", f"spark {args.master}"):
                topo, dsns, request_id = prepare(admins, entries, args.payload)
                started, phases = time.monotonic(), {}
                if method == "in-process":
                    src, dst = psycopg2.connect(dsns["src"]), psycopg2.connect(dsns["dst"])
                    runner = SessionRunner(KEY, src, dst, new_owner_id(), SessionSettings(lease_seconds=600))
                    report = runner.snapshot_step()
                    runner.release()
                    src.close()
                    dst.close()
                    if report.error:
                        raise RuntimeError(report.error)
                else:
                    os.environ["AIRFLOW_CONN_SRC"] = json.dumps(_conn(dsns["src"], "src"))
                    os.environ["AIRFLOW_CONN_DST"] = json.dumps(_conn(dsns["dst"], "dst"))
                    result = lr_snapshot_transfer.transfer(spark, topo, KEY, request_id)
                    if not result.applied:
                        raise RuntimeError(f"not applied: {result}")
                    phases = result.seconds
                seconds = time.monotonic() - started
                got = snapshot_rows(dsns["dst"])
                if got != entries:
                    raise RuntimeError(f"{method}: {got} snapshot entries at the sink, not {entries}")
                if args.components and entries == max(sizes) and method != "in-process":
                    parts = components(dsns, request_id)
                    print(f"  components: {parts}", flush=True)
                    runs.append({"method": "components", **parts})
                runs.append(
                    {
                        "method": method,
                        "entries": entries,
                        "seconds": round(seconds, 3),
                        "entries_per_s": round(entries / seconds),
                        "phases_s": phases,
                    }
                )
                print(
                    f"  {method:<16} {entries:>9} entries  {seconds:7.2f}s  {entries / seconds:>10,.0f}/s "
                    f"{phases or ''}",
                    flush=True,
                )
        spark.stop()
    finally:
        stack.close()
        stop_env(env)
    lines = {}
    for method in sorted({r["method"] for r in runs} - {"components"}):
        mine = [r for r in runs if r["method"] == method]
        lines[method] = fit([r["entries"] for r in mine], [r["seconds"] for r in mine])
    (a_in, b_in), (a_sp, b_sp) = lines["in-process"], lines[f"spark {args.master}"]
    slope = b_in - b_sp
    even = (a_sp + spark_start - a_in) / slope if slope > 0 else None
    out = {
        "machine": platform.platform(),
        "cores": os.cpu_count(),
        "payload": args.payload,
        "master": args.master,
        "spark_start_s": round(spark_start, 2),
        "runs": runs,
        "fits": {m: {"a_s": round(a, 3), "us_per_entry": round(b * 1e6, 3)} for m, (a, b) in lines.items()},
        "break_even_entries": round(even) if even else None,
    }
    path = ROOT / "bench" / "results" / args.out
    path.write_text(json.dumps(out, indent=2))
    print(
        "\n| entries | in-process s | Spark run s (start excluded) | in-process /s | Spark /s |\n|---|---|---|---|---|"
    )
    for entries in sizes:
        i = next(r for r in runs if r["entries"] == entries and r["method"] == "in-process")
        s = next(r for r in runs if r["entries"] == entries and r["method"] not in ("in-process", "components"))
        print(
            f"| {entries:,} | {i['seconds']:.2f} | {s['seconds']:.2f} | {i['entries_per_s']:,} | {s['entries_per_s']:,} |"
        )
    print(
        f"\nfits: {out['fits']}; Spark start {spark_start:.1f}s; break-even (cold Spark): "
        f"{out['break_even_entries'] or 'none: Spark is not faster per entry'} entries\nwritten to {path}"
    )


def _conn(dsn: str, site: str) -> dict:
    p = psycopg2.extensions.parse_dsn(dsn)
    return {
        "conn_type": "lr_site",
        "host": p.get("host"),
        "port": int(p.get("port", 5432)),
        "login": p.get("user"),
        "password": p.get("password"),
        "schema": p["dbname"],
        "extra": {"site_id": site},
    }


if __name__ == "__main__":
    main()
