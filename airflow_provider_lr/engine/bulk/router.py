"""The read of one fan-out chunk: ONE binary ``COPY TO STDOUT`` of the source's log entries in
``(lo, hi]``, in (position, entry id) order, the source server computing per entry the bit mask of
the sessions that want it, and the router that hands each entry, in its packed receive-queue form
(destinations stripped), to every session whose bit is set.

The per-entry work is the source server's, in SQL, not the tee's Python (docs/spark.md, "Where the
tee's time goes"):

* the entries of a commit come in *groups*: ``GROUP_ENTRIES`` consecutive entries of at most
  ``GROUP_ENTRY_BYTES`` (a larger one comes alone) in one COPY row of their ids, masks and sizes
  (arrays) and the entries end to end; aggregating costs the server about what a row per entry
  did, and the tee reads a row per group;
* an entry that begins with one of the chunk's *leads* — the destination records, type tag and
  kind most entries begin with, sampled from the chunk's first ``SAMPLE_ENTRIES``
  (``leading_records``) — comes already in its packed form (``queue_rows.piece``), cut by the
  server where the lead's records end: the tee slices it out of the row. An entry that begins
  otherwise comes whole and is stripped here (``vocabulary.strip_destinations``), so the lead is
  a hint and the output the same whatever it is.

What waits in memory is bounded by count and by bytes: a group (at most ``GROUP_ENTRIES`` ×
``GROUP_ENTRY_BYTES``, or one large entry) and what waits to be packed (``PACK_EVERY``,
``PACK_EVERY_BYTES``).
"""

from __future__ import annotations

import struct
from bisect import bisect_left
from collections import Counter
from collections.abc import Sequence
from functools import lru_cache
from itertools import accumulate, compress, repeat

import psycopg2.extensions
from psycopg2 import sql

from airflow_provider_lr.engine import vocabulary
from airflow_provider_lr.engine.bulk.pgcopy import PackedRows, RowReader
from airflow_provider_lr.engine.bulk.plan import Demand, PositionRange
from airflow_provider_lr.engine.faults import fault_point
from airflow_provider_lr.engine.sink.queue_rows import piece
from airflow_provider_lr.engine.vocabulary import STREAM_LOG_ENTRIES, TYPE_TAG, sink_form_at
from airflow_provider_lr.proto import lr_pb2

GROUP_ENTRIES = 256  # consecutive entries of one commit in one row of the chunk's read...
GROUP_ENTRY_BYTES = 4096  # ...each at most this size (a group holds <= 1 MiB); a larger entry has a row of its own
SAMPLE_ENTRIES = 1000  # entries of the chunk's start whose leading records the source is given to cut by...
MAX_LEADS = 16  # ...at most this many, the most frequent...
LEAD_BYTES = 1024  # ...found in the entries' first bytes (the sample is bounded by bytes too)
_CUT_KIND = int(lr_pb2.LOG_ENTRY_SYNC)  # the kind of every entry the source cuts (its lead ends with it)
PACK_EVERY = 4096  # entries read between two packing passes...
PACK_EVERY_BYTES = 4 << 20  # ...or bytes of entries: bounded by bytes, whatever their size

# A group row, binary: field count, position (int8: its length skipped), the entry ids' array length.
_GROUP_HEAD = struct.Struct(">h4xqi")
_ARRAY_HEAD = struct.Struct(">iiiii")  # an array field: dimensions, has-nulls flag, element type, length, lower bound
_FIELD = struct.Struct(">i")

Entry = tuple[bytes, int, int, int]  # queue_rows.Packer's: (piece, kind, position, entry id)
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
    query = _chunk_sql(part, targets, leading_records(src, part, targets))
    with src.cursor() as cur:
        cur.copy_expert(query.as_string(src), router)
    src.rollback()
    router.finish()
    return router.read


def _entries_sql(part: PositionRange, targets: list[Target]) -> sql.Composable:
    """FROM and WHERE of the chunk's entries (``e``) that some demand may want, with their commit (``c``)."""
    return sql.SQL(
        " FROM lr.log_commits c"
        " CROSS JOIN LATERAL (SELECT e.entry_id, e.client_id, e.tag_ids, e.message FROM lr.log_entries e"
        "  WHERE e.tx = c.tx AND e.stream = {stream} OFFSET 0) e"  # per-commit index lookups
        " WHERE c.position > {lo} AND c.position <= {hi} AND ({wanted})"
    ).format(
        stream=sql.Literal(STREAM_LOG_ENTRIES),
        lo=sql.Literal(part.lo),
        hi=sql.Literal(part.hi),
        wanted=_wanted_sql(targets),
    )


