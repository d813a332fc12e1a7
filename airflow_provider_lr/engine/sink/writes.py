"""The sink end of a session: its metadata, and every write into its receive queue.

Each function is one sink transaction that first locks the session's metadata row and checks the
writer's lease epoch (fencing: a replicator whose lease was taken over can never write again:
``store.sink_sessions.FencedTransaction``), then writes data and metadata together, so a crash
anywhere leaves either both or neither. The statements are the stores' (``store.sink_sessions``,
``store.receive_queue``); the rules of what a write may do are here.
Log-entry batches are idempotent through ``last_log_entry_processed`` (a replay or an overlap
writes only what is new); snapshot messages through the source entry id they end at.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields, replace

import psycopg2
import psycopg2.errors
import psycopg2.extensions
from psycopg2.extensions import AsIs

from airflow_provider_lr.engine.errors import StaleBatchError, error_line
from airflow_provider_lr.engine.sink.queue_rows import Packer
from airflow_provider_lr.engine.source.full_sync import FullSyncRequest
from airflow_provider_lr.engine.source.log_reader import BaseSplit, LogBatch, LogRecord, LogStream
from airflow_provider_lr.engine.store import receive_queue, sink_sessions
from airflow_provider_lr.engine.store.topology import config_id
from airflow_provider_lr.engine.tables.sink import ChangeApplier, forget_session
from airflow_provider_lr.engine.vocabulary import MALFORMED, NOTIFY_CHANNEL, strip_destinations, wakeup_payload
from airflow_provider_lr.proto import lr_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SinkMetadata:
    source_site_id: str
    client_name: str
    topology_config_id: str | None
    snapshot_request_id: str | None
    snapshot_started: int
    snapshot_transferred: int
    snapshot_applied: int
    snapshot_transferred_seq: int
    snapshot_last_entry: int
    base_snapshot: str | None
    base_upto: int | None
    last_log_entry_processed: int
    data_consistent: bool
    lease_epoch: int
    failed_over_to: str | None = None  # the session was failed over (V0010): no writer is accepted
    site_topology_config_id: str | None = None  # the topology applied to the sink site

    @property
    def split(self) -> BaseSplit | None:
        if self.base_snapshot is None or self.base_upto is None:
            return None
        return BaseSplit(self.base_snapshot, self.base_upto)


assert sink_sessions.COLUMNS == tuple(f.name for f in fields(SinkMetadata) if f.name != "site_topology_config_id")


def _metadata(row: sink_sessions.Row, site_topology: str | None = None) -> SinkMetadata:
    values = dict(row)
    if values["snapshot_request_id"] is not None:
        values["snapshot_request_id"] = str(values["snapshot_request_id"])
    return SinkMetadata(**values, site_topology_config_id=site_topology)


def metadata_in(cur: psycopg2.extensions.cursor, source: str, client: str) -> SinkMetadata | None:
    """The session's metadata as ``cur``'s transaction sees it (None: no such session); no row made."""
    row = sink_sessions.read(cur, source, client)
    return None if row is None else _metadata(row)


def read_metadata(conn: psycopg2.extensions.connection, source: str, client: str) -> SinkMetadata:
    """The sink's metadata for a session (created on first contact), with the sink site's topology id."""
    try:
        with conn.cursor() as cur:
            row = sink_sessions.read_or_create(cur, source, client)
            topo = config_id(cur)
        conn.commit()
        return _metadata(row, topo)
    except BaseException:
        conn.rollback()
        raise


# A sink write sends its receive-queue rows in INSERTs of about this many bytes (or entries), not
# all at once: memory stays bounded however large the batch (the bytea travels hex-escaped, 2x).
INSERT_BYTES = 4 << 20
INSERT_ENTRIES = 4096


class SinkTransaction(sink_sessions.FencedTransaction):
    """One fenced sink transaction (``FencedTransaction``: the session row locked, a stale writer
    refused) that gives the sink's metadata and writes the session's receive queue. As a context
    manager (``with SinkTransaction(...) as (cur, meta)``) it commits on a clean exit and aborts on
    an exception; the fan-out calls the methods itself, its transactions span a whole chunk's read."""

    held = b""  # the last INSERT of ``insert(..., hold=True)``, sent with the next ``advance``

    def open(self) -> SinkMetadata:
        """Lock the session's row, refuse a stale epoch, raise the sink's epoch to ours; the sink's
        metadata as it stands under the lock."""
        return _metadata(super().open())

    def __enter__(self) -> tuple[psycopg2.extensions.cursor, SinkMetadata]:
        return super().__enter__()

    def advance(self, end: int, wrote: bool, register: bool = True, last: bool = False) -> None:
        """Record a log-entry batch's end; when it ``wrote`` entries, also register the queue (see
        ``announce``) and wake the subscribers at commit: the last rows ``insert`` held back,
        position and wake-up in one round trip (with the commit too when ``last``, on an
        autocommit connection: ``FencedTransaction``)."""
        if wrote and register:
            self.register()
        held, self.held = self.held, b""
        self.advance_to(end, (NOTIFY_CHANNEL, wakeup_payload(self.client, self.source)) if wrote else None, last, held)

    def commit(self) -> None:
        if self.held:  # rows held back for an ``advance`` that did not come
            self.cur.execute(self.held)
            self.held = b""
        super().commit()

    def metadata(self) -> SinkMetadata:
        """The session's metadata as this transaction has just written it: what the caller goes on from."""
        return _metadata(self.row())

    def insert(
        self,
        entries: Iterable[tuple[int, int, int, bytes]],
        sync_id: str | None = None,
        visible: bool = True,
        hold: bool = False,
    ) -> int:
        """Entries (kind, position, entry id, message) appended in order, packed into receive-queue
        rows (``queue_rows``): ``seq`` follows the order. Returns how many were written.

        ``entries`` may be a stream (``LogStream``): rows are sent every ``INSERT_BYTES`` (or
        ``INSERT_ENTRIES``) in this same transaction, so a batch of any size costs a few MiB here.
        ``hold``: the last rows go with the transaction's ``advance`` (one round trip fewer)."""
        writer = receive_queue.QueueWriter(self.source, self.client, sync_id, visible)
        packer = Packer(writer.add)
        waiting = 0  # bytes added since the last flush
        for entry in entries:
            packer.add(*entry)
            waiting += len(entry[3])
            if waiting >= INSERT_BYTES or len(packer.pending) >= INSERT_ENTRIES:
                packer.flush(final=False)  # the unfinished last pack waits for more
                writer.send(self.cur)
                waiting = sum(len(p[0]) for p in packer.pending)
        packer.flush()
        if hold:
            self.held = writer.statement(self.cur)
        else:
            writer.send(self.cur)
        return packer.entries

    def register(self) -> None:
        """Register the receive queue so subscribers discover it (``receive_queue.register``)."""
        receive_queue.register(self.cur, self.source, self.client)

    def announce(self) -> None:
        """Register the receive queue (first write after any restart) and wake subscribers at commit."""
        self.register()
        self.cur.execute("SELECT pg_notify(%s, %s)", (NOTIFY_CHANNEL, wakeup_payload(self.client, self.source)))


