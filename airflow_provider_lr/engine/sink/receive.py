"""Delivery from a sink's receive queues ``LRQ_Recv_<client>_<source>`` to an application listener.

The replicator appends every session's entries to ``lr.receive_queue`` (``seq`` is the sink-side
order) and flips them ``visible`` when a snapshot or a log-entry batch is applied. This module is the
consumer side, shared by ``RoutingQueueSubscriber`` and the relay's subscriptions:

* discovery: a client's queues are found in ``lr.registry`` by the prefix ``LRQ_Recv_<client>_`` (the
  registry's ``client_name`` column disambiguates clients whose names share a prefix);
* delivery of one *run* per transaction: the leading entries of one kind of a queue's visible
  rows, in ``seq`` order (a row holds several entries: ``queue_rows``) and bounded. Markers
  (full-sync start and complete) are runs of one. The listener's ``True`` consumes the run in that
  same transaction (rows it finishes are deleted, a row it ends inside records how far it was
  delivered); ``False`` or an exception rolls it back, so the run is delivered again later and
  nothing behind it in that queue is delivered first;
* one consumer per queue at a time: a transaction-scoped advisory lock on the queue name, so two
  subscribers of one client never interleave a source's entries (they share the queues instead);
* malformed entries (protobuf that does not parse, an unknown or inconsistent kind) are moved to
  ``lr.receive_dead_letters`` with their error when they reach the head of the queue, one entry of
  a packed row alone, and delivery goes on.

During a callback, ``ReceiveQueueReader.conn`` is in the delivery transaction: whatever the listener
writes through it commits or rolls back together with the delete, which gives exactly-once.
"""
from __future__ import annotations

import itertools
import logging
import math
import os
import select
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol, Sequence

import psycopg2
import psycopg2.extensions
from google.protobuf.message import DecodeError

from airflow_provider_lr.engine.errors import MalformedEntryError, SiteUnreachableError
from airflow_provider_lr.engine.sink.queue_rows import unpack
from airflow_provider_lr.engine.vocabulary import CONSUMER_LOCK_CLASS, NOTIFY_CHANNEL, receive_queue_name
from airflow_provider_lr.proto import lr_pb2

log = logging.getLogger(__name__)

DEFAULT_BATCH = 500          # entries handed to the listener in one callback at most
# ...and bytes of entries read for one callback (at least one entry): what a delivery holds in memory
# is bounded by bytes, whatever the size of the entries (500 of 1 MiB would be 500 MiB, several times over).
DEFAULT_BATCH_BYTES = 8 << 20
# A head row's message comes with the cursor's rows only up to this size (every packed row: queue_rows
# keeps them under 7.9 kB); a larger one (a single large entry) is fetched by seq once the rows of the
# batch are known, so no fetch brings more than about the batch's byte budget.
INLINE_BYTES = 8192
DEFAULT_POLL_INTERVAL = 2.0  # full pass (discovery included) when no notification arrives
DEFAULT_RETRY_INTERVAL = 0.5  # a queue whose delivery failed is tried again after this
HEAD_FETCH = 16  # rows of a queue's head read first (then as many as the entries still wanted need)
PASS_RUNS = 8  # a follow loop looks at its stop event at least every this many full batches

START, SNAPSHOT, COMPLETE, LOG = (
    lr_pb2.SNAPSHOT_SYNC_START, lr_pb2.SNAPSHOT_SYNC, lr_pb2.LAST_FULL_SYNC_ENTRY, lr_pb2.LOG_ENTRY_SYNC,
)
KINDS = (START, SNAPSHOT, COMPLETE, LOG)


class Listener(Protocol):
    """What an application implements (DESIGN §5). Optional: ``on_error(source, error)``."""

    def on_snapshot_sync_start(self, source: str) -> Any: ...
    def on_snapshot_messages(self, source: str, payloads: list[bytes]) -> bool: ...
    def on_snapshot_sync_complete(self, source: str) -> Any: ...
    def on_log_entry_messages(self, source: str, payloads: list[bytes]) -> bool: ...


