"""The sink end of a session: its metadata, and every write into its receive queue.

Each function is one sink transaction that first locks the session's metadata row and checks the
writer's lease epoch (fencing: a replicator whose lease was taken over can never write again),
then writes data and metadata together, so a crash anywhere leaves either both or neither.
Log-entry batches are idempotent through ``last_log_entry_processed`` (a replay or an overlap
writes only what is new); snapshot messages through the source entry id they end at.
"""
from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, fields, replace
from typing import Iterable, Iterator, Sequence

import psycopg2.extensions
from psycopg2.extensions import AsIs
from psycopg2.extras import execute_values

from airflow_provider_lr.engine.errors import ConfigurationError, FencedError, StaleBatchError
from airflow_provider_lr.engine.sink.queue_rows import Packer
from airflow_provider_lr.engine.source.log_reader import BaseSplit, LogBatch, LogRecord, LogStream
from airflow_provider_lr.engine.store.topology import config_id
from airflow_provider_lr.engine.tables.sink import ChangeApplier, forget_session
from airflow_provider_lr.engine.vocabulary import MALFORMED, NOTIFY_CHANNEL, SessionKey, receive_queue_name
from airflow_provider_lr.engine.vocabulary import strip_destinations, wakeup_payload
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


_COLUMNS = [f.name for f in fields(SinkMetadata) if f.name != "site_topology_config_id"]
_SELECT = f"SELECT {', '.join(_COLUMNS)} FROM lr.sink_sessions WHERE source_site_id = %s AND client_name = %s"


def _metadata(row: tuple, site_topology: str | None = None) -> SinkMetadata:
    values = dict(zip(_COLUMNS, row))
    if values["snapshot_request_id"] is not None:
        values["snapshot_request_id"] = str(values["snapshot_request_id"])
    return SinkMetadata(**values, site_topology_config_id=site_topology)


def metadata_in(cur: psycopg2.extensions.cursor, source: str, client: str) -> SinkMetadata | None:
    """The session's metadata as ``cur``'s transaction sees it (None: no such session); no row made."""
    cur.execute(_SELECT, (source, client))
    row = cur.fetchone()
    return None if row is None else _metadata(row)


def _sink_id(cur: psycopg2.extensions.cursor) -> str:
    """This site's id, for messages."""
    cur.execute("SELECT site_id FROM lr.site_info")
    return (cur.fetchone() or ("this sink",))[0]


def read_metadata(conn: psycopg2.extensions.connection, source: str, client: str) -> SinkMetadata:
    """The sink's metadata for a session (created on first contact), with the sink site's topology id."""
    try:
        with conn.cursor() as cur:
            cur.execute(
                "INSERT INTO lr.sink_sessions (source_site_id, client_name) VALUES (%s, %s) ON CONFLICT DO NOTHING",
                (source, client),
            )
            cur.execute(_SELECT, (source, client))
            row = cur.fetchone()
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


