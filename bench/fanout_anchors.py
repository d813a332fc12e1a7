"""Anchors for the fan-out benchmark (docs/spark.md): what lr's deliveries/s are compared against.

Workload: N entries of 256 random bytes on a source server, each for all 3 sinks (variant "all")
or for a random non-empty subset of them (variant "subset"); the sinks are 3 other servers.
A *delivery* is one entry arriving at one sink, so deliveries = Σ over entries of sinks addressed.

Anchors, each a function ``(BenchEnv, Workload) -> Measurement`` in ``ANCHORS``:

* ``physical_copy``    binary ``COPY TO STDOUT`` from the source streamed into binary
                       ``COPY FROM STDIN`` on each sink, one process per sink in parallel.
* ``physical_tee``     the physical limit: the source read once by one binary COPY, its rows
                       routed (by the ``dests`` bit, payload untouched) into the 3 sinks' COPYs,
                       which the sink servers ingest concurrently. On 2 cores this beats
                       ``physical_copy`` (3 source scans), by ~1.8× for "all".
* ``physical_tee_packed`` the same with lr's row shape: the source forms packs of 28 entries
                       in SQL (one output row per pack and sink mask), routed into the sinks.
* ``naive_python``     a hand-written replicator: read ``id > last`` batches with psycopg2, insert
                       each sink's rows with ``execute_values``, one sink after the other.
* ``native_initial``   PostgreSQL logical replication, initial table sync: a publication per sink
                       (row filter on the destination bit for "subset"), a subscription on each
                       sink, timed until every table is ready (``srsubstate = 'r'``).
* ``native_initial_binary`` the same with the subscription option ``binary = true`` (native's
                       fastest initial sync: lr's catch-up is compared with this one).
* ``native_streaming`` logical replication steady state: subscriptions in place on an empty
                       table, then concurrent writers commit N rows in 1000-row transactions;
                       timed from the writers' start until every sink has applied the last commit.

The backlog anchors (copy, naive, initial sync) all read the same source table ``fanout_entries``
filled by ``prepare_source``; the streaming anchor uses its own table ``fanout_stream``. Sink
tables are ``(id bigint PRIMARY KEY, payload bytea)`` for every anchor, and every anchor checks
each sink's row count, and a sample of rows byte for byte, against the source before it reports.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import random
import resource
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import psycopg2
import psycopg2.extras
from psycopg.abc import Buffer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from airflow_provider_lr.embedded.sites import SiteManager  # noqa: E402

SINKS = 3
PAYLOAD_BYTES = 256
BACKLOG_TABLE = "fanout_entries"
STREAM_TABLE = "fanout_stream"
BENCH_DB = "fanout_bench"
ALL_SINKS_MASK = (1 << SINKS) - 1
# --fast trades durability for speed; without it the servers run with PostgreSQL's defaults.
FAST_SETTINGS = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}
POLL_S = 0.05


@dataclass(frozen=True)
class Workload:
    entries: int
    variant: str  # "all": every entry to every sink; "subset": a random non-empty subset of sinks
    seed: int = 42
    writers: int = 4  # concurrent writers of the streaming anchors
    batch: int = 1000  # rows per writer transaction / per replicator read

    def dests(self, rng: random.Random) -> int:
        """Destination bit mask of one entry (bit i = sink i)."""
        return ALL_SINKS_MASK if self.variant == "all" else rng.randint(1, ALL_SINKS_MASK)


@dataclass
class BenchEnv:
    """One source and three sink databases, each on its own server."""

    source_dsn: str
    sink_dsns: list[str]
    manager: SiteManager | None = None


@dataclass
class Measurement:
    name: str
    variant: str
    entries: int
    deliveries: int
    seconds: float
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def per_second(self) -> float:
        return self.deliveries / self.seconds if self.seconds > 0 else float("nan")

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "deliveries_per_s": round(self.per_second, 1)}


Anchor = Callable[[BenchEnv, Workload], Measurement]


# --- sites and plumbing -------------------------------------------------------------------------
def start_env(home: Path, fast: bool = False) -> BenchEnv:
    """Start 4 embedded servers (source + 3 sinks) under ``home`` and create the bench database on each."""
    manager = SiteManager(home, settings=FAST_SETTINGS if fast else None)
    servers = manager.up(count=SINKS + 1)
    for server in servers:
        execute(server.dsn(), f"CREATE DATABASE {BENCH_DB}")
    return BenchEnv(servers[0].dsn(BENCH_DB), [s.dsn(BENCH_DB) for s in servers[1:]], manager)


def stop_env(env: BenchEnv, remove: bool = True) -> None:
    """Drop subscriptions first (each owns a slot on the source), then stop the servers."""
    try:
        drop_replication(env)
    finally:
        if env.manager is not None:
            env.manager.down(mode="fast", remove=remove)


def execute(dsn: str, *statements: str) -> list[tuple]:
    """Run statements in autocommit (CREATE DATABASE/SUBSCRIPTION refuse transaction blocks); last result."""
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    rows: list[tuple] = []
    try:
        with conn.cursor() as cur:
            for statement in statements:
                cur.execute(statement)
                rows = cur.fetchall() if cur.description else []
    finally:
        conn.close()
    return rows


def _proc_stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def server_cpu_s(dsn: str) -> float:
    """CPU seconds one server has used so far, whoever on it spent them: its postmaster with the
    processes it reaped (cutime, cstime) and every live process it started (Linux /proc)."""
    conn = psycopg2.connect(dsn)
    try:
        postmaster = int(_proc_stat(conn.get_backend_pid())[1])
    finally:
        conn.close()
    ticks = sum(int(f) for f in _proc_stat(postmaster)[11:15])
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                fields = _proc_stat(int(entry.name))
            except (OSError, IndexError):
                continue  # ended meanwhile
            if int(fields[1]) == postmaster:
                ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def cpu_now(env: BenchEnv) -> dict[str, float]:
    """CPU seconds so far of the source server, the sink servers (summed) and this process with the
    children it waited for (a measurement's client side: the tee, the replicator)."""
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return {
        "source": server_cpu_s(env.source_dsn),
        "sinks": sum(server_cpu_s(dsn) for dsn in env.sink_dsns),
        "client": sum(u.ru_utime + u.ru_stime for u in usage),
    }


@contextlib.contextmanager
def cpu_window(env: BenchEnv) -> Iterator[dict[str, float]]:
    """The CPU seconds by role (``cpu_now``) spent inside the block, the timed part of a
    measurement: where its time goes, and the core-µs per delivery the model is fitted to."""
    spent: dict[str, float] = {}
    before = cpu_now(env)
    yield spent
    after = cpu_now(env)
    spent.update({role: round(after[role] - before[role], 2) for role in after})


def checkpoint_all(env: BenchEnv) -> None:
    """Flush dirty buffers before a timed run so one anchor's writes don't bill the next."""
    for dsn in (env.source_dsn, *env.sink_dsns):
        execute(dsn, "CHECKPOINT")


def settle(env: BenchEnv, timeout: float = 180.0) -> float:
    """Wait until no server runs an autovacuum worker (the last run's 1M-row tables are vacuumed
    and analyzed in the background; that must not bill the next measurement), then checkpoint.
    Returns the seconds waited."""
    started = time.perf_counter()
    quiet = 0
    while quiet < 2 and time.perf_counter() - started < timeout:
        busy = sum(
            execute(dsn, "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'autovacuum worker'")[0][0]
            for dsn in (env.source_dsn, *env.sink_dsns)
        )
        quiet = quiet + 1 if busy == 0 else 0
        time.sleep(0.5)
    checkpoint_all(env)
    return time.perf_counter() - started


def create_tables(env: BenchEnv, table: str) -> None:
    execute(
        env.source_dsn,
        f"DROP TABLE IF EXISTS {table}",
        f"CREATE TABLE {table} (id bigint PRIMARY KEY, dests smallint NOT NULL, payload bytea NOT NULL)",
    )
    for dsn in env.sink_dsns:
        execute(
            dsn,
            f"DROP TABLE IF EXISTS {table}",
            f"CREATE TABLE {table} (id bigint PRIMARY KEY, payload bytea NOT NULL)",
        )


def truncate_sinks(env: BenchEnv, table: str) -> None:
    for dsn in env.sink_dsns:
        execute(dsn, f"TRUNCATE {table}")


def expected_per_sink(env: BenchEnv, table: str, below_id: int | None = None) -> list[int]:
    """How many source rows each sink must receive (bit i of ``dests``)."""
    cols = ", ".join(f"count(*) FILTER (WHERE dests & {1 << i} <> 0)" for i in range(SINKS))
    where = f" WHERE id < {below_id}" if below_id is not None else ""
    return list(execute(env.source_dsn, f"SELECT {cols} FROM {table}{where}")[0])


def verify_sinks(env: BenchEnv, table: str, expected: list[int], anchor: str) -> None:
    """Row counts must match exactly; a sample of rows (~1 in 10,000) must match byte for byte."""
    got = [execute(dsn, f"SELECT count(*) FROM {table}")[0][0] for dsn in env.sink_dsns]
    if got != expected:
        raise AssertionError(f"{anchor}: sinks hold {got} rows, expected {expected}")
    sample = "id % 9973 = 1"
    source_rows = execute(env.source_dsn, f"SELECT id, dests, md5(payload) FROM {table} WHERE {sample}")
    for i, dsn in enumerate(env.sink_dsns):
        want = {(id_, digest) for id_, dests, digest in source_rows if dests & (1 << i)}
        have = set(execute(dsn, f"SELECT id, md5(payload) FROM {table} WHERE {sample}"))
        if have != want:
            raise AssertionError(
                f"{anchor}: sink {i} differs from the source in sampled rows {sorted(want ^ have)[:5]}"
            )


def _copy_rows(dsn: str, table: str, ids: range, workload: Workload, rng: random.Random, per_txn: int) -> None:
    """Binary COPY of ``ids`` (random 256-byte payloads) into the source, ``per_txn`` rows per commit."""
    with psycopg.connect(dsn) as conn:
        for start in range(ids.start, ids.stop, per_txn):
            stop = min(start + per_txn, ids.stop)
            blob = os.urandom(PAYLOAD_BYTES * (stop - start))
            with conn.cursor().copy(f"COPY {table} (id, dests, payload) FROM STDIN (FORMAT binary)") as copy:
                copy.set_types(["int8", "int2", "bytea"])
                for k, id_ in enumerate(range(start, stop)):
                    copy.write_row((id_, workload.dests(rng), blob[k * PAYLOAD_BYTES : (k + 1) * PAYLOAD_BYTES]))
            conn.commit()


def prepare_source(env: BenchEnv, workload: Workload) -> list[int]:
    """Create and fill the backlog table (ids 1..N); return the deliveries each sink is owed."""
    create_tables(env, BACKLOG_TABLE)
    _copy_rows(
        env.source_dsn,
        BACKLOG_TABLE,
        range(1, workload.entries + 1),
        workload,
        random.Random(workload.seed),
        per_txn=100_000,
    )
    # Set hint bits and the visibility map now, or the first anchor to read the table pays for it.
    execute(env.source_dsn, f"VACUUM (ANALYZE) {BACKLOG_TABLE}")
    return expected_per_sink(env, BACKLOG_TABLE)


def _run_parallel(target: Callable[..., Any], arg_lists: list[tuple]) -> tuple[float, float, list[Any]]:
    """Run ``target(*args, barrier, results)`` in one process per args, from a common start.

    Each process connects first and then waits at the barrier, so the time covers the data
    movement, not process start-up. Returns (start, end) ``perf_counter`` values and the results.
    """
    barrier = mp.Barrier(len(arg_lists) + 1)
    results: mp.Queue = mp.Queue()
    procs = [mp.Process(target=target, args=(*args, barrier, results)) for args in arg_lists]
    for proc in procs:
        proc.start()
    barrier.wait(timeout=120)
    started = time.perf_counter()
    out = [results.get(timeout=3600) for _ in procs]
    ended = time.perf_counter()
    for proc in procs:
        proc.join()
        if proc.exitcode != 0:
            raise RuntimeError(f"{target.__name__} worker failed (exit {proc.exitcode})")
    errors = [r for r in out if isinstance(r, str)]
    if errors:
        raise RuntimeError(errors[0])
    return started, ended, out


# --- a) physical limit --------------------------------------------------------------------------
COPY_BLOCK = 128 * 1024


def coalesced(chunks: Iterable[Buffer], size: int = COPY_BLOCK) -> Iterator[bytes]:
    """Join COPY OUT messages (one per row) into ~128 KiB blocks.

    psycopg sends every ``Copy.write`` as its own CopyData message; relaying row by row made the
    relay, not the servers, the bottleneck (≈2× slower on the 2-core machine).
    """
    parts: list[Buffer] = []
    held = 0
    for chunk in chunks:
        parts.append(chunk)
        held += len(chunk)
        if held >= size:
            yield b"".join(parts)
            parts.clear()
            held = 0
    if parts:
        yield b"".join(parts)


def _copy_to_sink(source_dsn: str, sink_dsn: str, bit: int, variant: str, barrier: Any, results: mp.Queue) -> None:
    try:
        with psycopg.connect(source_dsn) as src, psycopg.connect(sink_dsn) as dst:
            barrier.wait()
            if variant == "all":  # the plain table COPY: the cheapest read there is
                out_sql = f"COPY {BACKLOG_TABLE} (id, payload) TO STDOUT (FORMAT binary)"
            else:
                out_sql = (
                    f"COPY (SELECT id, payload FROM {BACKLOG_TABLE} WHERE dests & {bit} <> 0) TO STDOUT (FORMAT binary)"
                )
            with (
                src.cursor().copy(out_sql) as out,
                dst.cursor().copy(f"COPY {BACKLOG_TABLE} (id, payload) FROM STDIN (FORMAT binary)") as into,
            ):
                for block in coalesced(out):
                    into.write(block)
            dst.commit()
        results.put(bit)
    except Exception as exc:  # reported through the queue so the parent never waits forever
        results.put(f"copy to sink {bit}: {exc!r}")
        raise


def physical_copy(env: BenchEnv, workload: Workload) -> Measurement:
    """Binary COPY source → sink, one process per sink in parallel (each reads the source once)."""
    expected = expected_per_sink(env, BACKLOG_TABLE)
    truncate_sinks(env, BACKLOG_TABLE)
    checkpoint_all(env)
    args = [(env.source_dsn, dsn, 1 << i, workload.variant) for i, dsn in enumerate(env.sink_dsns)]
    started, ended, _ = _run_parallel(_copy_to_sink, args)
    seconds = ended - started
    verify_sinks(env, BACKLOG_TABLE, expected, "physical_copy")
    return Measurement(
        "physical_copy", workload.variant, workload.entries, sum(expected), seconds, {"processes": SINKS}
    )


_PGCOPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + bytes(8)  # signature, flags, header-extension length
_PGCOPY_TRAILER = b"\xff\xff"


def _route_rows(chunks: Iterable[Buffer], sinks: list[psycopg.Copy]) -> None:
    """Split binary COPY rows of (id int8, dests int2, payload bytea) into each addressed sink's
    (id, payload) COPY stream, by the bit of ``dests``, without decoding the payload.

    Row layout: int16 3 | int32 8, int64 id | int32 2, int16 dests | int32 n, payload.
    """
    blocks = [bytearray(_PGCOPY_HEADER) for _ in sinks]
    first = True
    for chunk in chunks:
        row = bytes(chunk)
        if first:  # the server sends the file header in front of the first row
            if not row.startswith(_PGCOPY_HEADER) or row[19:25] != b"\x00\x03\x00\x00\x00\x08":
                raise ValueError("unexpected binary COPY layout")
            row, first = row[len(_PGCOPY_HEADER) :], False
        if len(row) == 2:  # trailer
            continue
        out, dests = b"\x00\x02" + row[2:14] + row[20:], row[19]  # low byte of dests: up to 8 sinks
        for i, block in enumerate(blocks):
            if dests >> i & 1:
                block += out
                if len(block) >= COPY_BLOCK:
                    sinks[i].write(bytes(block))
                    block.clear()
    for sink, block in zip(sinks, blocks):
        sink.write(bytes(block + _PGCOPY_TRAILER))


def _tee(
    env: BenchEnv, out_sql: str, in_sql: str, route: Callable[[psycopg.Copy, list[psycopg.Copy]], None]
) -> tuple[float, dict[str, float]]:
    """One binary COPY out of the source, ``route``d into every sink's COPY in; the seconds it took
    until every sink committed, and the CPU spent by role (``cpu_window``)."""
    with psycopg.connect(env.source_dsn) as src:
        sinks = [psycopg.connect(dsn) for dsn in env.sink_dsns]
        try:
            with cpu_window(env) as cpu:
                started = time.perf_counter()
                with contextlib.ExitStack() as stack:
                    into = [stack.enter_context(conn.cursor().copy(in_sql)) for conn in sinks]
                    with src.cursor().copy(out_sql) as out:
                        route(out, into)
                for conn in sinks:
                    conn.commit()
                seconds = time.perf_counter() - started
            return seconds, cpu
        finally:
            for conn in sinks:
                conn.close()


def physical_tee(env: BenchEnv, workload: Workload) -> Measurement:
    """One binary COPY out of the source, teed into the 3 sinks' binary COPY in, which the sink
    servers ingest concurrently: the ceiling for moving these rows on this machine (the source is
    read once, where ``physical_copy`` reads it 3 times on 2 cores)."""
    expected = expected_per_sink(env, BACKLOG_TABLE)
    truncate_sinks(env, BACKLOG_TABLE)
    checkpoint_all(env)
    if workload.variant == "all":

        def route(out: psycopg.Copy, into: list[psycopg.Copy]) -> None:
            for block in coalesced(out):
                for copy in into:
                    copy.write(block)

        out_sql = f"COPY {BACKLOG_TABLE} (id, payload) TO STDOUT (FORMAT binary)"
    else:
        route, out_sql = _route_rows, f"COPY {BACKLOG_TABLE} (id, dests, payload) TO STDOUT (FORMAT binary)"
    seconds, cpu = _tee(env, out_sql, f"COPY {BACKLOG_TABLE} (id, payload) FROM STDIN (FORMAT binary)", route)
    verify_sinks(env, BACKLOG_TABLE, expected, "physical_tee")
    return Measurement(
        "physical_tee",
        workload.variant,
        workload.entries,
        sum(expected),
        seconds,
        {
            "readers": 1,
            "route": "copy block to all" if workload.variant == "all" else "per row by dests bit",
            "cpu_s": cpu,
        },
    )


PACK_ENTRIES = 28  # entries per row, as lr's receive queue packs 256-byte entries (~8 kB rows)
PACKED_TABLE = "fanout_packed"


def physical_tee_packed(env: BenchEnv, workload: Workload) -> Measurement:
    """The physical tee of packed rows, lr's own row shape: the source forms the packs in SQL
    (``PACK_ENTRIES`` consecutive entries of one sink in one bytea, one output row per pack, read
    by one binary COPY) and the packs are routed by their sink mask into the sinks' binary COPYs of
    ``(id, entries, payload)``. Per-row costs on the sinks shrink by ``PACK_ENTRIES``."""
    expected = expected_per_sink(env, BACKLOG_TABLE)
    for dsn in env.sink_dsns:
        execute(
            dsn,
            f"DROP TABLE IF EXISTS {PACKED_TABLE}",
            f"CREATE TABLE {PACKED_TABLE} (id bigint PRIMARY KEY, entries int NOT NULL, payload bytea NOT NULL)",
        )
    checkpoint_all(env)
    if workload.variant == "all":  # one pack for every sink
        packs = (
            f"SELECT {ALL_SINKS_MASK}::int2, min(id), count(*)::int4, string_agg(payload, ''::bytea ORDER BY id) "
            f"FROM {BACKLOG_TABLE} GROUP BY id / {PACK_ENTRIES}"
        )
    else:  # each sink's own packs of the entries that name it
        packs = (
            f"SELECT (1 << b.bit)::int2, min(e.id), count(*)::int4, string_agg(e.payload, ''::bytea ORDER BY e.id) "
            f"FROM {BACKLOG_TABLE} e CROSS JOIN generate_series(0, {SINKS - 1}) b(bit) "
            f"WHERE e.dests & (1 << b.bit) <> 0 GROUP BY b.bit, e.id / {PACK_ENTRIES}"
        )
    seconds, cpu = _tee(
        env,
        f"COPY ({packs}) TO STDOUT (FORMAT binary)",
        f"COPY {PACKED_TABLE} (id, entries, payload) FROM STDIN (FORMAT binary)",
        _route_packs,
    )
    got = [
        execute(dsn, f"SELECT coalesce(sum(entries), 0), coalesce(sum(length(payload)), 0) FROM {PACKED_TABLE}")[0]
        for dsn in env.sink_dsns
    ]
    if [int(n) for n, _ in got] != expected or any(int(b) != int(n) * PAYLOAD_BYTES for n, b in got):
        raise AssertionError(f"physical_tee_packed: sinks hold {got}, expected {expected} entries")
    for dsn in env.sink_dsns:
        execute(dsn, f"DROP TABLE {PACKED_TABLE}")
    return Measurement(
        "physical_tee_packed",
        workload.variant,
        workload.entries,
        sum(expected),
        seconds,
        {"readers": 1, "entries_per_row": PACK_ENTRIES, "packed_by": "source SQL", "cpu_s": cpu},
    )


def _route_packs(chunks: Iterable[Buffer], sinks: list[psycopg.Copy]) -> None:
    """Rows (mask int2, id int8, entries int4, payload bytea) into each masked sink's
    (id, entries, payload) COPY. Layout: int16 4 | int32 2, mask | int32 8, id | int32 4, n | ..."""
    blocks = [bytearray(_PGCOPY_HEADER) for _ in sinks]
    first = True
    for chunk in chunks:
        row = bytes(chunk)
        if first:
            row, first = row[len(_PGCOPY_HEADER) :], False
        if len(row) == 2:  # trailer
            continue
        mask, out = row[7], b"\x00\x03" + row[8:]
        for i, block in enumerate(blocks):
            if mask >> i & 1:
                block += out
                if len(block) >= COPY_BLOCK:
                    sinks[i].write(bytes(block))
                    block.clear()
    for sink, block in zip(sinks, blocks):
        sink.write(bytes(block + _PGCOPY_TRAILER))


# --- d) naive Python replicator -----------------------------------------------------------------
def naive_python(env: BenchEnv, workload: Workload) -> Measurement:
    """What a user would write first: poll ``id > last``, insert per sink with execute_values."""
    expected = expected_per_sink(env, BACKLOG_TABLE)
    truncate_sinks(env, BACKLOG_TABLE)
    checkpoint_all(env)
    src = psycopg2.connect(env.source_dsn)
    src.autocommit = True  # each poll sees the latest commits
    sinks = [psycopg2.connect(dsn) for dsn in env.sink_dsns]
    started = time.perf_counter()
    try:
        last = 0
        with src.cursor() as read:
            while True:
                read.execute(
                    f"SELECT id, dests, payload FROM {BACKLOG_TABLE} WHERE id > %s ORDER BY id LIMIT %s",
                    (last, workload.batch),
                )
                rows = read.fetchall()
                if not rows:
                    break
                for i, sink in enumerate(sinks):
                    mine = [(id_, payload) for id_, dests, payload in rows if dests & (1 << i)]
                    if mine:
                        with sink.cursor() as cur:
                            psycopg2.extras.execute_values(
                                cur,
                                f"INSERT INTO {BACKLOG_TABLE} (id, payload) VALUES %s",
                                mine,
                                page_size=workload.batch,
                            )
                    sink.commit()
                last = rows[-1][0]
        seconds = time.perf_counter() - started
    finally:
        for conn in (src, *sinks):
            conn.close()
    verify_sinks(env, BACKLOG_TABLE, expected, "naive_python")
    return Measurement(
        "naive_python", workload.variant, workload.entries, sum(expected), seconds, {"batch": workload.batch}
    )


# --- b, c) native logical replication -----------------------------------------------------------
def _names(table: str, i: int) -> tuple[str, str]:
    return f"{table}_pub_{i}", f"{table}_sub_{i}"  # subscription name = its slot name on the source


def create_publications(env: BenchEnv, table: str, variant: str) -> None:
    """One insert-only publication per sink, of (id, payload); "subset" filters on the sink's bit."""
    for i in range(SINKS):
        pub, _ = _names(table, i)
        where = f" WHERE ((dests & {1 << i}) <> 0)" if variant == "subset" else ""
        execute(
            env.source_dsn,
            f"DROP PUBLICATION IF EXISTS {pub}",
            f"CREATE PUBLICATION {pub} FOR TABLE {table} (id, payload){where} WITH (publish = 'insert')",
        )


def create_subscriptions(env: BenchEnv, table: str, copy_data: bool, binary: bool = False) -> None:
    """``binary``: the subscription option ``binary = true`` (initial COPY and changes in binary
    format; 2.64x faster initial sync than text here, so the fair anchor for lr's binary COPY)."""
    for i, dsn in enumerate(env.sink_dsns):
        pub, sub = _names(table, i)
        # The CONNECTION string is libpq's, as the sink server's walreceiver sees it: the source's
        # loopback host/port and the `postgres` role (the OS user pgserver runs as does not matter).
        conn = psycopg2.connect(dsn)
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(
                f"CREATE SUBSCRIPTION {sub} CONNECTION %s PUBLICATION {pub} "
                f"WITH (copy_data = {copy_data}, binary = {binary})",
                (env.source_dsn,),
            )
        conn.close()


def drop_replication(env: BenchEnv) -> None:
    """Drop every bench subscription (which drops its slot on the source), then the publications."""
    for dsn in env.sink_dsns:
        try:
            for (sub,) in execute(dsn, "SELECT subname FROM pg_subscription"):
                execute(dsn, f"DROP SUBSCRIPTION IF EXISTS {sub}")
        except psycopg2.OperationalError:
            pass  # sink already down
    try:
        for (pub,) in execute(env.source_dsn, "SELECT pubname FROM pg_publication"):
            execute(env.source_dsn, f"DROP PUBLICATION IF EXISTS {pub}")
        leftover = execute(env.source_dsn, "SELECT slot_name FROM pg_replication_slots")
        for (slot,) in leftover:
            execute(env.source_dsn, f"SELECT pg_drop_replication_slot('{slot}')")
    except psycopg2.OperationalError:
        pass


def _poll(dsns: list[str], query: str, done: Callable[[list[tuple]], bool], timeout_s: float) -> list[float]:
    """Poll ``query`` on each DSN until ``done``; return each one's time to completion from now."""
    conns = [psycopg2.connect(dsn) for dsn in dsns]
    for conn in conns:
        conn.autocommit = True
    started = time.perf_counter()
    finished: dict[int, float] = {}
    try:
        while len(finished) < len(conns):
            for i, conn in enumerate(conns):
                if i in finished:
                    continue
                with conn.cursor() as cur:
                    cur.execute(query)
                    if done(cur.fetchall()):
                        finished[i] = time.perf_counter() - started
            if time.perf_counter() - started > timeout_s:
                raise TimeoutError(
                    f"not done after {timeout_s:.0f} s on sinks {sorted(set(range(len(conns))) - set(finished))}"
                )
            time.sleep(POLL_S)
    finally:
        for conn in conns:
            conn.close()
    return [finished[i] for i in range(len(conns))]


def _ready_query(table: str) -> str:
    return (
        f"SELECT r.srsubstate, s.pid IS NOT NULL FROM pg_subscription_rel r "
        f"JOIN pg_subscription sub ON sub.oid = r.srsubid "
        f"LEFT JOIN pg_stat_subscription s ON s.subid = sub.oid AND s.relid IS NULL "
        f"WHERE sub.subname LIKE '{table}_sub_%'"
    )


def subscriptions_ready(dsns: list[str], table: str, timeout_s: float, running: bool = False) -> list[float]:
    """Wait until every subscription of ``table`` on each sink has its table synced (state ``r``),
    and with ``running`` its apply worker up; each sink's time to it from now."""
    return _poll(
        dsns,
        _ready_query(table),
        lambda rows: bool(rows) and all(state == "r" and (up or not running) for state, up in rows),
        timeout_s=timeout_s,
    )


def native_initial(env: BenchEnv, workload: Workload, binary: bool = False) -> Measurement:
    """CREATE SUBSCRIPTION on 3 sinks at once; time until each table sync is ready."""
    name = "native_initial_binary" if binary else "native_initial"
    expected = expected_per_sink(env, BACKLOG_TABLE)
    truncate_sinks(env, BACKLOG_TABLE)
    create_publications(env, BACKLOG_TABLE, workload.variant)
    checkpoint_all(env)
    try:
        with cpu_window(env) as cpu:
            started = time.perf_counter()
            create_subscriptions(env, BACKLOG_TABLE, copy_data=True, binary=binary)
            poll_from = time.perf_counter()
            per_sink = subscriptions_ready(env.sink_dsns, BACKLOG_TABLE, timeout_s=3600)
            seconds = time.perf_counter() - started
        verify_sinks(env, BACKLOG_TABLE, expected, name)
    finally:
        drop_replication(env)
    return Measurement(
        name,
        workload.variant,
        workload.entries,
        sum(expected),
        seconds,
        {"per_sink_s": [round(poll_from - started + s, 3) for s in per_sink], "cpu_s": cpu},
    )


def native_initial_binary(env: BenchEnv, workload: Workload) -> Measurement:
    """The same initial sync with the subscriptions' ``binary = true``: native at its best."""
    return native_initial(env, workload, binary=True)


def _stream_writer(dsn: str, ids: range, workload: Workload, seed: int, barrier: Any, results: mp.Queue) -> None:
    try:
        psycopg.connect(dsn).close()  # fail before the barrier if the source is unreachable
        barrier.wait()
        _copy_rows(dsn, STREAM_TABLE, ids, workload, random.Random(seed), per_txn=workload.batch)
        results.put(len(ids))
    except Exception as exc:
        results.put(f"writer {ids}: {exc!r}")
        raise


def _split(ids: range, parts: int) -> Iterator[range]:
    step = -(-len(ids) // parts)
    for start in range(ids.start, ids.stop, step):
        yield range(start, min(start + step, ids.stop))


def native_streaming(env: BenchEnv, workload: Workload) -> Measurement:
    """Subscriptions in place; writers commit N rows; time until every sink applied the last commit.

    The end is detected with a marker row committed after all writers finished: an apply worker
    applies transactions in commit order, so once a sink has the marker it has everything.
    """
    create_tables(env, STREAM_TABLE)
    create_publications(env, STREAM_TABLE, workload.variant)
    try:
        create_subscriptions(env, STREAM_TABLE, copy_data=False)
        subscriptions_ready(env.sink_dsns, STREAM_TABLE, timeout_s=120, running=True)
        checkpoint_all(env)
        ids = range(1, workload.entries + 1)
        args = [
            (env.source_dsn, part, workload, workload.seed + k) for k, part in enumerate(_split(ids, workload.writers))
        ]
        started, writers_done, _ = _run_parallel(_stream_writer, args)
        writers_s = writers_done - started
        marker = workload.entries + 1
        execute(env.source_dsn, f"INSERT INTO {STREAM_TABLE} VALUES ({marker}, {ALL_SINKS_MASK}, '\\x00')")
        poll_from = time.perf_counter()
        arrivals = _poll(env.sink_dsns, f"SELECT 1 FROM {STREAM_TABLE} WHERE id = {marker}", bool, timeout_s=3600)
        tail = [poll_from - writers_done + s for s in arrivals]
        seconds = time.perf_counter() - started
        expected = expected_per_sink(env, STREAM_TABLE, below_id=marker)
        verify_sinks(env, STREAM_TABLE, [n + 1 for n in expected], "native_streaming")
    finally:
        drop_replication(env)
        for dsn in (env.source_dsn, *env.sink_dsns):
            execute(dsn, f"DROP TABLE IF EXISTS {STREAM_TABLE}")
    return Measurement(
        "native_streaming",
        workload.variant,
        workload.entries,
        sum(expected),
        seconds,
        {
            "writers": workload.writers,
            "rows_per_txn": workload.batch,
            "writers_s": round(writers_s, 3),
            "writer_rows_per_s": round(workload.entries / writers_s, 1),
            "tail_after_writers_s": [round(s, 3) for s in tail],
        },
    )


# Run order within a variant: backlog anchors share the filled source table; streaming is separate.
ANCHORS: dict[str, Anchor] = {
    "physical_copy": physical_copy,
    "physical_tee": physical_tee,
    "physical_tee_packed": physical_tee_packed,
    "naive_python": naive_python,
    "native_initial": native_initial,
    "native_initial_binary": native_initial_binary,
    "native_streaming": native_streaming,
}
