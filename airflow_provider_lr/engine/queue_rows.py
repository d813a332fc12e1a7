"""The storage form of ``lr.receive_queue`` rows: several entries packed into one row.

Why: a sink's cost of taking an entry was mostly per *row* (a heap tuple, an identity value, two
index entries, a WAL record), and for the 256-byte entries of a catch-up the fan-out spent most of
its time in the sinks' ingest. Consecutive entries of one kind for one session are therefore
packed into one row of at most ``PACK_BYTES`` (the table keeps rows up to ``toast_tuple_target`` =
8160 bytes inline, so a pack is one tuple on one page, with no TOAST chunks): about 28 entries of
256 bytes per row.

The rule (V0005):

* ``entry_count = 1``: ``message`` is the ``RoutingTableEntryMsg`` itself (every row written before
  V0005 is of this form);
* ``entry_count > 1``: ``message`` is a ``ReceiveQueueBatch`` whose ``entries`` are the messages in
  source order, all of the row's ``kind``; ``source_position`` / ``source_entry_id`` are those of
  the last entry;
* full-sync start and end markers are never packed;
* ``delivered``: how many leading entries of the row a subscriber has consumed (a delivery that
  ends inside a row advances it; the one that takes the rest deletes the row).

``Packer`` is the one place that forms rows; every writer (the session cycle's ``sink._SinkWrite``,
the fan-out's binary COPY) goes through it, and ``unpack`` is the one place that reads them.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from airflow_provider_lr.proto import lr_pb2

PACK_BYTES = 7_900  # a packed message stays below toast_tuple_target with the row's other columns
PACKABLE = frozenset((lr_pb2.LOG_ENTRY_SYNC, lr_pb2.SNAPSHOT_SYNC))
_FIELD_ENTRIES = 0x0A  # ReceiveQueueBatch.entries: field 1, length-delimited


class QueueRow(NamedTuple):
    """One row to write: kind, last entry's position and id, entry count, message."""

    kind: int
    position: int
    entry_id: int
    count: int
    message: bytes


def piece(message: bytes) -> bytes:
    """One entry in packed form: the ``ReceiveQueueBatch.entries`` record (tag, varint length, bytes)."""
    size = len(message)
    if size < 0x80:
        return bytes((_FIELD_ENTRIES, size)) + message
    head = bytearray((_FIELD_ENTRIES,))
    while size >= 0x80:
        head.append(size & 0x7F | 0x80)
        size >>= 7
    head.append(size)
    return bytes(head) + message


def _unpiece(record: bytes) -> bytes:
    """The message of a single ``piece`` (a pack of one is stored plain)."""
    pos = 1
    while record[pos] & 0x80:
        pos += 1
    return record[pos + 1:]


class Packer:
    """Groups consecutive entries of one kind into rows of at most ``limit`` bytes, in order, and
    hands each finished row to ``emit``. Call ``flush`` after the last entry."""

    __slots__ = ("emit", "limit", "buf", "count", "kind", "position", "entry_id", "rows", "entries")

    def __init__(self, emit: Callable[[QueueRow], None], limit: int = PACK_BYTES) -> None:
        self.emit, self.limit = emit, limit
        self.buf = bytearray()
        self.count = self.kind = self.position = self.entry_id = 0
        self.rows = self.entries = 0  # emitted so far

    def add(self, kind: int, position: int, entry_id: int, message: bytes) -> None:
        self.add_piece(kind, position, entry_id, piece(message))

    def add_piece(self, kind: int, position: int, entry_id: int, record: bytes) -> None:
        """``add`` for an entry already in ``piece`` form (the fan-out builds it once for all sinks)."""
        if self.count and (kind != self.kind or len(self.buf) + len(record) > self.limit):
            self.flush()
        if kind not in PACKABLE:  # a marker: a row of its own
            self._emit(QueueRow(kind, position, entry_id, 1, _unpiece(record)))
            return
        self.buf += record
        self.count += 1
        self.kind, self.position, self.entry_id = kind, position, entry_id

    def flush(self) -> None:
        if not self.count:
            return
        message = _unpiece(bytes(self.buf)) if self.count == 1 else bytes(self.buf)
        row = QueueRow(self.kind, self.position, self.entry_id, self.count, message)
        self.buf = bytearray()
        self.count = 0
        self._emit(row)

    def _emit(self, row: QueueRow) -> None:
        self.rows += 1
        self.entries += row.count
        self.emit(row)


def unpack(entry_count: int, message: bytes) -> list[bytes]:
    """The ``RoutingTableEntryMsg`` bytes a row holds, in order. Raises ``ValueError`` for a row
    whose packed message does not parse or holds another number of entries."""
    if entry_count == 1:
        return [message]
    try:
        entries = list(lr_pb2.ReceiveQueueBatch.FromString(message).entries)
    except Exception as exc:  # protobuf's DecodeError and friends
        raise ValueError(f"malformed ReceiveQueueBatch: {exc}") from exc
    if len(entries) != entry_count:
        raise ValueError(f"row says {entry_count} entries but its ReceiveQueueBatch holds {len(entries)}")
    return entries