def flush(conn: psycopg2.extensions.connection, source: str, client: str, epoch: int) -> None:
    """Make everything committed on the sink so far durable: an empty fenced transaction of the
    session (its row lock is written to the WAL) committed synchronously, so its commit waits for
    the WAL flush past every commit before it."""
    with SinkTransaction(conn, source, client, epoch, synchronous=True):
        pass


def fence(conn: psycopg2.extensions.connection, source: str, client: str, epoch: int) -> SinkMetadata:
    """Raise the session's lease epoch on the sink to ``epoch`` and return the sink's metadata (with
    the sink site's topology id). A new lease holder calls this before it decides anything: from
    then on a replicator whose lease ran out mid-cycle can no longer write here, so the decision is
    taken on metadata no stale writer can change behind it. A fenced transaction of a lower epoch
    that holds the session's row is a writer stopped inside it (a hung or SIGSTOPped replicator: a
    COPY waiting for its client is ended by no timeout, and held every next holder off for as long):
    it is ended (``end_stale_writers``) and the fence tried again."""
    try:
        return _fence(conn, source, client, epoch)
    except psycopg2.errors.LockNotAvailable:
        if not end_stale_writers(conn, source, client, epoch):
            raise
    return _fence(conn, source, client, epoch)


def _fence(conn: psycopg2.extensions.connection, source: str, client: str, epoch: int) -> SinkMetadata:
    write = SinkTransaction(conn, source, client, epoch)
    with write as (cur, meta):
        if meta.lease_epoch < epoch:
            # a new holder: what an earlier one's Spark job staged here can never be published or moved
            # now (its epoch is fenced), whoever moves the session next. Before, it stayed until the
            # next Spark plan of the session: with ``lr sync`` alone after a failed job, for good.
            discard_staged(cur, source, client)
        return replace(meta, lease_epoch=epoch, site_topology_config_id=config_id(cur))


