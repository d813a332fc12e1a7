"""The driver of a parallel table snapshot (the Spark job ``spark_jobs/lr_table_snapshot.py``):
leases, the exported snapshot, the key ranges handed to tasks, and the finish.

The driver runs the handshake of every session of ``client`` from ``source`` (``session/handshake.py``,
as a cycle would) and keeps the lease of those in log-entry sync that lack tables, keeps them renewed while the tasks run, and
holds the exported snapshot's transaction open until ``finish``: no cycle advances those sessions
meanwhile, which is what makes the snapshot's split exact (``snapshot.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field

import psycopg2
import psycopg2.extensions

from airflow_provider_lr.engine.db.conninfo import ConnInfo, connect_dsn
from airflow_provider_lr.engine.db.timeouts import Purpose, Timeouts
from airflow_provider_lr.engine.errors import ConfigurationError, TopologyMismatchError, one_line
from airflow_provider_lr.engine.session import lease as leases
from airflow_provider_lr.engine.session.handshake import Verdict, handshake
from airflow_provider_lr.engine.session.lease_keeper import LeaseKeeper
from airflow_provider_lr.engine.session.negotiation import Decision
from airflow_provider_lr.engine.session.settings import SessionSettings
from airflow_provider_lr.engine.store.topology import Topology, site_conninfo
from airflow_provider_lr.engine.tables import registry
from airflow_provider_lr.engine.tables.range_copy import KeyRange, copy_range
from airflow_provider_lr.engine.tables.snapshot import SinkSide, TableSnapshot, needed

log = logging.getLogger(__name__)

MapRanges = Callable[[dict, Sequence[KeyRange]], Iterable[int]]  # (task, ranges) -> rows per range


@dataclass
class ParallelResult:
    source: str
    client: str
    sessions: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    tables: dict[str, str] = field(default_factory=dict)
    ranges: int = 0
    rows: int = 0  # written, summed over the sinks
    seconds: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Driver:
    """Who the driver is and how it reaches the sites: its lease owner id (default: a new one), the
    session settings (default: the topology's) and each site's connection (default: the topology's)."""

    owner: str | None = None
    settings: SessionSettings | None = None
    conninfo: Callable[[str], ConnInfo] | None = None


def run_table_snapshot(
    topology: Topology,
    source: str,
    client: str,
    map_ranges: MapRanges,
    parts: int | None = None,
    driver: Driver = Driver(),
) -> ParallelResult:
    """Snapshot the tables the client's sinks lack, in ``parts`` key ranges a table (default: by its
    size), the ranges written by ``map_ranges`` (Spark tasks calling ``copy_range``, or ``local_ranges``);
    tables a sink links by foreign keys are written here, in process (``TableSnapshot.linked``)."""
    settings = driver.settings or SessionSettings.from_topology(topology)
    owner = driver.owner or leases.new_owner_id()
    keys = [k for k in topology.sessions(source=source) if k.client == client]
    if not keys:
        raise ConfigurationError(f"site {source!r} is the source of no session of client {client!r}")
    resolve = driver.conninfo or (lambda site: site_conninfo(topology, site))
    dsns = {site: resolve(site).dsn_for(Purpose.BULK) for site in {source, *(k.sink for k in keys)}}
    result = ParallelResult(source, client)
    t0 = time.monotonic()
    bounds = topology.timeouts  # the heartbeat of every connection here and in the tasks (``conninfo``)
    src = connect_dsn(dsns[source], Purpose.BULK, bounds)
    sides: list[SinkSide] = []
    held: list[leases.Lease] = []
    keeper: LeaseKeeper | None = None
    snap: TableSnapshot | None = None
    try:
        federated = registry.federated_tables(src, client)
        for key in keys:
            sink = connect_dsn(dsns[key.sink], Purpose.BULK, bounds)
            try:
                hs = handshake(src, sink, key, owner, settings.lease_seconds)
            except BaseException:
                sink.close()
                raise
            if hs.lease is not None:
                held.append(hs.lease)
            if hs.verdict is Verdict.REFUSED:  # before: "skipped", and the job ok with no table written
                sink.close()
                raise TopologyMismatchError(f"session {key}: {hs.reason}")
            why = hs.left_out(Decision.LOG_ENTRY_SYNC, "its cycle snapshots the tables after it")
            lacking = [] if why else needed(src, sink, key, federated)
            if why or not lacking:
                result.skipped[str(key)] = why or "has every table"
                sink.close()
                continue
            assert hs.position is not None
            sides.append(SinkSide(key, sink, hs.position.epoch, lacking))
            result.sessions.append(str(key))
        if not sides:
            return result
        keeper = LeaseKeeper(dsns[source], held, settings.lease_seconds, bounds)
        snap = TableSnapshot(src, client, sides)
        snap.open()
        linked = snap.linked()  # a sink's foreign keys between them: written in process, parents first
        ranged = snap.part(set(snap.definitions) - linked)
        t1 = t2 = time.monotonic()
        if ranged.definitions:
            ranged.begin()
            ranges = ranged.plan(parts)
            task = {**ranged.task(), "dsns": dsns, "timeouts": bounds}
            result.ranges = len(ranges)
            t1 = time.monotonic()
            result.rows = sum(map_ranges(task, ranges))
            t2 = time.monotonic()
            ranged.finish(ranges)
        if linked:
            result.rows += snap.part(linked).write().rows
        result.tables = snap.report.tables
        result.seconds = {
            "plan": round(t1 - t0, 3),
            "copy": round(t2 - t1, 3),
            "total": round(time.monotonic() - t0, 3),
        }
        log.info(
            "table snapshot of %s/%s: %d ranges, %d rows in %.1fs", source, client, result.ranges, result.rows, t2 - t1
        )
        return result
    finally:
        if snap is not None:
            try:
                snap.close()
            except psycopg2.Error:  # the connection died with the source's server: no snapshot left to end
                pass
        if keeper is not None:
            keeper.stop()
        for lease in held:
            leases.release_quietly(src, lease)
        if held and src.closed:  # the source restarted during the job: its leases released on a new connection
            _release_anew(dsns[source], bounds, held)
        for side in sides:
            side.conn.close()
        src.close()


def _release_anew(dsn: str, bounds: Timeouts, held: list[leases.Lease]) -> None:
    """The leases released on a new connection to the source: the job's own died with a restart of
    its server (before, they stayed held and kept every replicator off the sessions for
    ``lease_seconds``). A source still down lets them run out."""
    try:
        conn = connect_dsn(dsn, Purpose.BULK, bounds)
    except Exception as exc:
        log.warning("table snapshot: leases not released: %s", one_line(exc))
        return
    try:
        for lease in held:
            leases.release_quietly(conn, lease)
    finally:
        conn.close()


def connect_by_task(task: dict) -> Callable[[str], psycopg2.extensions.connection]:
    return lambda site: connect_dsn(task["dsns"][site], Purpose.BULK, task.get("timeouts"))


def local_ranges(task: dict, ranges: Sequence[KeyRange]) -> list[int]:
    """``MapRanges`` in this process, one range after another (tests, small runs)."""
    return [copy_range(task, r, connect_by_task(task)) for r in ranges]
