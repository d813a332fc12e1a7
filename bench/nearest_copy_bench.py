"""Nearest-copy catch-up: a new sink's federated-table snapshot from the far
source vs from a consistent peer sink in its own region, over emulated links.

Servers: 4 embedded PostgreSQL servers (``fanout_anchors.start_env``); 3 are used: the source
(region ``far``), a peer sink and the new sink (region ``near``). The replicator runs where the
sinks are (an Airflow worker in their region): its connections to the source go through a
``LinkProxy`` (``tests/support/link_proxy.py``: user-space, since this kernel has no ``netem``)
with ``--delay`` seconds one way and ``--rate`` bytes/s per connection and direction; its
connections to the sinks are direct.

The table (``--rows``, ~210 bytes a row, as ``table_bench.py``) is federated at the source; the
peer syncs it (not timed), then ``--updates`` single-row changes happen at the source that the peer
has not applied (the peer is behind: the new sink must catch them up from the source). Each mode
then brings a fresh new sink from nothing to caught up (its session settled in log-entry sync,
rows equal to the source, checked by a hash of every row):

* ``source, direct``: the source's snapshot over a direct link (``nearest_copy`` off);
* ``source, far``: the source's snapshot over the far link (what every sink paid before);
* ``peer, far source``: seeded from the peer over the direct link, then the catch-up of the
  updates over the far link (``nearest_copy`` on, the default);

reporting seconds, bytes through the far link, and rows/s. ``--rates`` runs the far modes at
several rates. Run:
    .venv/bin/python bench/nearest_copy_bench.py [--rows 300000] [--updates 5000] [--delay 0.04]
        [--rates 12.5e6,62.5e6] [--rounds 1]
Writes bench/results/nearest_copy_bench.json and prints markdown.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psycopg2

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from fanout_anchors import execute, start_env, stop_env  # noqa: E402

from airflow_provider_lr.engine.db import schema
from airflow_provider_lr.engine.session.settings import SessionSettings  # noqa: E402
from airflow_provider_lr.engine.site import topology
from airflow_provider_lr.engine.site.replicator import Replicator  # noqa: E402
from airflow_provider_lr.engine.store import topology as topologies
from airflow_provider_lr.engine.tables import registry  # noqa: E402
from airflow_provider_lr.engine.vocabulary import SessionKey  # noqa: E402
from tests.support.link_proxy import LinkProxy  # noqa: E402

CLIENT = "bench"
SITES = ("src", "peer", "new")
TABLE = "public.accounts"
DDL = f"CREATE TABLE {TABLE} (id bigint PRIMARY KEY, grp int NOT NULL, created timestamptz NOT NULL, payload text)"


def _dsn(admin: str, db: str) -> str:
    parts = [p for p in admin.split() if not p.startswith("dbname=")]
    return " ".join(parts + [f"dbname={db}"])


def fresh_site(admin: str, db: str, site: str, topo: topologies.Topology) -> str:
    execute(admin, f"DROP DATABASE IF EXISTS {db} WITH (FORCE)", f"CREATE DATABASE {db}")
    dsn = _dsn(admin, db)
    conn = psycopg2.connect(dsn)
    schema.init_site(conn, site, topo.site(site).region)
    topology.apply_to_site(conn, topo, site)
    conn.close()
    return dsn


def table_hash(dsn: str) -> tuple[int, str]:
    return execute(dsn, f"SELECT count(*), md5(string_agg(t::text, ',' ORDER BY id)) FROM {TABLE} t")[0]


def sync(topo: topologies.Topology, connect, keys: list[SessionKey], nearest: bool) -> list:
    settings = SessionSettings(
        barrier_timeout=5.0,
        max_batches=1_000_000,
        lease_seconds=600,
        tee_min_backlog=0,
        nearest_copy=nearest,
        peer_probe_delay=2.0,
    )
    repl = Replicator(topo, connect, settings=settings, sessions=keys)
    try:
        return repl.run(max_cycles=20, until_idle=True, interval=0.01)
    finally:
        repl.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=300_000)
    parser.add_argument("--updates", type=int, default=5_000)
    parser.add_argument("--delay", type=float, default=0.04, help="one-way seconds of the far link")
    parser.add_argument("--rates", default="12.5e6,62.5e6", help="far link bytes/s, comma-separated")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]

    home = Path(tempfile.mkdtemp(prefix="lr-nearest-"))
    env = start_env(home)
    admins = {"src": env.source_dsn, "peer": env.sink_dsns[0], "new": env.sink_dsns[1]}
    doc = {
        "sites": [{"id": "src", "region": "far"}, {"id": "peer", "region": "near"}, {"id": "new", "region": "near"}],
        "replication": [{"source": "src", "sinks": ["peer", "new"], "clients": [CLIENT]}],
        "settings": {"lease_seconds": 600},
    }
    topo = topologies.from_document(doc)
    results: list[dict] = []
    try:
        dsns = {site: fresh_site(admins[site], f"nearest_{site}", site, topo) for site in SITES}
        execute(
            dsns["src"],
            DDL,
            f"INSERT INTO {TABLE} SELECT g, g % 100, now(), repeat(md5(g::text), 5) || "
            f"'xxxx' FROM generate_series(1, {args.rows}) g",
        )
        conn = psycopg2.connect(dsns["src"])
        registry.open_table(conn, TABLE, CLIENT)
        conn.close()
        direct = lambda site: psycopg2.connect(dsns[site])  # noqa: E731
        sync(topo, direct, [SessionKey("src", "peer", CLIENT)], nearest=False)
        execute(
            dsns["src"],
            *[f"UPDATE {TABLE} SET grp = grp + 1 WHERE id = {i * 7 % args.rows + 1}" for i in range(args.updates)],
        )
        expected = table_hash(dsns["src"])
        table_mb = execute(dsns["src"], f"SELECT pg_table_size('{TABLE}') / 1e6")[0][0]
        print(
            f"table: {args.rows} rows, {table_mb:.0f} MB at the source; peer behind by {args.updates} updates",
            flush=True,
        )

        def run(mode: str, rate: float | None) -> dict:
            dsns["new"] = fresh_site(admins["new"], "nearest_new", "new", topo)
            far = (
                LinkProxy(int(psycopg2.extensions.parse_dsn(dsns["src"])["port"]), delay=args.delay, rate=rate)
                if rate is not None
                else None
            )
            route = {**dsns, "src": far.dsn(dsns["src"]) if far else dsns["src"]}
            started = time.monotonic()
            reports = sync(
                topo,
                lambda site: psycopg2.connect(route[site]),
                [SessionKey("src", "new", CLIENT)],
                nearest=mode.startswith("peer"),
            )
            seconds = time.monotonic() - started
            far_bytes = far.bytes if far else None
            if far:
                far.close()
            errors = [r.error for r in reports if r.error]
            got = table_hash(dsns["new"])
            if errors or got != expected:
                raise RuntimeError(f"{mode}: {errors or 'rows differ from the source'}")
            reason = next((r.reason for r in reports if "peer" in r.reason), "")
            row = {
                "mode": mode,
                "rate_bytes_s": rate,
                "one_way_delay_s": args.delay if rate else 0,
                "seconds": round(seconds, 2),
                "rows_per_s": round(args.rows / seconds),
                "far_link_mb": round(far_bytes / 1e6, 1) if far_bytes is not None else None,
                "reason": reason,
            }
            print(
                f"  {mode:<18} rate {rate or 0:>10.3g} B/s  {seconds:7.2f}s  far link "
                f"{row['far_link_mb'] if far_bytes is not None else '-'} MB",
                flush=True,
            )
            return row

        for _ in range(args.rounds):
            results.append(run("source, direct", None))
            for rate in rates:
                results.append(run("source, far", rate))
                results.append(run("peer, far source", rate))
    finally:
        stop_env(env)
    out = {
        "machine": platform.platform(),
        "rows": args.rows,
        "updates": args.updates,
        "table_mb": float(table_mb),
        "one_way_delay_s": args.delay,
        "runs": results,
    }
    path = ROOT / "bench" / "results" / "nearest_copy_bench.json"
    path.write_text(json.dumps(out, indent=2))
    print("\n| mode | far link | seconds | rows/s | MB over the far link |\n|---|---|---|---|---|")
    for mode in sorted({(r["mode"], r["rate_bytes_s"] or 0) for r in results}, key=lambda m: (m[1], m[0])):
        same = [r for r in results if (r["mode"], r["rate_bytes_s"] or 0) == mode]
        secs = statistics.median(r["seconds"] for r in same)
        link = "direct" if not mode[1] else f"{mode[1] * 8 / 1e6:.0f} Mbit/s, RTT {2 * args.delay * 1000:.0f} ms"
        print(f"| {mode[0]} | {link} | {secs:.2f} | {args.rows / secs:,.0f} | {same[0]['far_link_mb'] or '-'} |")
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
