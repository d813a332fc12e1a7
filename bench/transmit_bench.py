"""Writer overhead of `transmit` and log bytes per entry (issue 3's benchmark).

1. Throughput of an application transaction that inserts one row, with and without one
   `transmit_log_entry_message` of 256 random bytes to 3 destinations, 8 concurrent writer
   processes, PostgreSQL's default durability (fsync and synchronous_commit on). Beside it: the
   same transaction with one extra trivial statement (`SELECT 1`), the floor any transmit that is
   its own statement pays in round trips, and a 10-row transaction with and without one
   `transmit_log_entry_messages` call of 10 messages. Variants alternate within each round so
   drift hits all; medians are reported with ratios.
   Beside them, ``insert_only``: the same transaction plus the same log row, its statement built as
   transmit builds it, inserted (prepared) into a copy of ``lr.log_entries`` without the
   commit-position trigger: what storing an entry with a statement of its own costs before any
   ordering, so the ratio of transmit to it is lr's own share. Every variant also reports the
   writers' CPU per transaction (client processes and their server backends, from ``/proc``).
   Beside them, ``writer_plain`` and ``writer_transmit``: the same two transactions run as a
   least-privilege writer role of the client (docs/security.md: row-level security checks the
   entry's client, the commit position is drawn by the owner's SECURITY DEFINER trigger) instead
   of the schema owner, which row-level security does not apply to.
   Beside them, the wake-up of a streaming replicator (issue 19), two ways: ``transmit_notify``,
   the same transaction plus a ``pg_notify`` (what a commit trigger waking the replicator by
   LISTEN/NOTIFY would add to every application transaction), and ``transmit_probed``, the plain
   transmit while another process probes the commit-position sequence every ``PROBE_EVERY`` s (what
   ``engine/session/stream.SourceWatch`` does while a stream waits).
2. Log bytes per entry (heap + indexes of lr.log_entries, plus lr.log_commits per transaction) as
   the number of destinations goes 1 → 3 → 10, beside the size of the tag list it adds.

Run: .venv/bin/python bench/transmit_bench.py [--seconds 6] [--rounds 3] [--writers 8]
     [--schema-version N]  (install migrations only up to N, e.g. 5 for the owner before roles)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psycopg2  # noqa: E402

from airflow_provider_lr.client import LRMessageWithDestinations, RoutingQueueClient  # noqa: E402
from airflow_provider_lr.embedded.sites import SiteManager  # noqa: E402
from airflow_provider_lr.engine.db import schema
from airflow_provider_lr.engine.site import roles, topology
from airflow_provider_lr.engine.source import log_writer  # noqa: E402
from airflow_provider_lr.engine.source.commit_barrier import LAST_DRAWN_POSITION_SQL  # noqa: E402
from airflow_provider_lr.engine.store import topology as topologies
from airflow_provider_lr.engine.vocabulary import STREAM_LOG_ENTRIES
from airflow_provider_lr.proto import lr_pb2

REMOTES = [f"sink-{i:02d}" for i in range(1, 11)]


VARIANTS = (
    "plain",
    "floor",
    "insert_only",
    "transmit",
    "transmit_unprepared",
    "plain10",
    "transmit10",
    "transmit_notify",
    "transmit_probed",
)
PROBE_EVERY = 0.0002  # StreamSettings.poll_min: the probe's pace while commits keep coming
ROLE_VARIANTS = ("writer_plain", "writer_transmit")  # as the writer role (schema version >= 6)
WRITER_ROLE = "lr_bench_writer"


def backend_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a server backend has used: /proc, as the server runs on this machine."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def writer(dsn: str, variant: str, seconds: float, start_at: float, out: mp.Queue) -> None:
    if variant.startswith("writer_"):  # the same transaction, as the client's writer role
        dsn, variant = psycopg2.extensions.make_dsn(dsn, user=WRITER_ROLE), variant.removeprefix("writer_")
    conn = psycopg2.connect(dsn)
    client = RoutingQueueClient(conn, "bench", prepared=variant != "transmit_unprepared")
    dests = REMOTES[:3]
    rows = 10 if variant.endswith("10") else 1
    if variant == "insert_only":
        with conn.cursor() as cur:
            cur.execute(
                "PREPARE bench_insert_only (smallint, integer[], integer, bytea) AS "
                "INSERT INTO bench_plain_log (stream, tag_ids, client_id, message) VALUES ($1, $2, $3, $4)"
            )
    done = 0
    while time.time() < start_at:
        time.sleep(0.001)
    deadline = start_at + seconds
    client_cpu, server_cpu = time.process_time(), backend_cpu_s(conn.get_backend_pid())
    with conn.cursor() as cur:
        while time.time() < deadline:
            if rows == 1:
                cur.execute("INSERT INTO app_rows (v) VALUES (%s)", (done,))
            else:
                cur.execute("INSERT INTO app_rows (v) SELECT %s FROM generate_series(1, 10)", (done,))
            if variant == "floor":
                cur.execute("SELECT 1")
            elif variant == "insert_only":  # the same row, built as transmit builds it, with no commit position
                row = client._row(STREAM_LOG_ENTRIES, os.urandom(256), dests, lr_pb2.LOG_ENTRY_SYNC)
                cur.execute("EXECUTE bench_insert_only " + log_writer.values_row(*row, client.client_id))
            elif variant in ("transmit", "transmit_unprepared", "transmit_probed"):
                client.transmit_log_entry_message(os.urandom(256), dests)
            elif variant == "transmit_notify":
                client.transmit_log_entry_message(os.urandom(256), dests)
                cur.execute("SELECT pg_notify('lr_commit', '')")
            elif variant == "transmit10":
                client.transmit_log_entry_messages(
                    [LRMessageWithDestinations(os.urandom(256), dests) for _ in range(10)]
                )
            conn.commit()
            done += 1
    client_cpu, server_cpu = time.process_time() - client_cpu, backend_cpu_s(conn.get_backend_pid()) - server_cpu
    conn.close()
    out.put((done, client_cpu, server_cpu))


def prober(dsn: str, seconds: float, start_at: float, out: mp.Queue) -> None:
    """The streaming replicator's wake-up probe, at its fastest pace, for the whole measurement."""
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    probes = 0
    while time.time() < start_at:
        time.sleep(0.001)
    with conn.cursor() as cur:
        while time.time() < start_at + seconds:
            cur.execute(LAST_DRAWN_POSITION_SQL)
            cur.fetchone()
            probes += 1
            time.sleep(PROBE_EVERY)
    conn.close()
    out.put(probes)