def end_stale_writers(conn: psycopg2.extensions.connection, source: str, client: str, epoch: int) -> bool:
    """End the backend whose fenced transaction of an epoch below ``epoch`` holds the session's row
    (a writer this epoch fences); True if one was ended. One that cannot be ended (another role's,
    without the privilege) is said, with the statement that ends it."""
    with conn.cursor() as cur:
        holders = sink_sessions.stale_writers(cur, source, client, epoch)
    conn.rollback()
    ended = False
    for pid, age, state in holders:
        what = f"backend {pid} ({state}, a fenced transaction of an older epoch open {age:.0f}s)"
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT pg_catalog.pg_terminate_backend(%s, 5000)", (pid,))
                done = cur.fetchone()[0]
            conn.rollback()
        except psycopg2.Error as exc:
            conn.rollback()
            log.warning(
                "session %s->%s: the sink's %s holds the session locked and could not be ended (%s): end it "
                "there with SELECT pg_terminate_backend(%s)",
                source,
                client,
                what,
                error_line(exc),
                pid,
            )
            continue
        if done:
            log.warning(
                "session %s->%s: ended the sink's %s: a writer whose lease was taken over", source, client, what
            )
            ended = True
    return ended


def forget_tables(
    conn: psycopg2.extensions.connection, source: str, client: str, epoch: int, whole: Mapping[str, int] | None = None
) -> None:
    """The session's federated tables take new snapshots at its next log-entry sync, as after a
    full sync (``forget_session``; ``whole``: closed copies kept), in a fenced transaction
    (``handshake`` calls it for a session its source lost and has again)."""
    with SinkTransaction(conn, source, client, epoch) as (cur, _meta):
        forget_session(cur, source, client, whole)


def discard_staged(cur: psycopg2.extensions.cursor, source: str, client: str) -> None:
    """Drop everything Spark jobs staged for the session on this sink and never moved into its
    receive queue (``lr.spark_staging``: fan-out packs and snapshot data, and their range records).
    Staged rows are never visible: once the session moves on (a fan-out plan starts or ends, a
    snapshot sync starts or is applied, a new lease holder fences the sink: ``fence``) what a
    failed, abandoned or superseded job left there is dead weight. Called inside the session's fenced sink transaction; a job fenced out by it cannot
    publish or move what it stages later (the next of these calls drops that; a snapshot transfer's
    stage for a sync the sink no longer transfers rolls itself back: ``snapshot_transfer.stage_range``)."""
    cur.execute("DELETE FROM lr.spark_staging WHERE source_site_id = %s AND client_name = %s", (source, client))
    cur.execute("DELETE FROM lr.spark_staged_ranges WHERE source_site_id = %s AND client_name = %s", (source, client))


def discard_unapplied(cur: psycopg2.extensions.cursor, source: str, client: str) -> None:
    """Drop what the session holds on this sink that was never made visible: the rows of a full sync
    not applied (they stay invisible unless it is) and what Spark jobs staged (``discard_staged``).
    Called inside the session's fenced sink transaction when that data can no longer be applied: a
    newer sync starts, or the session is failed over (``site.failover_reconcile``)."""
    receive_queue.discard_invisible(cur, source, client)
    discard_staged(cur, source, client)