def leading_records(src: psycopg2.extensions.connection, part: PositionRange, targets: list[Target]) -> list[bytes]:
    """The destination records, type tag and kind that the first ``SAMPLE_ENTRIES`` of the chunk
    begin with (``LOG_ENTRY_SYNC`` entries whose records ``sink_form_at`` reads), most frequent
    first, at most ``MAX_LEADS``, read from their first ``LEAD_BYTES``: the source cuts every
    entry that begins with one of them (``_chunk_sql``). A hint only: an entry that begins
    otherwise comes whole and is stripped here."""
    with src.cursor() as cur:
        cur.execute(
            sql.SQL("SELECT substr(e.message, 1, {head}){entries} ORDER BY c.position LIMIT {sample}").format(
                head=sql.Literal(LEAD_BYTES), entries=_entries_sql(part, targets), sample=sql.Literal(SAMPLE_ENTRIES)
            )
        )
        counts: Counter[bytes] = Counter()
        for (message,) in cur:
            message = bytes(message)
            try:
                _, form = sink_form_at(message, 0)
            except IndexError:
                continue
            if form + 2 < len(message) and message[form] == TYPE_TAG and message[form + 1] == _CUT_KIND:
                counts[message[: form + 2]] += 1
    return [lead for lead, _ in counts.most_common(MAX_LEADS)]


def _chunk_sql(part: PositionRange, targets: list[Target], leads: list[bytes]) -> sql.Composable:
    """The chunk's COPY: per group (``GROUP_ENTRIES`` of a commit, an entry over ``GROUP_ENTRY_BYTES``
    alone) its position, the entries' ids, masks and sizes, and the entries end to end. An entry
    that begins with one of ``leads`` comes as its packed form
    (``queue_rows.piece``: the entries record's tag and varint length, then the sink form, from the
    type tag that ends the lead's records) and a positive size; any other comes whole, its size negated."""
    cut: sql.Composable = sql.SQL("-1")
    for size in sorted({len(lead) for lead in leads}, reverse=True):  # one substr per lead size, then equality tests
        cut = sql.SQL("CASE substr(e.message, 1, {size}){whens} ELSE {otherwise} END").format(
            size=sql.Literal(size),
            whens=sql.SQL("").join(
                sql.SQL(" WHEN {lead} THEN {form}").format(lead=sql.Literal(lead), form=sql.Literal(size - 2))
                for lead in leads
                if len(lead) == size
            ),
            otherwise=cut,
        )
    if leads:
        cut = sql.SQL("CASE WHEN length(e.message) > {large} THEN -1 ELSE {cut} END").format(
            large=sql.Literal(GROUP_ENTRY_BYTES), cut=cut
        )
    rest = sql.SQL("(length(s.message) - s.cut)")  # the sink form's size
    # the record's head and the sink form's first bytes (type tag, kind) as one int4, then the rest
    short = (0x0A << 24) | (TYPE_TAG << 8) | _CUT_KIND  # tag, size < 128, type tag, kind
    long = (0x0A << 24) | TYPE_TAG  # tag, two-byte size, type tag
    return sql.SQL(
        "COPY (SELECT s.position, array_agg(s.entry_id {order}), array_agg(s.mask {order}),"
        " array_agg(CASE WHEN s.cut < 0 THEN -length(s.message) WHEN {rest} < 128 THEN {rest} + 2 ELSE {rest} + 3 END"
        " {order}),"
        " string_agg(CASE WHEN s.cut < 0 THEN s.message"
        "  WHEN {rest} < 128 THEN int4send({short} + {rest} * 65536) || substr(s.message, s.cut + 3)"
        "  ELSE int4send({long} + ({rest} % 128 + 128) * 65536 + {rest} / 128 * 256) || substr(s.message, s.cut + 2)"
        "  END, ''::bytea {order})"
        " FROM (SELECT c.position, e.entry_id, ({mask}) AS mask, e.message, {cut} AS cut{entries}"
        "  ORDER BY c.position OFFSET 0) s"  # in position order: the groups are sorted per commit
        " GROUP BY 1, {group} ORDER BY 1, {group}) TO STDOUT (FORMAT binary)"
    ).format(
        order=sql.SQL("ORDER BY s.entry_id"),
        rest=rest,
        short=sql.Literal(short),
        long=sql.Literal(long),
        mask=_demand_mask_sql(part, targets),
        cut=cut,
        entries=_entries_sql(part, targets),
        group=sql.SQL("s.entry_id / {n}, CASE WHEN length(s.message) > {large} THEN s.entry_id ELSE 0 END").format(
            n=sql.Literal(GROUP_ENTRIES), large=sql.Literal(GROUP_ENTRY_BYTES)
        ),
    )