class SinkTransaction:
    """One fenced sink transaction: ``open`` locks the session row and checks the writer's lease
    epoch (a replicator whose lease was taken over is refused before it writes anything), the
    writes follow, then ``commit`` or ``abort``. As a context manager
    (``with SinkTransaction(...) as (cur, meta)``) it commits on a clean exit and aborts on an
    exception; the fan-out calls the methods itself, its transactions span a whole chunk's read."""

    cur: psycopg2.extensions.cursor  # the transaction's cursor, from ``open`` on

    def __init__(self, conn: psycopg2.extensions.connection, source: str, client: str, epoch: int) -> None:
        self.conn, self.source, self.client, self.epoch = conn, source, client, epoch

    def open(self) -> SinkMetadata:
        """Lock the session's row (a concurrent writer of the session waits here), refuse a stale
        epoch, raise the sink's epoch to ours; the sink's metadata as it stands under the lock."""
        self.cur = self.conn.cursor()
        try:
            self.cur.execute(  # one round trip: the row made if missing, then locked and read
                "INSERT INTO lr.sink_sessions (source_site_id, client_name) VALUES (%s, %s) ON CONFLICT DO NOTHING; "
                + _SELECT + " FOR UPDATE",
                (self.source, self.client, self.source, self.client),
            )
            meta = _metadata(self.cur.fetchone())
            if meta.failed_over_to is not None:
                here = _sink_id(self.cur)
                raise FencedError(
                    f"session {SessionKey(self.source, here, self.client)} was failed over: {self.client!r} now "
                    f"comes from {meta.failed_over_to!r} (`lr failover`); {self.source!r} writes no more here, "
                    f"whatever its epoch (rejoin it with `lr failover --rejoin {self.source}`)"
                )
            if meta.lease_epoch > self.epoch:
                here = _sink_id(self.cur)
                raise FencedError(
                    f"session {SessionKey(self.source, here, self.client)}: lease epoch {self.epoch} is stale "
                    f"(the sink has seen epoch {meta.lease_epoch}); another replicator owns this session",
                    sink_epoch=meta.lease_epoch,
                )
            if meta.lease_epoch < self.epoch:
                self.cur.execute(
                    "UPDATE lr.sink_sessions SET lease_epoch = %s WHERE source_site_id = %s AND client_name = %s",
                    (self.epoch, self.source, self.client),
                )
            return meta
        except BaseException:
            self.cur.close()
            if not self.conn.closed:
                self.conn.rollback()
            raise

    def commit(self) -> None:
        """Make data and metadata visible together."""
        try:
            self.conn.commit()
        finally:
            self.cur.close()

    def abort(self) -> None:
        """Roll back: nothing of the transaction becomes visible."""
        try:
            if not self.conn.closed:  # a lost server: keep its error, not the rollback's
                self.conn.rollback()
        finally:
            self.cur.close()

    def __enter__(self) -> tuple[psycopg2.extensions.cursor, SinkMetadata]:
        meta = self.open()
        return self.cur, meta

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()

    def update(self, **values: object) -> None:
        sets = ", ".join(f"{k} = %s" for k in values)
        self.cur.execute(
            f"UPDATE lr.sink_sessions SET {sets}, updated_at = now() WHERE source_site_id = %s AND client_name = %s",
            (*values.values(), self.source, self.client),
        )

    def advance(self, end: int, wrote: bool, register: bool = True) -> None:
        """Record a log-entry batch's end; when it ``wrote`` entries, also register the queue (see
        ``announce``) and wake the subscribers at commit: position and wake-up in one round trip."""
        if wrote and register:
            self.register()
        wake = "; SELECT pg_notify(%s, %s)" if wrote else ""
        self.cur.execute(
            "UPDATE lr.sink_sessions SET last_log_entry_processed = %s, updated_at = now() "
            "WHERE source_site_id = %s AND client_name = %s" + wake,
            (end, self.source, self.client) + ((NOTIFY_CHANNEL, wakeup_payload(self.client, self.source)) if wrote else ()),
        )

    def metadata(self) -> SinkMetadata:
        """The session's metadata as this transaction has just written it: what the caller goes on from."""
        self.cur.execute(_SELECT, (self.source, self.client))
        return _metadata(self.cur.fetchone())

    def insert(self, entries: Iterable[tuple[int, int, int, bytes]], sync_id: str | None = None,
               visible: bool = True) -> int:
        """Entries (kind, position, entry id, message) appended in order, packed into receive-queue
        rows (``queue_rows``): ``seq`` follows the order. Returns how many were written.

        ``entries`` may be a stream (``LogStream``): rows are sent every ``INSERT_BYTES`` (or
        ``INSERT_ENTRIES``) in this same transaction, so a batch of any size costs a few MiB here."""
        rows: list[tuple] = []
        packer = Packer(lambda r: rows.append((self.source, self.client, r.kind, r.position, r.entry_id, sync_id,
                                               visible, r.count, psycopg2.Binary(r.message))))
        waiting = 0  # bytes added since the last flush
        for entry in entries:
            packer.add(*entry)
            waiting += len(entry[3])
            if waiting >= INSERT_BYTES or len(packer.pending) >= INSERT_ENTRIES:
                packer.flush(final=False)  # the unfinished last pack waits for more
                self._send(rows)
                waiting = sum(len(p[0]) for p in packer.pending)
        packer.flush()
        self._send(rows)
        return packer.entries

    def _send(self, rows: list[tuple]) -> None:
        """INSERT the formed rows (then forget them)."""
        if not rows:
            return
        execute_values(
            self.cur,
            "INSERT INTO lr.receive_queue (source_site_id, client_name, kind, source_position, source_entry_id, "
            "sync_id, visible, entry_count, message) VALUES %s",
            rows,
            template="(%s, %s, %s, %s, %s, %s::uuid, %s, %s, %s)",
            page_size=1000,
        )
        rows.clear()

    def register(self) -> None:
        """Register the receive queue so subscribers discover it by prefix (idempotent). A name
        once registered for another session (client ``a_b`` from ``c``, then client ``a`` from
        ``b_c`` in a later topology) is taken over when nothing of that session waits in the
        queue; otherwise the write is refused: registering nothing would hide this session's
        data from its subscribers."""
        name = receive_queue_name(self.client, self.source)
        self.cur.execute(
            "INSERT INTO lr.registry (stream_name, kind, stream_tags, source_site_id, client_name) "
            "VALUES (%s, 'receive_queue', ARRAY[%s], %s, %s) ON CONFLICT (stream_name) DO NOTHING",
            (name, f"lrq_recv_{self.client}", self.source, self.client),
        )
        self.cur.execute("SELECT source_site_id, client_name FROM lr.registry WHERE stream_name = %s", (name,))
        owner = tuple(self.cur.fetchone())
        if owner == (self.source, self.client):
            return
        self.cur.execute("SELECT 1 FROM lr.receive_queue WHERE source_site_id = %s AND client_name = %s LIMIT 1", owner)
        if self.cur.fetchone() is not None:
            raise ConfigurationError(
                f"receive queue {name!r} on this sink still holds entries of client {owner[1]!r} from {owner[0]!r}; "
                f"client {self.client!r} from {self.source!r} would get the same queue name. Let the subscribers "
                "drain it, or rename the client or site (avoid '_' in their names)"
            )
        self.cur.execute(
            "UPDATE lr.registry SET kind = 'receive_queue', stream_tags = ARRAY[%s], source_site_id = %s, "
            "client_name = %s WHERE stream_name = %s",
            (f"lrq_recv_{self.client}", self.source, self.client, name),
        )

    def announce(self) -> None:
        """Register the receive queue (first write after any restart) and wake subscribers at commit."""
        self.register()
        self.cur.execute("SELECT pg_notify(%s, %s)", (NOTIFY_CHANNEL, wakeup_payload(self.client, self.source)))