def throughput(dsn: str, variant: str, writers: int, seconds: float) -> tuple[float, float, float]:
    """Transactions per second, and the writers' CPU per transaction (µs, client processes and their
    server backends): other work on the machine moves it less than the rate, though contention inflates it too."""
    out: mp.Queue = mp.Queue()
    probes: mp.Queue = mp.Queue()
    start_at = time.time() + 1.0
    procs = [mp.Process(target=writer, args=(dsn, variant, seconds, start_at, out)) for _ in range(writers)]
    if variant == "transmit_probed":
        procs.append(mp.Process(target=prober, args=(dsn, seconds, start_at, probes)))
    for p in procs:
        p.start()
    counts = [out.get() for _ in range(writers)]
    for p in procs:
        p.join()
    total = sum(done for done, _, _ in counts)
    per_tx = 1e6 / max(total, 1)
    return total / seconds, sum(c for _, c, _ in counts) * per_tx, sum(s for _, _, s in counts) * per_tx


def bytes_per_entry(dsn: str, destinations: int, entries: int = 20_000) -> dict:
    conn = psycopg2.connect(dsn)
    with conn.cursor() as cur:
        cur.execute("TRUNCATE lr.log_entries, lr.log_commits")
    conn.commit()
    client = RoutingQueueClient(conn, "bench")
    payload = os.urandom(256)
    for i in range(entries):
        client.transmit_log_entry_message(payload, REMOTES[:destinations])
        if i % 10 == 9:  # 10 entries per transaction, as a busy application would batch
            conn.commit()
    conn.commit()
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("VACUUM ANALYZE lr.log_entries")
        cur.execute(
            "SELECT pg_total_relation_size('lr.log_entries'), pg_total_relation_size('lr.log_commits'), "
            "avg(pg_column_size(e.*)) FROM lr.log_entries e"
        )
        entries_total, commits_total, avg_row = cur.fetchone()
    conn.close()
    tag_text = sum(len(f"lrq_logentry_{d}") for d in REMOTES[:destinations])
    return {
        "destinations": destinations,
        "row_bytes": round(float(avg_row), 1),
        "stored_bytes_per_entry": round((entries_total + commits_total) / entries, 1),
        "tag_text_bytes": tag_text,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument("--only", default=None, help="comma-separated variants (default: all)")
    parser.add_argument(
        "--schema-version", type=int, default=None, help="install migrations only up to this version (default: all)"
    )
    args = parser.parse_args()
    variants = VARIANTS

    home = Path(tempfile.mkdtemp(prefix="lr-bench-"))
    manager = SiteManager(home, settings={"max_connections": "100"})
    (site,) = manager.up(site_ids=["bench-src"])
    try:
        dsn = site.dsn()
        conn = psycopg2.connect(dsn)
        if args.schema_version is not None:  # an older release's schema (init_site would upgrade it)
            schema.migrate(conn, target=args.schema_version)
            with conn.cursor() as cur:
                cur.execute("INSERT INTO lr.site_info (site_id) VALUES (%s)", (site.site_id,))
            conn.commit()
        else:
            schema.init_site(conn, site.site_id)
        topo = topologies.from_document(
            {
                "sites": [{"id": site.site_id}] + [{"id": r} for r in REMOTES],
                "replication": [{"source": site.site_id, "sinks": REMOTES, "clients": ["bench"]}],
            }
        )
        topology.apply_to_site(conn, topo, site.site_id)
        with conn.cursor() as cur:
            cur.execute("CREATE TABLE app_rows (id bigserial PRIMARY KEY, v bigint, at timestamptz DEFAULT now())")
            # lr.log_entries' shape and primary key, without the commit-position trigger
            cur.execute("CREATE TABLE bench_plain_log (LIKE lr.log_entries INCLUDING DEFAULTS INCLUDING INDEXES)")
        conn.commit()
        if schema.current_version(conn) >= roles.ROLES_SCHEMA_VERSION:
            roles.grant(conn, "writer", WRITER_ROLE, ["bench"], create=True)
            with conn.cursor() as cur:  # the application's own table, granted by the application
                cur.execute(f"GRANT INSERT ON app_rows TO {WRITER_ROLE}")
                cur.execute(f"GRANT USAGE ON SEQUENCE app_rows_id_seq TO {WRITER_ROLE}")
            conn.commit()
            variants = VARIANTS + ROLE_VARIANTS
        conn.close()
        if args.only:
            variants = tuple(v for v in variants if v in args.only.split(","))

        tps: dict[str, list[float]] = {v: [] for v in variants}
        cpu: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}  # µs per tx: client, server
        for r in range(args.rounds):
            for variant in variants:
                rate, client_us, server_us = throughput(dsn, variant, args.writers, args.seconds)
                tps[variant].append(rate)
                cpu[variant].append((client_us, server_us))
            print(f"round {r + 1}: " + ", ".join(f"{v} {tps[v][-1]:,.0f}" for v in variants) + " tx/s", flush=True)
        sizes = [bytes_per_entry(dsn, n) for n in (1, 3, 10)]
    finally:
        manager.down(remove=True)

    med = {v: statistics.median(tps[v]) for v in variants}
    cpu_med = {
        v: {
            side: round(statistics.median(c[i] for c in cpu[v]), 1) for i, side in enumerate(("client_us", "server_us"))
        }
        for v in variants
    }
    print(f"\nwriters' CPU per transaction, µs (medians of {args.rounds} rounds):")
    for v in variants:
        c = cpu_med[v]
        print(f"  {v:<20} client {c['client_us']:>6.1f}  server {c['server_us']:>6.1f}  total {sum(c.values()):>6.1f}")
    if "transmit" in med and {"transmit_notify", "transmit_probed"} & set(med):
        print(f"\nwake-up of a streaming replicator, {args.writers} writers (medians of {args.rounds} rounds):")
        for v in ("transmit_notify", "transmit_probed"):
            if v in med:
                print(f"  {v:<16} {med[v]:>8,.0f} tx/s  ratio to transmit {med[v] / med['transmit']:.2f}")
    if args.only:
        (Path(__file__).resolve().parent / "results").mkdir(exist_ok=True)
        (Path(__file__).resolve().parent / "results" / "transmit_bench_only.json").write_text(
            json.dumps({"writers": args.writers, "tps": tps, "medians": med, "cpu_us_per_tx": cpu_med}, indent=2)
        )
        return
    ratio, ratio10, floor = (
        med["transmit"] / med["plain"],
        med["transmit10"] / med["plain10"],
        med["floor"] / med["plain"],
    )
    print(
        f"\nwriter throughput, {args.writers} writer processes, medians of {args.rounds} rounds of {args.seconds:.0f} s:"
    )
    print(f"  1 row:                         {med['plain']:>8,.0f} tx/s")
    print(f"  1 row + SELECT 1 (floor):      {med['floor']:>8,.0f} tx/s  ratio {floor:.2f}")
    print(
        f"  1 row + the same log row, no commit position: {med['insert_only']:>8,.0f} tx/s  "
        f"ratio {med['insert_only'] / med['plain']:.2f} (the floor of any design that stores the entry)"
    )
    print(
        f"  1 row + transmit (3 dests):    {med['transmit']:>8,.0f} tx/s  ratio {ratio:.2f}  (aim >= 0.67; "
        f"{med['transmit'] / med['insert_only']:.2f} of that floor)"
    )
    print(
        f"    same, insert not prepared:   {med['transmit_unprepared']:>8,.0f} tx/s  "
        f"ratio {med['transmit_unprepared'] / med['plain']:.2f}"
    )
    print(f"  10 rows:                       {med['plain10']:>8,.0f} tx/s")
    print(f"  10 rows + 10 messages, 1 call: {med['transmit10']:>8,.0f} tx/s  ratio {ratio10:.2f}")
    if "writer_transmit" in med:
        print(
            f"  as the writer role: 1 row {med['writer_plain']:>8,.0f} tx/s, + transmit {med['writer_transmit']:>8,.0f} "
            f"tx/s  ratio {med['writer_transmit'] / med['writer_plain']:.2f}; writer/owner transmit "
            f"{med['writer_transmit'] / med['transmit']:.2f}"
        )
    print("\nlog bytes per entry (256 B payload):")
    print(f"  {'dests':>5} {'row':>7} {'stored':>8} {'tag text':>9}")
    for s in sizes:
        print(f"  {s['destinations']:>5} {s['row_bytes']:>7} {s['stored_bytes_per_entry']:>8} {s['tag_text_bytes']:>9}")
    growth = sizes[-1]["stored_bytes_per_entry"] - sizes[0]["stored_bytes_per_entry"]
    tag_growth = sizes[-1]["tag_text_bytes"] - sizes[0]["tag_text_bytes"]
    print(f"  1 → 10 destinations: stored bytes grow by {growth:.1f}; the tag list text grows by {tag_growth}")
    results = {
        "writers": args.writers,
        "seconds": args.seconds,
        "tps": tps,
        "medians": med,
        "cpu_us_per_tx": cpu_med,
        "ratio": ratio,
        "ratio_floor": floor,
        "ratio_10": ratio10,
        "bytes_per_entry": sizes,
        "growth_1_to_10": growth,
        "tag_text_growth_1_to_10": tag_growth,
        "schema_version": args.schema_version,
    }
    out = Path(__file__).resolve().parent / "results"
    out.mkdir(exist_ok=True)
    suffix = f"_v{args.schema_version}" if args.schema_version is not None else ""
    (out / f"transmit_bench{suffix}.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
