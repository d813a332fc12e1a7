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
writes through it commits or rolls back together with the delete, which gives exactly-once
(``delivery_transaction``: its round trips, and what a listener may do to the connection).

When a consumer looks at its queues (NOTIFY wake-ups, retries, the periodic full pass) is
``wakeup``'s business: this module delivers whatever it is asked to, once.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import psycopg2
import psycopg2.extensions
from google.protobuf.message import DecodeError

from airflow_provider_lr.engine.db.encoding import storable
from airflow_provider_lr.engine.errors import ConfigurationError, MalformedEntryError, one_line, require_counts
from airflow_provider_lr.engine.sink.delivery_transaction import DeliveryTransaction
from airflow_provider_lr.engine.sink.queue_rows import unpack
from airflow_provider_lr.engine.store import receive_queue
from airflow_provider_lr.engine.vocabulary import receive_queue_name
from airflow_provider_lr.proto import lr_pb2

log = logging.getLogger(__name__)

DEFAULT_BATCH = 500  # entries handed to the listener in one callback at most
# ...and bytes of entries read for one callback (at least one entry): what a delivery holds in memory
# is bounded by bytes, whatever the size of the entries (500 of 1 MiB would be 500 MiB, several times over).
DEFAULT_BATCH_BYTES = 8 << 20
# A head row's message comes with the cursor's rows only up to this size (every packed row: queue_rows
# keeps them under 7.9 kB); a larger one (a single large entry) is fetched by seq once the rows of the
# batch are known, so no fetch brings more than about the batch's byte budget.
INLINE_BYTES = 8192
HEAD_FETCH = 16  # rows of a queue's head read first (then as many as the entries still wanted need)
_HEAD_CURSOR = "lr_receive_head"  # the cursor over a longer head (it ends with the delivery transaction)

START, SNAPSHOT, COMPLETE, LOG = (
    lr_pb2.SNAPSHOT_SYNC_START,
    lr_pb2.SNAPSHOT_SYNC,
    lr_pb2.LAST_FULL_SYNC_ENTRY,
    lr_pb2.LOG_ENTRY_SYNC,
)
KINDS = (START, SNAPSHOT, COMPLETE, LOG)


class Listener(Protocol):
    """What an application implements (the README's user path, docs/subscriber.md). Optional: ``on_error(source, error)``."""

    def on_snapshot_sync_start(self, source: str) -> Any: ...
    def on_snapshot_messages(self, source: str, payloads: list[bytes]) -> bool: ...
    def on_snapshot_sync_complete(self, source: str) -> Any: ...
    def on_log_entry_messages(self, source: str, payloads: list[bytes]) -> bool: ...


CALLBACKS = ("on_snapshot_sync_start", "on_snapshot_messages", "on_snapshot_sync_complete", "on_log_entry_messages")


def require_listener(listener: object) -> None:
    """Refuse, before anything is delivered, a listener without the callbacks delivery calls: it was
    found out only when an entry of that kind came (a full sync's start, say, months later), then as
    an AttributeError each pass, the entries kept for redelivery forever."""
    missing = [name for name in CALLBACKS if not callable(getattr(listener, name, None))]
    if missing:
        raise ConfigurationError(
            f"the listener ({type(listener).__name__}) lacks {', '.join(missing)}: a listener has all of "
            f"{', '.join(CALLBACKS)} (docs/subscriber.md)"
        )


@dataclass
class DeliveryStats:
    """What delivery did; ``delivered`` counts queue entries acknowledged (markers included)."""

    delivered: int = 0
    refused: int = 0  # entries the listener returned False for (kept for redelivery)
    failures: int = 0  # listener exceptions (entries kept)
    dead_letters: int = 0  # malformed entries moved aside
    busy: int = 0  # queues skipped because another consumer held them
    errors: list[str] = field(default_factory=list)  # the most recent failures, newest last

    MAX_ERRORS = 20

    def add(self, other: DeliveryStats) -> None:
        self.delivered += other.delivered
        self.refused += other.refused
        self.failures += other.failures
        self.dead_letters += other.dead_letters
        self.busy += other.busy
        self.errors = (self.errors + other.errors)[-self.MAX_ERRORS :]

    def note_error(self, text: str) -> None:
        self.errors = (self.errors + [text])[-self.MAX_ERRORS :]