def fence(conn: psycopg2.extensions.connection, source: str, client: str, epoch: int) -> SinkMetadata:
    """Raise the session's lease epoch on the sink to ``epoch`` and return the sink's metadata (with
    the sink site's topology id). A new lease holder calls this before it decides anything: from
    then on a replicator whose lease ran out mid-cycle can no longer write here, so the decision is
    taken on metadata no stale writer can change behind it."""
    write = SinkTransaction(conn, source, client, epoch)
    with write as (cur, meta):
        return replace(meta, lease_epoch=epoch, site_topology_config_id=config_id(cur))


def discard_staged(cur: psycopg2.extensions.cursor, source: str, client: str) -> None:
    """Drop everything Spark jobs staged for the session on this sink and never moved into its
    receive queue (``lr.spark_staging``: fan-out packs and snapshot data, and their range records).
    Staged rows are never visible: once the session moves on (a fan-out plan starts or ends, a
    snapshot sync starts or is applied) what a failed, abandoned or superseded job left there is
    dead weight. Called inside the session's fenced sink transaction; a job fenced out by it cannot
    publish or move what it stages later (the next of these calls drops that; a snapshot transfer's
    stage for a sync the sink no longer transfers rolls itself back: ``snapshot_transfer.stage_range``)."""
    cur.execute("DELETE FROM lr.spark_staging WHERE source_site_id = %s AND client_name = %s", (source, client))
    cur.execute("DELETE FROM lr.spark_staged_ranges WHERE source_site_id = %s AND client_name = %s", (source, client))


