"""The final prefix of a source's log, read ONCE for all its streaming sessions and routed.

The streaming form of the read-once tee (``bulk/tee``): where a stream per session would read the
same commits once per session (and the source's server would do the work N times), one statement
returns the trim mark, the end of the final prefix after the lowest reader (``log_reader``'s
``_read_final`` says why a final prefix is complete and in commit order), the highest committed
position, and each entry of the prefix that any reader wants, with the list of readers that want it
(computed by the source's server from each reader's client, destination tag, frontier, base-snapshot
split and synced federated tables: the same rules as ``LogReader``'s per-destination read).

Small batches only: at most ``FETCH_ROWS`` entries and ``max_bytes`` of messages. A larger prefix is
cut at a commit boundary (every reader then has whole transactions up to the cut); a single
transaction larger than that returns None, and the caller reads it per session with the general
read, which streams it into the sink bounded by bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import psycopg2.extensions

from airflow_provider_lr.engine.db.prepared import Prepared
from airflow_provider_lr.engine.source.log_reader import (
    FETCH_ROWS,
    FINAL_ENDS,
    FINAL_PREFIX,
    BaseSplit,
    LogRecord,
    TableSplits,
    fetch_bytes,
    trimmed_error,
)
from airflow_provider_lr.engine.vocabulary import STREAM_LOG_ENTRIES, STREAM_TABLE_CHANGES


@dataclass(frozen=True)
class Reader:
    """One session as the routed read sees it: what it wants and where it stands."""

    client_id: int
    tag_id: int
    after: int  # its read frontier: every position up to here is read for it
    split: BaseSplit | None  # what its sink's base snapshot covered
    tables: TableSplits  # its synced federated tables


@dataclass
class RoutedBatch:
    """The readers' entries in ``(reader.after, end]``, whole transactions, in commit order."""

    end: int  # every reader has everything it wants up to here (or up to its own ``after`` if higher)
    highest: int  # the highest committed position (above ``end``: a commit in flight, or rolled back)
    records: list[list[LogRecord]]  # per reader, in the order of ``readers``

    @property
    def entries(self) -> int:
        return sum(len(r) for r in self.records)


# Each entry of the prefix that some reader wants, and which ones (``members``: their indexes).
_ROUTED_SQL = (
    FINAL_PREFIX
    + """, m AS (
    SELECT * FROM unnest(%(idx)s::int[], %(cids)s::int[], %(tags)s::int[], %(afters)s::int8[],
                         %(s_uptos)s::int8[], %(s_snaps)s::text[]) m(idx, cid, tag, after, s_upto, s_snap)
), t AS (
    SELECT * FROM unnest(%(t_idx)s::int[], %(t_ids)s::int[], %(t_uptos)s::int8[], %(t_snaps)s::text[])
        t(idx, id, upto, snap)
)
SELECT (SELECT trim_mark FROM lr.log_trim), """
    + FINAL_ENDS
    + """, r.position, r.entry_id, r.size, r.message, r.table_id, r.members
FROM (SELECT 1) one LEFT JOIN LATERAL (
    SELECT f.position, e.entry_id, octet_length(e.message) AS size,
           CASE WHEN octet_length(e.message) <= %(inline)s THEN e.message END AS message, e.table_id, w.members
    FROM f CROSS JOIN LATERAL (
        SELECT e.entry_id, e.message, e.table_id, e.client_id, e.tag_ids, e.stream FROM lr.log_entries e
        WHERE e.tx = f.tx AND e.client_id = ANY (%(cids)s::int[]) AND e.stream IN (%(stream)s, %(t_stream)s)
        OFFSET 0  -- a per-commit index lookup, as the per-destination read
    ) e
    CROSS JOIN LATERAL (
        SELECT array_agg(m.idx ORDER BY m.idx) AS members FROM m
        WHERE m.cid = e.client_id AND e.tag_ids @> ARRAY[m.tag] AND f.position > m.after
          AND NOT (m.s_upto IS NOT NULL AND f.position <= m.s_upto
                   AND pg_visible_in_snapshot(f.tx, m.s_snap::pg_snapshot))
          AND (e.stream = %(stream)s OR EXISTS (
                SELECT 1 FROM t WHERE t.idx = m.idx AND t.id = e.table_id
                  AND NOT (f.position <= t.upto AND pg_visible_in_snapshot(f.tx, t.snap::pg_snapshot))))
    ) w
    WHERE w.members IS NOT NULL
    ORDER BY f.position, e.entry_id LIMIT %(rows)s
) r ON true
"""
)

# prepared by a stream on its connection: planning the statement costs more than running it
ROUTED = Prepared(
    "lr_routed_read",
    _ROUTED_SQL,
    {
        "after": "int8",
        "scan": "int4",
        "rows": "int4",
        "inline": "int4",
        "stream": "int2",
        "t_stream": "int2",
        **{name: "int4[]" for name in ("idx", "cids", "tags", "t_idx", "t_ids")},
        **{name: "int8[]" for name in ("afters", "s_uptos", "t_uptos")},
        **{name: "text[]" for name in ("s_snaps", "t_snaps")},
    },
)