@dataclass(frozen=True)
class SyncStart:
    """The full sync a sink starts: its id, and the base position and split its data was read at."""

    sync_id: str
    base: int
    split: BaseSplit
    whole: Mapping[str, int] = field(default_factory=dict, hash=False)  # closed tables' copies it leaves whole

    @classmethod
    def of(cls, request: FullSyncRequest, whole: Mapping[str, int] | None = None) -> SyncStart:
        """The start of a supplied request (its data read at its base); ``whole``: the copies of
        closed tables it leaves whole at the sink (``closed_tables.whole_copies``), kept as synced."""
        assert request.base_position is not None, f"full sync {request.request_id} is not supplied"
        return cls(request.request_id, request.base_position, request.split, dict(whole or {}))


def start_snapshot(
    conn: psycopg2.extensions.connection,
    source: str,
    client: str,
    epoch: int,
    sync: SyncStart,
    topology_config_id: str | None,
) -> SinkMetadata:
    """SNAPSHOT_START: record the new sync and discard any unapplied data of an older one (and
    whatever Spark jobs left staged for the session).
    Repeating it for the sync already started is a no-op, so an interrupted transfer resumes; a
    sync this sink has already applied is refused (taking it for a resume would apply nothing and
    continue from its old base), and so is one whose base is behind the position the sink has
    processed (supplied while the session still streamed: a sink never moves backwards, so no
    entry is delivered twice)."""
    sync_id, base, split = sync.sync_id, sync.base, sync.split
    write = SinkTransaction(conn, source, client, epoch)
    with write as (cur, meta):
        if meta.snapshot_request_id == sync_id and meta.snapshot_applied == meta.snapshot_started >= 0:
            raise StaleBatchError(
                f"full sync {sync_id} of {source}/{client} was already applied on this sink; an applied full "
                "sync is never reused (the source closes it and requests a new one)"
            )
        if meta.snapshot_request_id == sync_id and meta.snapshot_started == base:
            return meta
        if base < meta.last_log_entry_processed:
            # applying it would set the sink back to ``base`` and deliver every entry after it again
            raise StaleBatchError(
                f"full sync {sync_id} of {source}/{client} has its base at position {base}, behind the "
                f"{meta.last_log_entry_processed} this sink has processed; its data must be supplied again"
            )
        discard_unapplied(cur, source, client)
        write.register()  # the first write of a snapshot sync registers the queue
        forget_session(cur, source, client, sync.whole)  # its federated tables take new snapshots after this one
        write.update(
            snapshot_request_id=sync_id,
            snapshot_started=base,
            snapshot_transferred=-1,
            snapshot_applied=-1,
            snapshot_transferred_seq=-1,
            snapshot_last_entry=-1,
            base_snapshot=split.snapshot,
            base_upto=split.upto,
            data_consistent=False,
            topology_config_id=topology_config_id,
        )
        return write.metadata()


def write_snapshot_messages(
    conn: psycopg2.extensions.connection,
    source: str,
    client: str,
    epoch: int,
    sync_id: str,
    records: Iterable[LogRecord],
) -> SinkMetadata:
    """Append transferred snapshot messages (invisible until apply), in source entry order; what
    was already received is skipped. The end marker completes the transfer."""
    write = SinkTransaction(conn, source, client, epoch)
    with write as (cur, meta):
        if meta.snapshot_request_id != sync_id:
            raise StaleBatchError(f"snapshot data of sync {sync_id} for a sink now on sync {meta.snapshot_request_id}")
        rows, last_entry, ended = [], meta.snapshot_last_entry, False
        for record in records:
            if record.entry_id <= last_entry:
                continue
            kind, message = strip_destinations(record.message)
            rows.append((kind, record.position, record.entry_id, message))
            last_entry = record.entry_id
            ended = ended or kind == lr_pb2.LAST_FULL_SYNC_ENTRY
        write.insert(rows, sync_id, visible=False)
        changes: dict[str, object] = {
            "snapshot_transferred_seq": meta.snapshot_transferred_seq + len(rows),  # -1: none yet
            "snapshot_last_entry": last_entry,
        }
        if ended:
            changes["snapshot_transferred"] = meta.snapshot_started
        write.update(**changes)
        return write.metadata()