def discard_unapplied(cur: psycopg2.extensions.cursor, source: str, client: str) -> None:
    """Drop what the session holds on this sink that was never made visible: the rows of a full sync
    not applied (they stay invisible unless it is) and what Spark jobs staged (``discard_staged``).
    Called inside the session's fenced sink transaction when that data can no longer be applied: a
    newer sync starts, or the session is failed over (``site.failover``)."""
    cur.execute("DELETE FROM lr.receive_queue WHERE source_site_id = %s AND client_name = %s AND NOT visible",
                (source, client))
    discard_staged(cur, source, client)


def start_snapshot(
    conn: psycopg2.extensions.connection,
    source: str,
    client: str,
    epoch: int,
    sync_id: str,
    base: int,
    split: BaseSplit,
    topology_config_id: str,
) -> SinkMetadata:
    """SNAPSHOT_START: record the new sync and discard any unapplied data of an older one (and
    whatever Spark jobs left staged for the session).
    Repeating it for the sync already started is a no-op, so an interrupted transfer resumes; a
    sync this sink has already applied is refused (taking it for a resume would apply nothing and
    continue from its old base), and so is one whose base is behind the position the sink has
    processed (supplied while the session still streamed: a sink never moves backwards, so no
    entry is delivered twice)."""
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
        write.register()  # the first write of a snapshot sync registers the queue (seed 000)
        forget_session(cur, source, client)  # its federated tables take new snapshots after this one
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
            raise StaleBatchError(
                f"snapshot data of sync {sync_id} for a sink now on sync {meta.snapshot_request_id}"
            )
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
        cur.execute(
            "UPDATE lr.receive_queue SET visible = true "
            "WHERE source_site_id = %s AND client_name = %s AND sync_id = %s AND NOT visible",
            (source, client, meta.snapshot_request_id),
        )
        discard_staged(cur, source, client)  # a Spark transfer of it abandoned, then the sync moved in process
        write.update(
            snapshot_applied=meta.snapshot_started,
            last_log_entry_processed=meta.snapshot_started,
            data_consistent=True,
            snapshot_completed_at=AsIs("now()"),
        )
        write.announce()
        return write.metadata()


def apply_log_entries(
    conn: psycopg2.extensions.connection,
    source: str,
    client: str,
    epoch: int,
    after: int,
    end: int,
    records: Sequence[LogRecord],
    base: int,
) -> int:
    """Apply a log-entry batch covering positions ``(after, end]``; returns the sink's last processed
    position. A batch already applied is a no-op; an overlapping one writes only the new entries;
    one that would leave a gap, or belongs to another snapshot base, is refused."""
    return apply_log_stream(conn, source, client, epoch, LogBatch(after, end, list(records)), base)


def apply_log_stream(
    conn: psycopg2.extensions.connection,
    source: str,
    client: str,
    epoch: int,
    batch: LogBatch | LogStream,
    base: int,
    register: bool = True,
) -> int:
    """``apply_log_entries`` for a batch read as it is written (``LogReader.read_stream``): its
    entries go into ONE sink transaction in pieces, with ``last_log_entry_processed = batch.end``
    set at the end, so a source transaction of any size becomes visible on the sink whole (DESIGN
    §6 property 2) while only a few MiB of it are in memory at a time. ``register=False``: the queue
    is registered already (a stream registers it with its first write)."""
    write = SinkTransaction(conn, source, client, epoch)
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
        written = write.insert(_sink_entries(batch, last, source, client, tables))
        tables.flush()
        end = batch.end  # final now that the batch was read
        if end <= last:
            return last
        write.advance(end, written > 0, register)
        return end


def _sink_entries(records: Iterable[LogRecord], last: int, source: str, client: str,
                  tables: ChangeApplier) -> Iterator[tuple[int, int, int, bytes]]:
    """The receive-queue form of the records after ``last`` (what the sink does not have yet);
    federated tables' changes are applied to their tables on the way, in the same transaction."""
    for record in records:
        if record.position > last and record.table_id is not None:
            tables.add(record)
        elif record.position > last:
            kind, message = strip_destinations(record.message)
            if kind == MALFORMED:
                log.warning("entry %s at position %s from %s for client %s is malformed; passed on to the "
                            "sink's dead letters", record.entry_id, record.position, source, client)
            yield kind, record.position, record.entry_id, message


def new_sync_id() -> str:
    return str(uuid.uuid4())
