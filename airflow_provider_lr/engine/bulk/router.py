"""The read of one fan-out chunk: ONE binary ``COPY TO STDOUT`` of the source's log entries in
``(lo, hi]``, in (position, entry id) order, the source server computing per entry the bit mask of
the sessions that want it, and the router that turns each raw row into its packed receive-queue
form (destinations stripped) and appends it to the writer of every session whose bit is set.

This loop is the fan-out's per-entry Python cost, so the usual row is read in place from the COPY's
bytes; what waits in memory is bounded by count and by bytes (``PACK_EVERY``, ``PACK_EVERY_BYTES``).
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import psycopg2.extensions
from psycopg2 import sql

from airflow_provider_lr.engine import vocabulary
from airflow_provider_lr.engine.bulk.pgcopy import PackedRows, RowReader
from airflow_provider_lr.engine.bulk.plan import Demand, PositionRange
from airflow_provider_lr.engine.faults import fault_point
from airflow_provider_lr.engine.sink.queue_rows import HEADS, piece
from airflow_provider_lr.engine.vocabulary import STREAM_LOG_ENTRIES, TYPE_TAG, sink_form_at

# A row of the chunk's read, binary: field count, then (length, value) of position, entry id
# and demand mask (int8 each: their lengths are skipped), then the message's length (the message follows).
_ENTRY_ROW = struct.Struct(">h4xq4xq4xqi")
_ENTRY_SIZE = _ENTRY_ROW.size
PACK_EVERY = 4096  # entries appended between two packing passes...
PACK_EVERY_BYTES = 4 << 20  # ...or bytes of large entries appended: bounded by bytes, whatever their size
LARGE_ENTRY = 1024  # smaller entries are not counted (PACK_EVERY of them hold <= 4 MiB): spares the hot loop

# One session of the chunk: its bit in the mask, its demand, the COPY into its receive queue (or staging rows).
Target = tuple[int, Demand, PackedRows]


def _demand_mask_sql(part: PositionRange, targets: list[Target]) -> sql.Composable:
    """Per entry, the bit of every demand that wants it, computed by the source server once per
    entry (an output column: a filter on it would evaluate it a second time). A condition every
    entry of the chunk meets is left out: the client where the chunk is for one client, the
    position where the demand starts at or before the chunk."""
    one_client = len({d.client_id for _, d, _ in targets}) == 1
    terms = []
    for bit, d, _ in targets:
        conds = [sql.SQL("{} = ANY(e.tag_ids)").format(sql.Literal(d.tag_id))]
        if not one_client:
            conds.append(sql.SQL("e.client_id = {}").format(sql.Literal(d.client_id)))
        if d.position.after > part.lo:
            conds.append(sql.SQL("c.position > {}").format(sql.Literal(d.position.after)))
        if d.position.split is not None and d.position.split.upto > d.position.after:
            conds.append(
                sql.SQL("NOT (c.position <= {} AND pg_visible_in_snapshot(c.tx, {}::pg_snapshot))").format(
                    sql.Literal(d.position.split.upto), sql.Literal(d.position.split.snapshot)
                )
            )
        terms.append(
            sql.SQL("CASE WHEN {} THEN {}::int8 ELSE 0 END").format(sql.SQL(" AND ").join(conds), sql.Literal(1 << bit))
        )
    return sql.SQL(" | ").join(terms)


def _wanted_sql(targets: list[Target]) -> sql.Composable:
    """The entries some demand may want (its client, one of its sinks' tags): read nothing else.
    An entry let through whose mask is 0 (before a demand's position, covered by its full sync)
    is read and routed nowhere."""
    tags: dict[int, list[int]] = {}
    for _, d, _ in targets:
        tags.setdefault(d.client_id, []).append(d.tag_id)
    return sql.SQL(" OR ").join(
        sql.SQL("(e.client_id = {} AND e.tag_ids && {}::int[])").format(sql.Literal(client), sql.Literal(sorted(ids)))
        for client, ids in tags.items()
    )


def copy_and_route(
    src: psycopg2.extensions.connection, part: PositionRange, targets: list[Target], fault_tag: str | None
) -> int:
    """Read the chunk once from ``src`` and route every entry to its sessions' writers; returns the
    entries read. With a ``fault_tag``, the ``fanout_mid_write`` fault point halfway through."""
    router = CopyRouter(
        {bit: writer for bit, _, writer in targets},
        max(1, part.entries // 2) if fault_tag is not None else -1,
        fault_tag,
    )
    query = sql.SQL(
        "COPY (SELECT c.position, e.entry_id, ({mask}) AS mask, e.message FROM lr.log_commits c"
        " CROSS JOIN LATERAL (SELECT e.entry_id, e.client_id, e.tag_ids, e.message FROM lr.log_entries e"
        "  WHERE e.tx = c.tx AND e.stream = {stream} OFFSET 0) e"  # per-commit index lookups
        " WHERE c.position > {lo} AND c.position <= {hi} AND ({wanted}) ORDER BY c.position, e.entry_id)"
        " TO STDOUT (FORMAT binary)"
    ).format(
        mask=_demand_mask_sql(part, targets),
        wanted=_wanted_sql(targets),
        lo=sql.Literal(part.lo),
        hi=sql.Literal(part.hi),
        stream=sql.Literal(STREAM_LOG_ENTRIES),
    )
    with src.cursor() as cur:
        cur.copy_expert(query.as_string(src), router)
    src.rollback()
    return router.read


class CopyRouter(RowReader):
    """``write`` target of the chunk's source COPY: turns each entry into its packed receive-queue
    form (``queue_rows.piece``, destinations stripped) and appends it to the writer of every
    session whose bit is set in the entry's mask.

    The usual row (one CopyData message = one row, destinations of < 128 bytes, a one-byte type)
    is read in place: where it starts with the destination records of the last entry of its mask
    (entries to the same sinks name them alike) its sink form follows them, else
    ``vocabulary.sink_form_at`` reads them. No other call per entry than this ``write`` and one
    list append per session (rows are formed every ``PACK_EVERY`` entries or ``PACK_EVERY_BYTES``,
    once for all the sessions that got the same entries). Anything else goes through
    ``RowReader``'s general parser and ``vocabulary.strip_destinations``."""

    def __init__(self, writers: dict[int, PackedRows], halfway: int, fault_tag: str | None) -> None:
        super().__init__(self._general_row)
        self.by_bit = writers
        self.routes: dict[int, list[Callable]] = {}  # mask -> the append of each writer that wants it
        self.destinations: dict[int, bytes] = {}  # mask -> the destination records of its last entry
        self.read = 0
        self.waiting = 0  # bytes of large entries appended since the last packing pass
        self.halfway, self.fault_tag = halfway, fault_tag
        self.stop = min(s for s in (PACK_EVERY, halfway) if s > 0)  # the next read that calls _stop

    def _route(self, mask: int) -> list[Callable]:
        route = self.routes[mask] = [w.append for bit, w in self.by_bit.items() if mask >> bit & 1]
        return route

    def write(self, chunk: bytes) -> int:
        size = len(chunk)
        if self._header_seen and not self._buf and size > _ENTRY_SIZE:
            count, position, entry_id, mask, length = _ENTRY_ROW.unpack_from(chunk)
            if count == 4 and _ENTRY_SIZE + length == size:
                try:
                    # the destinations of the last entry of this mask, if this one starts with them
                    # (then sink_form_at would read the same records): the usual case, no parsing
                    known = self.destinations.get(mask)
                    if (
                        known is not None
                        and chunk.startswith(known, _ENTRY_SIZE)
                        and chunk[pos := _ENTRY_SIZE + len(known)] == TYPE_TAG
                        and chunk[pos + 1] < 0x80
                    ):
                        kind = chunk[pos + 1]
                    else:
                        kind, pos = sink_form_at(chunk, _ENTRY_SIZE)
                        self.destinations[mask] = chunk[_ENTRY_SIZE:pos]
                except IndexError:
                    self._deliver(position, entry_id, mask, chunk[_ENTRY_SIZE:])
                    self.rows += 1
                    return size
                route = self.routes.get(mask) or self._route(mask)
                length = size - pos  # queue_rows.piece, inline for the usual size
                entry = (
                    HEADS[length] + chunk[pos:] if length < len(HEADS) else piece(chunk[pos:]),
                    kind,
                    position,
                    entry_id,
                )
                for append in route:
                    append(entry)
                self.read += 1
                if self.read == self.stop or (length > LARGE_ENTRY and self._large(length)):
                    self._stop()
                return size
        return super().write(chunk)

    def _general_row(self, fields: list[bytes | None]) -> None:  # unusual chunking
        position, entry_id, mask = (int.from_bytes(f or b"", "big", signed=True) for f in fields[:3])
        self._deliver(position, entry_id, mask, fields[3] or b"")

    def _deliver(self, position: int, entry_id: int, mask: int, message: bytes) -> None:
        route = self.routes.get(mask) or self._route(mask)
        kind, stripped = vocabulary.strip_destinations(message)
        entry = (piece(stripped), kind, position, entry_id)
        for append in route:
            append(entry)
        self.read += 1
        if self.read == self.stop or (len(entry[0]) > LARGE_ENTRY and self._large(len(entry[0]))):
            self._stop()

    def _large(self, size: int) -> bool:
        """Count a large entry's bytes; True when those waiting to be packed reach ``PACK_EVERY_BYTES``."""
        self.waiting += size
        return self.waiting >= PACK_EVERY_BYTES

    def _stop(self) -> None:
        """Every ``PACK_EVERY`` entries or ``PACK_EVERY_BYTES``: form the rows of what each session
        got so far (bounds what waits in memory by count and bytes; the rows go on to the sinks'
        COPY blocks, at most ``QUEUED_BLOCKS`` waiting); at ``halfway``, the fault point."""
        if self.read == self.halfway:
            self._fault()
        if self.read % PACK_EVERY == 0 or self.waiting >= PACK_EVERY_BYTES:
            for leader, *alike in alike_writers(list(self.by_bit.values())):
                leader.pack(alike)
            self.waiting = 0
        self.stop = min(s for s in (self.read + PACK_EVERY - self.read % PACK_EVERY, self.halfway) if s > self.read)

    def _fault(self) -> None:
        """Half the chunk read: make sure rows are in the sinks' open transactions, then die."""
        for writer in self.by_bit.values():
            writer.sync()
        fault_point(f"fanout_mid_write{self.fault_tag}")


def alike_writers(writers: list[PackedRows]) -> list[list[PackedRows]]:
    """The writers grouped by what waits to be packed: sessions that got the same entries (every
    session of a broadcast) form the same rows, so one of each group forms them for all."""
    groups: list[list[PackedRows]] = []
    for writer in writers:
        for group in groups:
            if group[0].packer.pending == writer.packer.pending:
                group.append(writer)
                break
        else:
            groups.append([writer])
    return groups