_OUT_OF_LINE_SQL = """
SELECT c.position, e.entry_id, e.message FROM lr.log_commits c JOIN lr.log_entries e ON e.tx = c.tx
WHERE (c.position, e.entry_id) IN (SELECT * FROM unnest(%(positions)s::int8[], %(ids)s::int8[]))
"""


def _params(readers: Sequence[Reader], max_bytes: int) -> dict:
    lo = min(r.after for r in readers)
    t_rows = [
        (i, tid, upto, snap)
        for i, r in enumerate(readers)
        for tid, upto, snap in zip(r.tables.ids, r.tables.uptos, r.tables.snapshots)
    ]
    return {
        "after": lo,
        "scan": FETCH_ROWS,
        "rows": FETCH_ROWS + 1,
        "inline": max(1, fetch_bytes(max_bytes) // FETCH_ROWS),
        "stream": STREAM_LOG_ENTRIES,
        "t_stream": STREAM_TABLE_CHANGES,
        "idx": list(range(len(readers))),
        "cids": [r.client_id for r in readers],
        "tags": [r.tag_id for r in readers],
        "afters": [r.after for r in readers],
        "s_uptos": [r.split.upto if r.split is not None else None for r in readers],
        "s_snaps": [r.split.snapshot if r.split is not None else None for r in readers],
        "t_idx": [row[0] for row in t_rows],
        "t_ids": [row[1] for row in t_rows],
        "t_uptos": [row[2] for row in t_rows],
        "t_snaps": [row[3] for row in t_rows],
    }


def read_routed(
    conn: psycopg2.extensions.connection,
    readers: Sequence[Reader],
    max_bytes: int,
    source: str = "",
    prepared: bool = False,
    before: str = "",
) -> RoutedBatch | None:
    """The final prefix after the lowest reader, routed (see the module docstring); None when its
    first transaction alone is too large for one small batch. ``conn`` is autocommit (one round
    trip), or its transaction is ended here; ``prepared``: ``ROUTED`` was prepared on it;
    ``before``: statements (no parameters) sent ahead of it in the same round trip.
    ``TrimmedError`` when the log was trimmed past the lowest reader."""
    params = _params(readers, max_bytes)
    try:
        with conn.cursor() as cur:
            if prepared:
                ROUTED.execute(cur, params, before)
            else:
                cur.execute(before.replace("%", "%%") + _ROUTED_SQL, params)
            rows = cur.fetchall()
    finally:
        if not conn.autocommit:
            conn.rollback()
    mark, end, highest = rows[0][:3]
    if mark > params["after"]:
        raise trimmed_error(f"stream of source {source!r}", params["after"], mark)
    entries = [r[3:] for r in rows if r[3] is not None]  # position, entry id, size, message, table id, members
    cut = _cut(entries, max_bytes)
    if cut is not None:
        if cut <= entries[0][0]:
            return None  # the first transaction alone is large: read per session, streamed by bytes
        entries = [e for e in entries if e[0] < cut]
        end = cut - 1
    messages = _out_of_line(conn, entries)
    if messages is None:
        return None
    routed: list[list[LogRecord]] = [[] for _ in readers]
    for position, entry_id, _, message, table_id, members in entries:
        record = LogRecord(position, entry_id, bytes(message) if message is not None else messages[position, entry_id])
        if table_id is not None:
            record = LogRecord(position, entry_id, record.message, table_id)
        for i in members:
            routed[i].append(record)
    return RoutedBatch(end, max(end, highest), routed)


def _cut(entries: list[tuple], max_bytes: int) -> int | None:
    """The first position left out of a batch over ``FETCH_ROWS`` entries or ``max_bytes`` (the
    batch keeps whole transactions below it), or None when it fits whole."""
    if len(entries) > FETCH_ROWS:
        return entries[-1][0]  # the last position may be incomplete
    total = 0
    for position, _, size, *_ in entries:
        total += size
        if total > max_bytes:
            return position
    return None


def _out_of_line(conn: psycopg2.extensions.connection, entries: list[tuple]) -> dict[tuple[int, int], bytes] | None:
    """The messages too large to come inline, fetched by key; None when some are gone (a retention
    trim ran between the two statements: the caller's per-session read checks the trim mark)."""
    keys = [(p, i) for p, i, _, message, *_ in entries if message is None]
    if not keys:
        return {}
    try:
        with conn.cursor() as cur:
            cur.execute(_OUT_OF_LINE_SQL, {"positions": [p for p, _ in keys], "ids": [i for _, i in keys]})
            found = {(p, i): bytes(m) for p, i, m in cur.fetchall()}
    finally:
        if not conn.autocommit:
            conn.rollback()
    return found if len(found) == len(set(keys)) else None
