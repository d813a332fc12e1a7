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
* a packed row also carries its entries' source positions, as runs (``positions``; rows written
  before V0010 do not): a failover cuts a row at a position (``engine/site/failover_reconcile``);
* ``delivered``: how many leading entries of the row a subscriber has consumed (a delivery that
  ends inside a row advances it; the one that takes the rest deletes the row).

``Packer`` is the one place that forms rows; every writer (the session cycle's ``writes.SinkTransaction``,
the fan-out's binary COPY) goes through it, and ``unpack`` is the one place that reads them.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from itertools import accumulate, groupby
from operator import itemgetter
from typing import NamedTuple

from airflow_provider_lr.engine.vocabulary import varint
from airflow_provider_lr.proto import lr_pb2

PACK_BYTES = 7_900  # a packed message stays below toast_tuple_target with the row's other columns
PACKABLE = frozenset((lr_pb2.LOG_ENTRY_SYNC, lr_pb2.SNAPSHOT_SYNC))
_FIELD_ENTRIES = 0x0A  # ReceiveQueueBatch.entries: field 1, length-delimited
_RUN_POSITIONS = b"\x12"  # run_positions: field 2, packed
_RUN_COUNTS = b"\x1a"  # run_counts: field 3, packed


class QueueRow(NamedTuple):
    """One row to write: kind, last entry's position and id, entry count, message."""

    kind: int
    position: int
    entry_id: int
    entry_count: int  # the column's name (a field named ``count`` would hide ``tuple.count``)
    message: bytes


# The record head (tag, varint length) of every entry shorter than 16 KiB, made once.
HEADS = [bytes((_FIELD_ENTRIES, size)) for size in range(0x80)] + [
    bytes((_FIELD_ENTRIES, size & 0x7F | 0x80, size >> 7)) for size in range(0x80, 0x4000)
]


def piece(message: bytes) -> bytes:
    """One entry in packed form: the ``ReceiveQueueBatch.entries`` record (tag, varint length, bytes)."""
    size = len(message)
    if size < 0x4000:
        return HEADS[size] + message
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
    return record[pos + 1 :]


class Packer:
    """Groups consecutive entries of one kind into rows of at most ``limit`` bytes, in order, and
    hands each finished row to ``emit``.

    Entries wait in ``pending`` as ``(piece, kind, position, entry id)`` (``append`` is the bulk
    paths' per-entry cost: one list append); ``flush`` forms the rows with C-level joins and
    searches, so packing costs per row, not per entry. ``flush(final=False)`` keeps the last,
    unfinished pack waiting for more; call ``flush()`` after the last entry."""

    def __init__(self, emit: Callable[[QueueRow], None], limit: int = PACK_BYTES) -> None:
        self.emit, self.limit = emit, limit
        self.pending: list[tuple[bytes, int, int, int]] = []
        self.append = self.pending.append
        self.rows = self.entries = 0  # emitted so far

    def add(self, kind: int, position: int, entry_id: int, message: bytes) -> None:
        self.append((piece(message), kind, position, entry_id))

    def flush(self, final: bool = True, alike: Sequence[Packer] = ()) -> None:
        """Form the rows of what is pending. ``alike``: packers whose ``pending`` equals this one's
        (sessions that got the same entries, as every session of a broadcast does): they get the
        same rows, formed once, and keep the same unfinished pack."""
        pending = self.pending
        if not pending:
            return
        kinds = set(map(itemgetter(1), pending))
        runs = [pending] if len(kinds) == 1 else [list(run) for _, run in groupby(pending, key=itemgetter(1))]
        keep: list[tuple[bytes, int, int, int]] = []
        packers = (self, *alike)
        for number, run in enumerate(runs):
            last_run = number == len(runs) - 1
            if run[0][1] not in PACKABLE:  # markers: a row each
                for record, kind, position, entry_id in run:
                    self._emit(QueueRow(kind, position, entry_id, 1, _unpiece(record)), packers)
                continue
            keep = self._pack(run, final or not last_run, packers)
        for packer in packers:
            packer.pending.clear()
            packer.pending.extend(keep)

    def _pack(
        self, run: list[tuple[bytes, int, int, int]], final: bool, packers: tuple[Packer, ...]
    ) -> list[tuple[bytes, int, int, int]]:
        """Cut one run of a packable kind greedily into rows; returns the unfinished tail if not final."""
        ends = list(accumulate(map(len, map(itemgetter(0), run))))
        start, base, size = 0, 0, len(run)
        while start < size:
            end = bisect_right(ends, base + self.limit, start + 1)  # at least one entry per row
            if end == size and not final:
                return run[start:]
            _, kind, position, entry_id = run[end - 1]
            if end - start == 1:
                message = _unpiece(run[start][0])
            else:
                records = list(map(itemgetter(0), run[start:end]))
                records.append(_runs(run, start, end))
                message = b"".join(records)  # one copy of the entries
            self._emit(QueueRow(kind, position, entry_id, end - start, message), packers)
            base, start = ends[end - 1], end
        return []

    @staticmethod
    def _emit(row: QueueRow, packers: tuple[Packer, ...]) -> None:
        for packer in packers:
            packer.rows += 1
            packer.entries += row.entry_count
            packer.emit(row)


def _runs(entries: list[tuple[bytes, int, int, int]], start: int = 0, end: int | None = None) -> bytes:
    """The ``ReceiveQueueBatch`` position runs of a packed row's entries ``entries[start:end]``
    (appended after them: a protobuf message may carry its fields in any order), encoded here
    rather than through a message object (a row of one transaction, the usual one, is one run)."""
    end = len(entries) if end is None else end
    first, last = entries[start][2], entries[end - 1][2]
    if first == last:
        run_positions, run_counts = varint(first), varint(end - start)
    else:
        runs = [(position, len(list(group))) for position, group in groupby(map(itemgetter(2), entries[start:end]))]
        run_positions = b"".join(varint(p) for p, _ in runs)
        run_counts = b"".join(varint(n) for _, n in runs)
    return (
        _RUN_POSITIONS + varint(len(run_positions)) + run_positions + _RUN_COUNTS + varint(len(run_counts)) + run_counts
    )


def positions(entry_count: int, message: bytes, last_position: int) -> list[int] | None:
    """Each entry's source commit position, in order (a row of one entry: the row's); None for a
    packed row written before V0010, which does not say."""
    if entry_count == 1:
        return [last_position]
    batch = lr_pb2.ReceiveQueueBatch.FromString(message)
    if not batch.run_counts:
        return None
    return [p for p, n in zip(batch.run_positions, batch.run_counts) for _ in range(n)]


def repack(entries: list[bytes], entry_positions: list[int]) -> bytes:
    """The message of a row holding ``entries`` (at ``entry_positions``): what a failover writes
    when it cuts a row (``unpack``/``positions`` read it back)."""
    if len(entries) == 1:
        return entries[0]
    pending = [(piece(m), 0, p, 0) for m, p in zip(entries, entry_positions)]
    return b"".join(map(itemgetter(0), pending)) + _runs(pending)


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