@lru_cache(maxsize=64)
def _values(count: int, width: int) -> struct.Struct:
    """The elements of an int8 (``width`` 8) or int4 (4) array of ``count``, each after its length."""
    return struct.Struct(">" + ("4xq" if width == 8 else "4xi") * count)


def _array(buf: bytes, at: int, size: int, width: int) -> tuple[int, ...]:
    """The values of a one-dimensional array of non-null integers, ``size`` bytes at ``buf[at]``."""
    dims, nulls, _, count, _ = _ARRAY_HEAD.unpack_from(buf, at)
    if dims != 1 or nulls or size != _ARRAY_HEAD.size + (4 + width) * count:
        raise ValueError("not a group's array")
    return _values(count, width).unpack_from(buf, at + _ARRAY_HEAD.size)


class CopyRouter:
    """``write`` target of the chunk's source COPY (one call per group row): slices each entry's
    packed form out of the row (``_group``; an entry sent whole is stripped here) and keeps it, with
    its mask, in ONE list for all the sessions; every ``PACK_EVERY`` entries (or
    ``PACK_EVERY_BYTES``) a packing pass hands each session its entries (all of them, as the same
    list's items, when every entry had one mask, as in a broadcast) and forms the rows, once for the
    sessions that got the same entries (``alike_writers``).

    A large entry comes in a row of its own after the group of the small ones of its id range:
    that group is held until the next row so the entries leave in id order."""

    def __init__(self, writers: dict[int, PackedRows], halfway: int, fault_tag: str | None) -> None:
        self.by_bit = writers
        self.pending: list[Entry] = []  # entries read since the last packing pass, in source order...
        self.masks: list[int] = []  # ...and the demand mask of each
        self.held: tuple[int, Sequence[int], list[Entry], Sequence[int]] | None = None  # position, ids, entries, masks
        self.read = 0  # entries handed on (pending or passed to the sessions)
        self.waiting = 0  # bytes of entries read since the last packing pass
        self.halfway, self.fault_tag = halfway, fault_tag
        self._general = RowReader(self._general_row)
        self._between_rows = False  # the COPY header read and no partial row kept by the general parser

    def write(self, chunk: bytes) -> int:
        group = self._parse(chunk) if self._between_rows else None
        if group is not None:
            self._group(*group)
        else:  # the header, the trailer, unusual chunking
            self._general.write(chunk)
            self._between_rows = self._general.between_rows()
        return len(chunk)

    @staticmethod
    def _parse(
        chunk: bytes,
    ) -> tuple[int, Sequence[int], Sequence[int], Sequence[int], bytes, int] | None:
        """A whole group row (one CopyData message = one row, as PostgreSQL sends them): position,
        ids, masks, sizes, then the row and where its entries begin; None for anything else."""
        try:
            count, position, size = _GROUP_HEAD.unpack_from(chunk)
            if count != 5:
                return None
            at = _GROUP_HEAD.size
            ids = _array(chunk, at, size, 8)
            at += size
            (size,) = _FIELD.unpack_from(chunk, at)
            masks = _array(chunk, at + 4, size, 8)
            at += 4 + size
            (size,) = _FIELD.unpack_from(chunk, at)
            sizes = _array(chunk, at + 4, size, 4)
            at += 4 + size
            (size,) = _FIELD.unpack_from(chunk, at)
        except (struct.error, ValueError):
            return None
        if at + 4 + size != len(chunk) or not len(ids) == len(masks) == len(sizes) or sum(map(abs, sizes)) != size:
            return None
        return position, ids, masks, sizes, chunk, at + 4

    def _general_row(self, fields: list[bytes | None]) -> None:  # the first row (after the header), unusual chunking
        position = int.from_bytes(fields[0] or b"", "big", signed=True)
        ids, masks, sizes, data = (f or b"" for f in fields[1:5])
        self._group(
            position,
            _array(ids, 0, len(ids), 8),
            _array(masks, 0, len(masks), 8),
            _array(sizes, 0, len(sizes), 4),
            data,
            0,
        )

    def _group(
        self, position: int, ids: Sequence[int], masks: Sequence[int], sizes: Sequence[int], data: bytes, at: int
    ) -> None:
        """The entries of one group row (``data[at:]``: each entry's packed form, or the entry whole
        where its size is negative), in id order."""
        count = len(ids)
        if min(sizes) > 0:  # every entry cut by the source: its packed form, sliced out
            ends = list(accumulate(sizes, initial=at))
            pieces = map(data.__getitem__, map(slice, ends, ends[1:]))
            entries = list(zip(pieces, repeat(_CUT_KIND, count), repeat(position, count), ids))
        else:
            entries = self._each(position, ids, sizes, data, at)
        self.waiting += len(data) - at
        held = self.held
        if count == 1 and -sizes[0] > GROUP_ENTRY_BYTES:  # a large entry: after the held ones before it
            if held is not None and held[0] == position and held[1][0] // GROUP_ENTRIES == ids[0] // GROUP_ENTRIES:
                before = bisect_left(held[1], ids[0])
                self._hand(held[2][:before], held[3][:before])
                rest = position, held[1][before:], held[2][before:], held[3][before:]
                self.held = rest if rest[1] else None
            else:
                self.release()
            self._hand(entries, masks)
        else:
            self.release()
            self.held = position, ids, entries, masks

    @staticmethod
    def _each(position: int, ids: Sequence[int], sizes: Sequence[int], data: bytes, at: int) -> list[Entry]:
        """A group's entries one by one: a packed form as it came, an entry sent whole stripped here
        (``vocabulary.strip_destinations``)."""
        entries: list[Entry] = []
        for entry_id, size in zip(ids, sizes):
            if size > 0:
                entries.append((data[at : at + size], _CUT_KIND, position, entry_id))
            else:
                kind, stripped = vocabulary.strip_destinations(data[at : at - size])
                entries.append((piece(stripped), kind, position, entry_id))
            at += abs(size)
        return entries

    def release(self) -> None:
        """The held group on to the sessions."""
        if self.held is not None:
            _, _, entries, masks = self.held
            self.held = None
            self._hand(entries, masks)

    def _hand(self, entries: list[Entry], masks: Sequence[int]) -> None:
        """Entries on, in order: a packing pass when ``PACK_EVERY`` or ``PACK_EVERY_BYTES`` wait, the
        fault point once half the chunk is read."""
        if not entries:
            return
        self.pending += entries
        self.masks += masks
        self.read += len(entries)
        if len(self.pending) >= PACK_EVERY or self.waiting >= PACK_EVERY_BYTES:
            self.hand_over()
            for leader, *alike in alike_writers(list(self.by_bit.values())):
                leader.pack(alike)
            self.waiting = 0
        if 0 < self.halfway <= self.read:
            self.halfway = -1
            self._fault()

    def hand_over(self) -> None:
        """Append to each session's packer, in order, the entries read since the last pass whose
        mask has its bit (every one of them when all had one mask)."""
        pending, masks = self.pending, self.masks
        if not pending:
            return
        alone = masks[0] if masks.count(masks[0]) == len(masks) else None
        for bit, writer in self.by_bit.items():
            if alone is None:
                writer.packer.pending += compress(pending, map((1 << bit).__and__, masks))
            elif alone >> bit & 1:
                writer.packer.pending += pending
        pending.clear()
        masks.clear()

    def finish(self) -> None:
        """After the read: every entry to its sessions (the last rows are packed as each writer closes)."""
        self.release()
        self.hand_over()

    def _fault(self) -> None:
        """Half the chunk read: make sure rows are in the sinks' open transactions, then die."""
        self.hand_over()
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
