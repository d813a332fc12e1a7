"""Nearest-copy catch-up (DistributedLog's speculative reads): a sink that needs a snapshot takes it from
a peer sink in its own region that is consistent at a known position, and falls back to the source.

Only for a client whose replicated state is all federated tables (no routing-queue full sync: the
application's own full-sync data lives only at the source). A peer qualifies when, in ONE
repeatable-read snapshot of the peer:

* its session with the same source and client is consistent (its full sync applied) at position P,
  not failed over, and the source's log still holds every entry after P (trim mark <= P);
* its tables of that session are ``synced`` with their split and are this source's alone there
  (no other origin writes them: the peer's rows are then exactly the source's rows as of P).

The peer applies a table change and advances its position in one transaction, and records a
table's snapshot split in the transaction that writes the rows; so what that snapshot shows is the
source's tables as of P, the splits saying which later positions they already cover. The sink takes
all of it in one fenced sink transaction: the rows (through the same copy as a source snapshot),
each table's split, and the peer's session position and base. Then log-entry sync goes on from P
against the source, exactly as it does for the peer. Tables the peer does not hold yet are left to
the session's own table snapshot (``SessionRunner.sync_tables``), from the source.

Speculative, with exponential backoff: the nearest peers are asked in turn; a peer that does not
answer its probe (connect, then the metadata read) within the delay is passed over, the next one
gets twice the delay, and when none qualifies the source's snapshot runs as before. Each passed
peer and why is in the result (``SessionRunner`` puts it in the cycle's reason).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import psycopg2
import psycopg2.extensions
from psycopg2.extensions import AsIs

from airflow_provider_lr.engine.db.lifting import lifted
from airflow_provider_lr.engine.errors import ApplyError, LRError, one_line
from airflow_provider_lr.engine.faults import fault_point
from airflow_provider_lr.engine.session.handshake import Position
from airflow_provider_lr.engine.sink import writes
from airflow_provider_lr.engine.store import receive_queue
from airflow_provider_lr.engine.store.topology import Topology, config_id
from airflow_provider_lr.engine.tables import references
from airflow_provider_lr.engine.tables import sink as sink_tables
from airflow_provider_lr.engine.tables.definition import TableName, read_definition, read_definitions
from airflow_provider_lr.engine.tables.range_copy import copy_to_targets
from airflow_provider_lr.engine.tables.registry import FederatedTable
from airflow_provider_lr.engine.tables.sink import SinkTable, TableState
from airflow_provider_lr.engine.vocabulary import SessionKey

log = logging.getLogger(__name__)

PROBE_DELAY = 2.0  # seconds the first peer has to answer; each next one gets twice as long


@dataclass(frozen=True)
class Peer:
    """Another sink of the same source and client, and how to open a new connection to it."""

    site: str
    connect: Callable[[], psycopg2.extensions.connection]


@dataclass(frozen=True)
class Candidates:
    """The peers to ask, nearest first, and how long the first has to answer (each next one gets
    twice as long)."""

    peers: Sequence[Peer]
    delay: float = PROBE_DELAY


@dataclass
class PeerSeed:
    """What a seed took (``peer`` None: no peer qualified; ``passed`` says why for each)."""

    peer: str | None = None
    position: int = -1
    tables: list[str] = field(default_factory=list)
    rows: int = 0
    bytes: int = 0
    seconds: float = 0.0
    passed: list[str] = field(default_factory=list)  # "site-c: why it was passed over"

    def describe(self) -> str:
        passed = f" (passed over {'; '.join(self.passed)})" if self.passed else ""
        if self.peer is None:
            return f"no peer sink could seed it{passed}: snapshot from the source"
        return (
            f"seeded from peer {self.peer} at position {self.position}: {len(self.tables)} tables, "
            f"{self.rows} rows in {self.seconds:.1f}s{passed}"
        )


class PeerUnfit(LRError):
    """The peer cannot seed this sink now (the message says why); the next candidate is tried."""


def peers_in_region(
    topology: Topology, key: SessionKey, connect: Callable[[str], psycopg2.extensions.connection]
) -> list[Peer]:
    """The other sinks of ``key``'s source and client in the sink's region, in topology order."""
    region = topology.site(key.sink).region
    return [
        Peer(other.sink, partial(connect, other.sink))
        for other in topology.sessions(source=key.source)
        if other.client == key.client and other.sink != key.sink and topology.site(other.sink).region == region
    ]


def seed_from_peers(
    source: psycopg2.extensions.connection,
    sink: psycopg2.extensions.connection,
    key: SessionKey,
    position: Position,
    federated: Sequence[FederatedTable],
    candidates: Candidates,
    before_write: Callable[[], None] = lambda: None,
) -> PeerSeed:
    """Seed the sink from the first of ``candidates`` that qualifies (see the module); ``peer`` None
    when none did and the caller takes the source's snapshot. ``position``: where the session's
    handshake left the sink; the seed writes under its lease epoch. ``before_write`` runs once a
    peer qualified, before the sink is written (the runner closes the source's open request there).
    Never leaves the sink half written."""
    result = PeerSeed()
    trim_mark, topology_id, wanted = _source_view(source, federated)
    for n, peer in enumerate(candidates.peers):
        started = time.monotonic()
        wait = candidates.delay * 2**n
        try:
            conn = _probe(peer, wait)
        except PeerUnfit as exc:
            result.passed.append(f"{peer.site}: {one_line(exc)}")
            continue
        try:
            view = _peer_view(conn, key, trim_mark, topology_id, wanted)
            before_write()
            with lifted(conn, sink):  # a whole table copied in one statement: as long as it takes
                copied = _write(conn, sink, key, position.epoch, peer.site, view)
        except (PeerUnfit, ApplyError, psycopg2.Error) as exc:  # (ApplyError: the sink refused a table's rows)
            result.passed.append(f"{peer.site}: {one_line(exc)}")
            continue
        finally:
            conn.close()
        result.peer, result.position = peer.site, view.meta.last_log_entry_processed
        result.tables = sorted(str(t) for t in view.tables)
        result.bytes, result.rows = copied
        result.seconds = time.monotonic() - started
        log.info("session %s: %s", key, result.describe())
        return result
    return result


def _source_view(
    source: psycopg2.extensions.connection, federated: Sequence[FederatedTable]
) -> tuple[int, str | None, dict]:
    """The source's trim mark, topology id and its tables' definitions (a peer's must be the same)."""
    with source.cursor() as cur:
        cur.execute("SELECT trim_mark FROM lr.log_trim")
        trim_mark = cur.fetchone()[0]
        topology_id = config_id(cur)
        read = read_definitions(cur, [t.table for t in federated], extras=True)
        wanted = {t.table: (t, read[t.table]) for t in federated}
    source.commit()
    return trim_mark, topology_id, wanted


def _probe(peer: Peer, wait: float) -> psycopg2.extensions.connection:
    """A connection to the peer that answered within ``wait`` seconds, or ``PeerUnfit``. The probe
    runs on its own thread, so a peer that hangs (a stalled link, a stopped host) costs the wait and
    no more; its connection, if it ever opens, is closed."""
    answer = _Answer()
    done = threading.Event()
    abandoned = threading.Event()

    def run() -> None:
        try:
            conn = peer.connect()
            with conn.cursor() as cur:
                cur.execute("SELECT 1")
            conn.rollback()
            answer.conn = conn
        except BaseException as exc:  # noqa: BLE001 - reported as the peer's reason
            answer.error = exc
        done.set()
        if abandoned.is_set() and answer.conn is not None:
            answer.conn.close()

    threading.Thread(target=run, name=f"lr-probe-{peer.site}", daemon=True).start()
    if not done.wait(wait):
        abandoned.set()
        if done.is_set() and answer.conn is not None:  # answered in the instant between: still close it
            answer.conn.close()
        raise PeerUnfit(f"did not answer within {wait:g}s")
    if answer.error is not None:
        raise PeerUnfit(f"unreachable ({str(answer.error).strip() or type(answer.error).__name__})")
    assert answer.conn is not None, "the probe ended without a connection or an error"
    return answer.conn


@dataclass
class _Answer:
    """What a probe's thread found: the peer's connection, or why it has none."""

    conn: psycopg2.extensions.connection | None = None
    error: BaseException | None = None


@dataclass
class _PeerView:
    meta: writes.SinkMetadata
    tables: dict  # TableName -> (SinkTable at the peer, FederatedTable, TableDefinition)


def _peer_view(
    conn: psycopg2.extensions.connection, key: SessionKey, trim_mark: int, topology_id: str | None, wanted: dict
) -> _PeerView:
    """Open the peer's repeatable-read snapshot (kept open for the copy) and check it qualifies."""
    cur = conn.cursor()
    cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
    meta = writes.metadata_in(cur, key.source, key.client)
    if meta is None:
        raise PeerUnfit(f"has no session with {key.source} for {key.client}")
    if meta.failed_over_to is not None:
        raise PeerUnfit(f"its session was failed over to {meta.failed_over_to}")
    if not (
        meta.data_consistent
        and meta.snapshot_started >= 0
        and meta.snapshot_applied == meta.snapshot_transferred == meta.snapshot_started
        and meta.last_log_entry_processed >= meta.snapshot_started
    ):
        raise PeerUnfit("not consistent (its own full sync is not applied)")
    if meta.topology_config_id != topology_id:
        raise PeerUnfit(f"on topology {meta.topology_config_id}, the source on {topology_id}")
    if trim_mark > meta.last_log_entry_processed:
        raise PeerUnfit(f"at position {meta.last_log_entry_processed}, behind the source's trim mark {trim_mark}")
    held: dict[TableName, SinkTable] = sink_tables.session_tables(cur, key.source, key.client)
    tables = {}
    for name, (federated, source_def) in wanted.items():
        have = held.get(name)
        if (
            have is None
            or have.state != TableState.SYNCED
            or have.split is None
            or have.source_table_id != federated.table_id
        ):
            continue  # left to the session's own table snapshot from the source
        _, shared = sink_tables.origin(cur, name, key.source)
        if shared:
            raise PeerUnfit(f"{name} there holds rows of other origins too")
        definition = read_definition(cur, name)
        if definition is None or source_def is None:
            raise PeerUnfit(f"{name} no longer exists there or on the source")
        if source_def.mismatch(definition):
            raise PeerUnfit(f"{name} there differs from the source's ({'; '.join(source_def.mismatch(definition))})")
        tables[name] = (have, federated, source_def)
    if not tables:
        raise PeerUnfit("holds none of the client's tables synced")
    return _PeerView(meta, tables)


def _write(
    peer: psycopg2.extensions.connection,
    sink: psycopg2.extensions.connection,
    key: SessionKey,
    epoch: int,
    peer_site: str,
    view: _PeerView,
) -> tuple[int, int]:
    """One fenced sink transaction: every table the peer holds, cleared of the source's rows and
    copied from the peer's snapshot with its split, then the peer's session position and base."""
    write = writes.SinkTransaction(sink, key.source, key.client, epoch)
    write.open()
    try:
        if not _empty_queue(write.cur, key):
            raise PeerUnfit(f"the sink's queue from {key.source} still holds entries of {key.client}")
        sink_tables.forget_session(write.cur, key.source, key.client)
        sink_tables.applying(write.cur)
        copied = rows = 0
        at = view.meta.last_log_entry_processed
        # cleared children first, copied parents first, by the sink's foreign keys (``tables/references``)
        order = references.load_order(list(view.tables), references.edges(write.cur, view.tables))
        targets = {}
        for name in reversed(order):
            target = sink_tables.prepare(write.cur, key.source, key.client, view.tables[name][2], f"session {key}")
            if target is None:
                raise PeerUnfit(f"{name} is open on the sink as not federated")
            sink_tables.clear(write.cur, target)
            targets[name] = target
        with peer.cursor() as read:
            for name in order:
                (held, federated, definition), target = view.tables[name], targets[name]
                n, (count,) = copy_to_targets(read, definition, None, [(write.cur, target)])
                copied, rows = copied + n, rows + count
                sink_tables.record(
                    write.cur,
                    key.source,
                    key.client,
                    name,
                    federated.table_id,
                    TableState.SYNCED,
                    run_id=None,
                    split_snapshot=held.split.snapshot,
                    split_upto=held.split.upto,
                    rows_copied=count,
                    detail="; ".join(filter(None, [f"copied from peer {peer_site} at position {at}", target.note])),
                )
        m = view.meta
        write.update(
            topology_config_id=m.topology_config_id,
            snapshot_request_id=None,
            snapshot_started=m.snapshot_started,
            snapshot_transferred=m.snapshot_transferred,
            snapshot_applied=m.snapshot_applied,
            snapshot_transferred_seq=m.snapshot_transferred_seq,
            snapshot_last_entry=m.snapshot_last_entry,
            base_snapshot=m.base_snapshot,
            base_upto=m.base_upto,
            last_log_entry_processed=at,
            data_consistent=True,
            snapshot_completed_at=AsIs("now()"),
        )
        fault_point("peer_seed_before_commit")
    except BaseException:
        write.abort()
        raise
    write.commit()
    peer.rollback()
    return copied, rows


def _empty_queue(cur: psycopg2.extensions.cursor, key: SessionKey) -> bool:
    return receive_queue.is_empty(cur, key.source, key.client)