@dataclass
class DeliveryStats:
    """What delivery did; ``delivered`` counts queue entries acknowledged (markers included)."""

    delivered: int = 0
    refused: int = 0        # entries the listener returned False for (kept for redelivery)
    failures: int = 0       # listener exceptions (entries kept)
    dead_letters: int = 0   # malformed entries moved aside
    busy: int = 0           # queues skipped because another consumer held them
    errors: list[str] = field(default_factory=list)  # the most recent failures, newest last

    MAX_ERRORS = 20

    def add(self, other: "DeliveryStats") -> None:
        self.delivered += other.delivered
        self.refused += other.refused
        self.failures += other.failures
        self.dead_letters += other.dead_letters
        self.busy += other.busy
        self.errors = (self.errors + other.errors)[-self.MAX_ERRORS:]

    def note_error(self, text: str) -> None:
        self.errors = (self.errors + [text])[-self.MAX_ERRORS:]


@dataclass
class PassReport(DeliveryStats):
    """One delivery pass: the stats plus which queues still hold work (for the follow loop)."""

    unfinished: set[str] = field(default_factory=set)  # budget ran out with rows left
    failed: set[str] = field(default_factory=set)      # refused, raised or busy: retry later


@dataclass(frozen=True)
class _Row:
    """A receive-queue row as read: ``count`` entries packed (``queue_rows``), ``delivered`` of
    them consumed already."""

    seq: int
    kind: int
    count: int
    delivered: int
    message: bytes


@dataclass(frozen=True)
class _Entry:
    """One entry of a row (``index`` in it), its payload unwrapped, or why it cannot be delivered
    (``index`` -1: the whole row is unreadable)."""

    seq: int
    index: int
    kind: int
    payload: bytes
    error: str | None = None


class DeliveryContext:
    """The connection a consumer delivers on, for listener callbacks: writes made through it
    commit with the delete of the delivered entries or roll back with it (exactly once). Never
    commit or roll it back yourself."""

    _delivering: psycopg2.extensions.connection | None = None

    @property
    def connection(self) -> psycopg2.extensions.connection:
        if self._delivering is None:
            raise RuntimeError(f"{type(self).__name__}.connection is only available inside a listener callback")
        return self._delivering

    def cursor(self) -> psycopg2.extensions.cursor:
        """A cursor in the delivery transaction (inside a callback)."""
        return self.connection.cursor()

    def _set_delivering(self, conn: psycopg2.extensions.connection | None) -> None:
        self._delivering = conn


def queue_prefix(client: str) -> str:
    return receive_queue_name(client, "")


def discover(conn: psycopg2.extensions.connection, client: str) -> list[str]:
    """Sources whose receive queue for ``client`` is registered on this sink, sorted."""
    prefix = queue_prefix(client).replace("\\", "\\\\").replace("_", "\\_").replace("%", "\\%")
    with conn.cursor() as cur:
        cur.execute(
            "SELECT source_site_id FROM lr.registry WHERE kind = 'receive_queue' AND stream_name LIKE %s "
            "AND client_name = %s AND source_site_id IS NOT NULL ORDER BY 1",
            (prefix + "%", client),
        )
        sources = [r[0] for r in cur.fetchall()]
    conn.commit()
    return sources