def apply_snapshot(conn: psycopg2.extensions.connection, source: str, client: str, epoch: int) -> SinkMetadata:
    """Make a transferred snapshot visible, atomically with applied = last processed = base and
    data_consistent. Idempotent; refuses a snapshot whose transfer is not complete."""
    write = SinkTransaction(conn, source, client, epoch)
    with write as (cur, meta):
        if meta.snapshot_started == -1 or meta.snapshot_transferred != meta.snapshot_started:
            raise StaleBatchError(f"snapshot {meta.snapshot_request_id} of {source}/{client} is not fully transferred")
        if meta.snapshot_applied == meta.snapshot_started and meta.data_consistent:
            return meta
        receive_queue.make_visible(cur, source, client, meta.snapshot_request_id)
        discard_staged(cur, source, client)  # a Spark transfer of it abandoned, then the sync moved in process
        write.update(
            snapshot_applied=meta.snapshot_started,
            last_log_entry_processed=meta.snapshot_started,
            data_consistent=True,
            snapshot_completed_at=AsIs("now()"),
        )
        write.announce()
        return write.metadata()


def apply_log_stream(
    conn: psycopg2.extensions.connection,
    source: str,
    client: str,
    epoch: int,
    batch: LogBatch | LogStream,
    base: int,
    register: bool = True,
    synchronous: bool | None = None,
) -> int:
    """Apply a log-entry batch covering positions ``(batch.after, batch.end]``; returns the sink's last
    processed position. A batch already applied is a no-op; an overlapping one writes only the new
    entries; one that would leave a gap, or belongs to another snapshot base, is refused.

    A batch read as it is written (``LogReader.read_stream``) goes into ONE sink transaction in
    pieces, with ``last_log_entry_processed = batch.end`` set at the end, so a source transaction of
    any size becomes visible on the sink whole (guarantee 2 in docs/architecture.md) while only a few MiB of it are
    in memory at a time. ``register=False``: the queue is registered already (a stream registers it
    with its first write). ``synchronous=False``: committed without waiting for the sink's WAL flush
    (a stream's applies); the caller acknowledges the position only once the flush passed it
    (``session/durable_acks``). None: on the sink's disk before it returns (the sink's
    ``synchronous_commit``, raised from ``off`` to ``local``)."""
    write = SinkTransaction(conn, source, client, epoch, synchronous)
    with write as (cur, meta):
        if not meta.data_consistent or meta.snapshot_applied != base:
            raise StaleBatchError(
                f"log entries for base {base} but the sink of {source}/{client} is at base {meta.snapshot_applied} "
                f"(consistent: {meta.data_consistent}); renegotiate"
            )
        last = meta.last_log_entry_processed
        if batch.end <= last:  # before reading, ``end`` is an upper bound: nothing new
            return last
        if batch.after > last:
            raise StaleBatchError(f"batch starts after {batch.after} but the sink has only processed up to {last}")
        tables = ChangeApplier(cur, source, client)
        written = write.insert(sink_entries(batch, last, source, client, tables), hold=True)
        tables.flush()
        end = batch.end  # final now that the batch was read
        if end <= last:
            return last
        write.advance(end, written > 0, register, last=True)
        return end


def sink_entries(
    records: Iterable[LogRecord], last: int, source: str, client: str, tables: ChangeApplier | None
) -> Iterator[tuple[int, int, int, bytes]]:
    """The receive-queue form of the records after ``last`` (what the sink does not have yet);
    federated tables' changes are applied to their tables on the way, in the same transaction."""
    for record in records:
        if record.position > last and record.table_id is not None:
            assert tables is not None, "table changes are applied by a ChangeApplier"
            tables.add(record)
        elif record.position > last:
            kind, message = strip_destinations(record.message)
            if kind == MALFORMED:
                log.warning(
                    "entry %s at position %s from %s for client %s is malformed; passed on to the sink's dead letters",
                    record.entry_id,
                    record.position,
                    source,
                    client,
                )
            yield kind, record.position, record.entry_id, message


def new_sync_id() -> str:
    return str(uuid.uuid4())