@dataclass
class PassReport(DeliveryStats):
    """One delivery pass: the stats plus which queues still hold work (for the follow loop)."""

    unfinished: set[str] = field(default_factory=set)  # budget ran out with rows left
    failed: set[str] = field(default_factory=set)  # refused, raised or busy: retry later


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
    end its transaction yourself (``delivery_transaction``: what a listener may do to it)."""

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
            "SELECT source_site_id FROM lr.registry WHERE kind OPERATOR(pg_catalog.=) 'receive_queue' "
            "AND stream_name OPERATOR(pg_catalog.~~) %s AND client_name OPERATOR(pg_catalog.=) %s "
            "AND source_site_id IS NOT NULL ORDER BY 1",
            (prefix + "%", client),
        )
        sources = [r[0] for r in cur.fetchall()]
    conn.commit()
    return sources


class ReceiveQueueReader:
    """Delivers one client's receive queues on one sink connection (not thread-safe: one per thread)."""

    def __init__(
        self,
        conn: psycopg2.extensions.connection,
        batch_size: int = DEFAULT_BATCH,
        batch_bytes: int = DEFAULT_BATCH_BYTES,
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        if batch_bytes < 1:
            raise ValueError("batch_bytes must be at least 1")
        self.conn = conn
        self.batch_size = batch_size
        self.batch_bytes = batch_bytes
        self._tx = DeliveryTransaction(conn)  # the current delivery's

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
        queues waiting to be retried. A budget not a whole number of at least 1 is refused
        (``require_counts``): 1.5 failed mid-pass (IndexError), '5' as a TypeError, 0 or -1 delivered
        nothing, silently, and True one entry."""
        require_counts(max_messages=max_messages, max_bytes=max_bytes)
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
                handed, size, done = self._deliver_run(
                    listener,
                    client,
                    source,
                    int(min(budget, self.batch_size)),
                    report,
                    int(min(byte_budget, self.batch_bytes)),
                )
                budget -= handed
                byte_budget -= size
                if done:
                    active.remove(source)
        if budget <= 0 or byte_budget <= 0:
            report.unfinished.update(active)
        return report

    # --- one run ------------------------------------------------------------------------------
    def _deliver_run(
        self, listener: Listener, client: str, source: str, limit: int, report: PassReport, max_bytes: int | None = None
    ) -> tuple[int, int, bool]:
        """Deliver the next run of ``source``'s queue (at most ``limit`` entries, read from at most
        ``max_bytes`` of rows, at least one); returns (entries handed over, their payload bytes,
        queue done for this pass). Malformed entries at the head are moved aside first (their own
        committed transaction)."""
        head = self._lock_and_read(client, source, limit, max_bytes or self.batch_bytes)
        if head is None:
            report.busy += 1
            report.failed.add(source)
            return 0, 0, True
        rows, whole = head
        entries = _entries(rows, limit)
        if not entries:
            self._tx.rollback()  # the lock is all the transaction holds
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
            self._tx.check()
        except Exception as exc:
            return self._failed(listener, client, source, len(run), report, "listener raised", exc), size, True
        if not ok:
            self._tx.rollback()
            report.refused += len(run)
            report.failed.add(source)
            return len(run), size, True
        try:
            self._consume(rows, run)
        except (psycopg2.OperationalError, psycopg2.InterfaceError):
            raise  # a lost sink connection: the caller reconnects; the entries are still queued
        except psycopg2.Error as exc:  # e.g. the listener broke the transaction, then returned True
            return (
                self._failed(listener, client, source, len(run), report, "delivery transaction failed", exc),
                size,
                True,
            )
        report.delivered += len(run)
        # the read saw the whole queue and this run took all of it: done, without reading it again
        # (what arrives meanwhile comes with its own wake-up)
        return len(run), size, whole and len(run) == sum(r.count - r.delivered for r in rows)

    def _consume(self, rows: Sequence[_Row], taken: Sequence[_Entry]) -> None:
        """Remove the leading ``taken`` entries from the queue and commit: rows they finish are
        deleted, a row they end inside has its ``delivered`` advanced."""
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
        self._tx.consume(finished, partial)

    def _failed(
        self, listener: Listener, client: str, source: str, count: int, report: PassReport, what: str, exc: Exception
    ) -> int:
        """Roll the delivery back and report it; the entries stay for redelivery."""
        self._tx.rollback()
        report.failures += 1
        report.failed.add(source)
        text = one_line(f"{receive_queue_name(client, source)}: {what} {type(exc).__name__}: {exc}")
        report.note_error(text)
        log.warning("%s (%d entries kept for redelivery)", text, count, exc_info=True)
        _on_error(listener, source, exc)
        return count

    def _lock_and_read(self, client: str, source: str, limit: int, max_bytes: int) -> tuple[list[_Row], bool] | None:
        """Open the delivery transaction (``delivery_transaction``): take the queue's consumer lock
        (None if another consumer has it) and read the visible rows that hold its next ``limit``
        entries (at most ``max_bytes`` of rows, at least one), in sink order; True with them when
        they are all the queue holds. Rows behind a snapshot still being transferred (an invisible
        row with a lower seq) wait for it, so full-sync data stays ahead."""
        self._tx = DeliveryTransaction(self.conn)
        opened = self._tx.open(source, client, INLINE_BYTES, min(limit, HEAD_FETCH, max(1, max_bytes // INLINE_BYTES)))
        if opened is None:
            return None
        barrier, fetched = opened
        return self._read_head(client, source, limit, barrier, max_bytes, fetched)

    def _read_head(
        self, client: str, source: str, limit: int, barrier: int | None, max_bytes: int, fetched: list[tuple]
    ) -> tuple[list[_Row], bool]:
        """The visible rows before ``barrier`` that hold the queue's next ``limit`` entries, and no
        more than ``max_bytes`` of rows (at least one), in ``seq`` order: the first few rows
        (``fetched``, read with the lock), then (a longer head) a cursor over the delivery index,
        fetched a few rows at a time (a row holds one entry or ~28), so neither one-entry rows nor
        packed ones read more than they need. Messages over ``INLINE_BYTES`` (single large entries)
        are left out of the cursor's rows and fetched by ``seq`` for the rows taken: no round trip
        brings much more than ``max_bytes``, whatever the entries' size."""
        heads: list[tuple[int, int, int, int, Any]] = []  # (seq, kind, count, delivered, message | None)
        wanted, taken = limit, 0
        most = max(1, max_bytes // INLINE_BYTES)  # rows per fetch

        def take(fetched: list[tuple], size: int) -> tuple[bool, bool]:
            """Take fetched rows while they fit; (full: take no more, whole: the queue ran out)."""
            nonlocal wanted, taken
            whole = len(fetched) < size  # the read ran out: these are the queue's last rows
            for n, (seq, kind, count, delivered, length, message) in enumerate(fetched):
                if (barrier is not None and seq >= barrier) or (heads and taken + length > max_bytes):
                    return True, False
                heads.append((seq, kind, count, delivered, message))
                taken += length
                wanted -= count - delivered
                if wanted <= 0:
                    return True, whole and n == len(fetched) - 1
            return whole, whole

        full, whole = take(fetched, min(limit, HEAD_FETCH, most))
        if not full:  # a longer head: a cursor over the delivery index, in order, after what was taken
            with self.conn.cursor() as cur:
                declare = receive_queue.declare_head(cur, _HEAD_CURSOR, source, client, INLINE_BYTES, heads[-1][0])
                while not full:
                    per_row = max(1.0, (limit - wanted) / max(1, len(heads)))
                    size = min(most, max(1, math.ceil(wanted / per_row)))
                    cur.execute(declare + f"FETCH FORWARD {size} FROM {_HEAD_CURSOR}".encode())  # DECLARE rides along
                    declare = b""
                    full, whole = take(cur.fetchall(), size)
        large: dict[int, Any] = {}
        wanted_large = [head[0] for head in heads if head[4] is None]
        if wanted_large:
            with self.conn.cursor() as cur:
                large = receive_queue.messages(cur, wanted_large)
        rows: list[_Row] = []
        for seq, kind, count, delivered, message in heads:
            if message is None:
                message = large.pop(seq, None)
                if message is None:  # gone meanwhile (not by a consumer: they hold the queue's lock)
                    break
            rows.append(_Row(seq, kind, count, delivered, bytes(message)))
        return rows, whole and len(rows) == len(heads)

    def _move_aside(
        self, client: str, source: str, rows: Sequence[_Row], bad: list[_Entry], report: PassReport, listener: Listener
    ) -> None:
        with self.conn.cursor() as cur:
            for entry in bad:
                cur.execute(
                    "INSERT INTO lr.receive_dead_letters (seq, entry_index, source_site_id, client_name, kind, "
                    "message, error) VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (seq, entry_index) DO NOTHING",
                    (
                        entry.seq,
                        entry.index,
                        source,
                        client,
                        entry.kind,
                        psycopg2.Binary(entry.payload),
                        None if entry.error is None else storable(cur.connection, entry.error),
                    ),
                )
        self._consume(rows, bad)
        report.dead_letters += len(bad)
        for entry in bad:
            where = f"seq {entry.seq}" + ("" if entry.index < 0 else f" #{entry.index}")
            text = (
                f"{receive_queue_name(client, source)}: entry {where} moved to lr.receive_dead_letters: {entry.error}"
            )
            report.note_error(text)
            log.error(text)
            _on_error(listener, source, MalformedEntryError(text))


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