class ReceiveQueueReader:
    """Delivers one client's receive queues on one sink connection (not thread-safe: one per thread)."""

    def __init__(self, conn: psycopg2.extensions.connection, batch_size: int = DEFAULT_BATCH,
                 batch_bytes: int = DEFAULT_BATCH_BYTES) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        if batch_bytes < 1:
            raise ValueError("batch_bytes must be at least 1")
        self.conn = conn
        self.batch_size = batch_size
        self.batch_bytes = batch_bytes

    def deliver(
        self,
        listener: Listener,
        client: str,
        sources: Iterable[str] | None = None,
        max_messages: int | None = None,
        skip: Iterable[str] = (),
        max_bytes: int | None = None,
    ) -> PassReport:
        """One pass over ``sources`` (default: every discovered queue of ``client``): each queue
        delivers runs in order until it is empty, a delivery fails, or the budget is spent
        (``max_messages`` entries, ``max_bytes`` bytes of payloads; a run takes at least one entry).
        Queues take turns run by run, so one long queue does not starve the others. ``skip``:
        queues waiting to be retried."""
        report = PassReport()
        budget = max_messages if max_messages is not None else float("inf")
        byte_budget = max_bytes if max_bytes is not None else float("inf")
        found = sorted(set(sources)) if sources is not None else discover(self.conn, client)
        skipped = set(skip)
        active = [s for s in found if s not in skipped]
        while active and budget > 0 and byte_budget > 0:
            for source in list(active):
                if budget <= 0 or byte_budget <= 0:
                    report.unfinished.update(active)
                    break
                handed, size, done = self._deliver_run(listener, client, source, int(min(budget, self.batch_size)),
                                                       report, int(min(byte_budget, self.batch_bytes)))
                budget -= handed
                byte_budget -= size
                if done:
                    active.remove(source)
        if budget <= 0 or byte_budget <= 0:
            report.unfinished.update(active)
        return report

    # --- one run ------------------------------------------------------------------------------
    def _deliver_run(
        self, listener: Listener, client: str, source: str, limit: int, report: PassReport,
        max_bytes: int | None = None,
    ) -> tuple[int, int, bool]:
        """Deliver the next run of ``source``'s queue (at most ``limit`` entries, read from at most
        ``max_bytes`` of rows, at least one); returns (entries handed over, their payload bytes,
        queue done for this pass). Malformed entries at the head are moved aside first (their own
        committed transaction)."""
        rows = self._lock_and_read(client, source, limit, max_bytes or self.batch_bytes)
        if rows is None:
            report.busy += 1
            report.failed.add(source)
            return 0, 0, True
        entries = _entries(rows, limit)
        if not entries:
            self.conn.commit()
            return 0, 0, True
        if entries[0].error is not None:
            bad = list(itertools.takewhile(lambda e: e.error is not None, entries))
            self._move_aside(client, source, rows, bad, report, listener)
            return 0, 0, False
        run = _leading_run(entries)
        payloads = [e.payload for e in run]
        del entries  # the run's payloads are all the callback needs
        size = sum(map(len, payloads))
        try:
            ok = _call(listener, run[0].kind, source, payloads)
        except Exception as exc:
            return self._failed(listener, client, source, len(run), report, "listener raised", exc), size, True
        if not ok:
            self._rollback()
            report.refused += len(run)
            report.failed.add(source)
            return len(run), size, True
        try:
            self._consume(rows, run)
            self.conn.commit()
        except (psycopg2.OperationalError, psycopg2.InterfaceError):
            raise  # a lost sink connection: the caller reconnects; the entries are still queued
        except psycopg2.Error as exc:  # e.g. the listener broke the transaction, then returned True
            return (self._failed(listener, client, source, len(run), report, "delivery transaction failed", exc),
                    size, True)
        report.delivered += len(run)
        return len(run), size, False

    def _consume(self, rows: Sequence[_Row], taken: Sequence[_Entry]) -> None:
        """Remove the leading ``taken`` entries from the queue: rows they finish are deleted, a row
        they end inside has its ``delivered`` advanced."""
        upto: dict[int, int | None] = {}  # seq -> entries of the row consumed after this (None: all)
        for entry in taken:
            upto[entry.seq] = entry.index + 1 if entry.index >= 0 else None
        finished, partial = [], None
        for row in rows:
            if row.seq not in upto:
                continue
            done = upto[row.seq]
            if done is None or done >= row.count:
                finished.append(row.seq)
            else:
                partial = (done, row.seq)
        with self.conn.cursor() as cur:
            if finished:
                cur.execute("DELETE FROM lr.receive_queue WHERE seq = ANY(%s)", (finished,))
            if partial is not None:
                cur.execute("UPDATE lr.receive_queue SET delivered = %s WHERE seq = %s", partial)

    def _failed(
        self, listener: Listener, client: str, source: str, count: int, report: PassReport, what: str, exc: Exception
    ) -> int:
        """Roll the delivery back and report it; the entries stay for redelivery."""
        self._rollback()
        report.failures += 1
        report.failed.add(source)
        text = f"{receive_queue_name(client, source)}: {what} {type(exc).__name__}: {exc}".strip()
        report.note_error(text)
        log.warning("%s (%d entries kept for redelivery)", text, count, exc_info=True)
        _on_error(listener, source, exc)
        return count

    def _lock_and_read(self, client: str, source: str, limit: int, max_bytes: int) -> list[_Row] | None:
        """Open the delivery transaction: take the queue's consumer lock (None if another consumer
        has it) and read the visible rows that hold its next ``limit`` entries (at most
        ``max_bytes`` of rows, at least one), in sink order. Rows behind a snapshot still being
        transferred (an invisible row with a lower seq) wait for it, so full-sync data stays ahead."""
        with self.conn.cursor() as cur:
            cur.execute(
                "SELECT pg_try_advisory_xact_lock(%s, hashtext(%s))",
                (CONSUMER_LOCK_CLASS, receive_queue_name(client, source)),
            )
            if not cur.fetchone()[0]:
                self.conn.rollback()
                return None
            cur.execute(
                "SELECT min(seq) FROM lr.receive_queue WHERE source_site_id = %s AND client_name = %s AND NOT visible",
                (source, client),
            )
            barrier = cur.fetchone()[0]
        return self._read_head(client, source, limit, barrier, max_bytes)

    def _read_head(self, client: str, source: str, limit: int, barrier: int | None,
                   max_bytes: int = DEFAULT_BATCH_BYTES) -> list[_Row]:
        """The visible rows before ``barrier`` that hold the queue's next ``limit`` entries, and no
        more than ``max_bytes`` of rows (at least one), in ``seq`` order: a cursor over the delivery
        index, fetched a few rows at a time (a row holds one entry or ~28), so neither one-entry
        rows nor packed ones read more than they need. Messages over ``INLINE_BYTES`` (single
        large entries) are left out of the cursor's rows and fetched by ``seq`` for the rows
        taken: no round trip brings much more than ``max_bytes``, whatever the entries' size."""
        heads: list[tuple[int, int, int, int, Any]] = []  # (seq, kind, count, delivered, message | None)
        wanted, per_row, taken = limit, 1.0, 0
        most = max(1, max_bytes // INLINE_BYTES)  # rows per fetch
        with self.conn.cursor(name="lr_receive_head") as cur:  # a cursor plan: the index, in order
            cur.execute(
                "SELECT seq, kind, entry_count, delivered, octet_length(message), "
                "CASE WHEN octet_length(message) <= %s THEN message END FROM lr.receive_queue "
                "WHERE client_name = %s AND source_site_id = %s AND visible ORDER BY seq",
                (INLINE_BYTES, client, source),
            )
            first = min(limit, HEAD_FETCH)
            full = False
            while not full:
                fetched = cur.fetchmany(min(most, first or max(1, math.ceil(wanted / per_row))))
                first = 0
                if not fetched:
                    break
                for seq, kind, count, delivered, size, message in fetched:
                    if (barrier is not None and seq >= barrier) or (heads and taken + size > max_bytes):
                        full = True
                        break
                    heads.append((seq, kind, count, delivered, message))
                    taken += size
                    wanted -= count - delivered
                    if wanted <= 0:
                        full = True
                        break
                per_row = max(1.0, (limit - wanted) / max(1, len(heads)))
        large: dict[int, Any] = {}
        wanted_large = [head[0] for head in heads if head[4] is None]
        if wanted_large:
            with self.conn.cursor() as cur:
                cur.execute("SELECT seq, message FROM lr.receive_queue WHERE seq = ANY(%s)", (wanted_large,))
                large = dict(cur.fetchall())
        rows: list[_Row] = []
        for seq, kind, count, delivered, message in heads:
            if message is None:
                message = large.pop(seq, None)
                if message is None:  # gone meanwhile (not by a consumer: they hold the queue's lock)
                    break
            rows.append(_Row(seq, kind, count, delivered, bytes(message)))
        return rows

    def _move_aside(
        self, client: str, source: str, rows: Sequence[_Row], bad: list[_Entry], report: PassReport,
        listener: Listener,
    ) -> None:
        with self.conn.cursor() as cur:
            for entry in bad:
                cur.execute(
                    "INSERT INTO lr.receive_dead_letters (seq, entry_index, source_site_id, client_name, kind, "
                    "message, error) VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (seq, entry_index) DO NOTHING",
                    (entry.seq, entry.index, source, client, entry.kind, psycopg2.Binary(entry.payload), entry.error),
                )
        self._consume(rows, bad)
        self.conn.commit()
        report.dead_letters += len(bad)
        for entry in bad:
            where = f"seq {entry.seq}" + ("" if entry.index < 0 else f" #{entry.index}")
            text = f"{receive_queue_name(client, source)}: entry {where} moved to lr.receive_dead_letters: {entry.error}"
            report.note_error(text)
            log.error(text)
            _on_error(listener, source, MalformedEntryError(text))

    def _rollback(self) -> None:
        if not self.conn.closed:
            self.conn.rollback()


def _entries(rows: Sequence[_Row], limit: int) -> list[_Entry]:
    """The next ``limit`` undelivered entries of ``rows``, in order, each decoded."""
    out: list[_Entry] = []
    for row in rows:
        if row.kind not in KINDS:
            out.append(_Entry(row.seq, -1, row.kind, row.message, f"unknown entry kind {row.kind}"))
            break
        try:
            messages = unpack(row.count, row.message)
        except ValueError as exc:
            out.append(_Entry(row.seq, -1, row.kind, row.message, str(exc)))
            break
        for index in range(row.delivered, row.count):
            out.append(_decode(row.seq, index, row.kind, messages[index]))
            if len(out) == limit:
                return out
    return out


def _decode(seq: int, index: int, kind: int, message: bytes) -> _Entry:
    """The entry with its payload unwrapped, or why it cannot be delivered."""
    try:
        msg = lr_pb2.RoutingTableEntryMsg.FromString(message)
    except (DecodeError, ValueError) as exc:
        return _Entry(seq, index, kind, message, f"malformed RoutingTableEntryMsg: {exc}")
    if msg.type != kind:
        return _Entry(seq, index, kind, message, f"entry kind {kind} but its message says type {msg.type}")
    return _Entry(seq, index, kind, msg.opaque_payload)


def _leading_run(entries: Sequence[_Entry]) -> list[_Entry]:
    """The first entry's kind, as many in a row as follow it (up to a malformed one); a marker is
    a run of one."""
    first = entries[0]
    if first.kind in (START, COMPLETE):
        return [first]
    run = [first]
    for entry in entries[1:]:
        if entry.kind != first.kind or entry.error is not None:
            break
        run.append(entry)
    return run


def _call(listener: Listener, kind: int, source: str, payloads: list[bytes]) -> bool:
    """Hand a run to its callback. Markers succeed unless the callback returns False explicitly;
    message callbacks must return a true value to acknowledge."""
    if kind == START:
        return listener.on_snapshot_sync_start(source) is not False
    if kind == COMPLETE:
        return listener.on_snapshot_sync_complete(source) is not False
    if kind == SNAPSHOT:
        return bool(listener.on_snapshot_messages(source, payloads))
    return bool(listener.on_log_entry_messages(source, payloads))


def _on_error(listener: Listener, source: str, exc: Exception) -> None:
    handler = getattr(listener, "on_error", None)
    if handler is None:
        return
    try:
        handler(source, exc)
    except Exception:  # a failing error handler must not stop delivery
        log.exception("listener.on_error raised")


# --- following new arrivals -------------------------------------------------------------------
ALL = None  # a wake-up that asks for a full pass (discovery included)


class Tap:
    """A LISTEN connection on ``lr_recv``, used by one thread, interruptible from any other.

    ``wait`` returns the (client, source) pairs notified ("<client>/<source>"), deduplicated, so
    a burst of commits on one queue is one wake-up. It opens the connection when ``wanted`` and
    closes it when not (a tap exists only while something is demanded). After every (re)open it
    returns ``ALL``: notifications sent while it was not listening were not seen."""

    def __init__(self, connect: Callable[[], psycopg2.extensions.connection]) -> None:
        self._connect = connect
        self._conn: psycopg2.extensions.connection | None = None
        self.wanted = True
        self._pipe_r, self._pipe_w = os.pipe()
        os.set_blocking(self._pipe_r, False)
        os.set_blocking(self._pipe_w, False)
        self._pipe_lock = threading.Lock()  # an fd closed by close() must never be written (reuse)
        self._closed = False

    @property
    def listening(self) -> bool:
        return self._conn is not None

    def interrupt(self) -> None:
        """Wake a ``wait`` in progress (thread-safe, never blocks)."""
        with self._pipe_lock:
            if self._closed:
                return
            try:
                os.write(self._pipe_w, b"x")
            except OSError:
                pass  # a wake-up is already pending

    def wait(self, timeout: float) -> list[tuple[str, str]] | None:
        """Notified (client, source) pairs within ``timeout`` seconds; [] on timeout or interrupt;
        ``ALL`` when the tap was just (re)opened or lost."""
        if self.wanted and self._conn is None:
            try:
                conn = self._connect()
                conn.autocommit = True
                with conn.cursor() as cur:
                    cur.execute(f"LISTEN {NOTIFY_CHANNEL}")
                self._conn = conn
            except (psycopg2.Error, SiteUnreachableError) as exc:  # a sink that is down: retried
                log.warning("receive-queue LISTEN connection failed (%s); polling until it is back", exc)
                self._select([], min(timeout, 0.5))
            return ALL
        if not self.wanted and self._conn is not None:
            self._drop()
        ready = self._select([self._conn] if self._conn is not None else [], timeout)
        if ready is None:
            self._drop()
            return ALL
        if self._conn is None or self._conn not in ready:
            return []
        try:
            self._conn.poll()
        except psycopg2.Error:
            self._drop()
            return ALL
        seen: dict[tuple[str, str], None] = {}
        for note in self._conn.notifies:
            client, _, source = note.payload.partition("/")
            seen[(client, source)] = None
        self._conn.notifies.clear()
        return list(seen)

    def _select(self, conns: list[Any], timeout: float) -> list[Any] | None:
        """Wait for the connections or an interrupt; drains the interrupt. None if select failed."""
        try:
            ready, _, _ = select.select([self._pipe_r, *conns], [], [], max(timeout, 0.0))
        except (OSError, ValueError, psycopg2.Error):
            return None
        if self._pipe_r in ready:
            try:
                while os.read(self._pipe_r, 4096):
                    pass
            except OSError:
                pass
        return ready

    def _drop(self) -> None:
        if self._conn is not None and not self._conn.closed:
            try:
                self._conn.close()
            except psycopg2.Error:
                pass
        self._conn = None

    def close(self) -> None:
        """Close the connection and the interrupt pipe (call from the thread that waits, or after it)."""
        with self._pipe_lock:
            if self._closed:
                return
            self._closed = True
            for fd in (self._pipe_r, self._pipe_w):
                os.close(fd)
        self._drop()


class Wakeups(Protocol):
    """Where a follow loop learns that queues have news: sources of its client, or ``ALL``."""

    def wait(self, timeout: float) -> set[str] | None: ...


@dataclass(frozen=True)
class Demand:
    """What a consumer wants: one client's queues, from every source (``sources=None``: the
    discovered ones, new ones included) or from the named sources only."""

    client: str
    sources: frozenset[str] | None = None

    def wants(self, client: str, source: str) -> bool:
        return client == self.client and (self.sources is None or source in self.sources)

    def narrow(self, sources: Iterable[str] | None) -> Iterable[str] | None:
        """The sources to look at for a wake-up (``None``: a full pass)."""
        if sources is None:
            return None if self.sources is None else sorted(self.sources)
        return sorted(s for s in sources if self.sources is None or s in self.sources)


def follow(
    connect: Callable[[], psycopg2.extensions.connection],
    listener: Listener,
    demand: Callable[[], Demand],
    wakeups: Wakeups,
    stop: threading.Event,
    stats: DeliveryStats,
    batch_size: int = DEFAULT_BATCH,
    poll_interval: float = DEFAULT_POLL_INTERVAL,
    retry_interval: float = DEFAULT_RETRY_INTERVAL,
    on_conn: Callable[[psycopg2.extensions.connection | None], None] | None = None,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
) -> None:
    """Deliver until ``stop``: a full pass first and every ``poll_interval`` (discovery: sources that
    appear are found without a restart), a pass over the woken queues on each wake-up, and queues
    whose delivery failed again after ``retry_interval`` (not before: a failing listener is not
    hammered). A lost sink connection is reopened; nothing is lost, undelivered rows stay queued.
    A pass hands over at most ``PASS_RUNS`` batches' worth of entries and of bytes before ``stop``
    is looked at again."""
    conn: psycopg2.extensions.connection | None = None
    todo: set[str] | None = None  # None: a full pass is due
    retry: set[str] = set()
    next_full = next_retry = 0.0
    try:
        while not stop.is_set():
            now = time.monotonic()
            if now >= next_full:
                todo, next_full = None, now + poll_interval
            waiting: set[str] = set()
            if retry and now >= next_retry:
                if todo is not None:
                    todo |= retry
                retry = set()
            else:
                waiting = retry
            want = demand()
            sources = want.narrow(todo)
            todo = set()
            if sources is None or sources:
                try:
                    if conn is None or conn.closed:
                        conn = connect()
                        if on_conn:
                            on_conn(conn)
                    report = ReceiveQueueReader(conn, batch_size, batch_bytes).deliver(
                        listener, want.client, sources, max_messages=PASS_RUNS * batch_size, skip=waiting,
                        max_bytes=PASS_RUNS * batch_bytes,
                    )
                except (psycopg2.OperationalError, psycopg2.InterfaceError, SiteUnreachableError) as exc:
                    stats.failures += 1
                    stats.note_error(f"sink connection lost: {exc}".strip())
                    log.warning("receive-queue delivery: sink connection lost (%s); reconnecting", exc)
                    conn = _close(conn, on_conn)
                    next_full = time.monotonic() + retry_interval
                    stop.wait(retry_interval)
                    continue
                stats.add(report)
                if report.failed:
                    if not retry:
                        next_retry = time.monotonic() + retry_interval
                    retry |= report.failed
                if report.unfinished:
                    todo = set(report.unfinished)
                    continue  # more is waiting now: no sleep
            deadline = min(next_full, next_retry) if retry else next_full
            woken = wakeups.wait(max(0.0, deadline - time.monotonic()))
            if woken is ALL:
                next_full = 0.0
            else:
                todo |= set(woken) - retry
    finally:
        _close(conn, on_conn)


def _close(
    conn: psycopg2.extensions.connection | None,
    on_conn: Callable[[psycopg2.extensions.connection | None], None] | None,
) -> None:
    """Forget and close a delivery connection (``None``, for ``conn = _close(...)``)."""
    if on_conn:
        on_conn(None)
    if conn is not None and not conn.closed:
        try:
            conn.close()
        except psycopg2.Error:
            pass
    return None


class TapWakeups:
    """Wake-ups for one consumer that owns its own tap (``RoutingQueueSubscriber.run``)."""

    SLICE = 0.1  # how often the caller's stop event is looked at while waiting

    def __init__(self, tap: Tap, demand: Callable[[], Demand], stop: threading.Event) -> None:
        self.tap, self.demand, self.stop = tap, demand, stop

    def wait(self, timeout: float) -> set[str] | None:
        end = time.monotonic() + timeout
        while not self.stop.is_set():
            notes = self.tap.wait(min(self.SLICE, max(0.0, end - time.monotonic())))
            if notes is ALL:
                return ALL
            want = self.demand()
            sources = {s for c, s in notes if want.wants(c, s)}
            if sources or time.monotonic() >= end:
                return sources
        return set()
