"""Rows of a table straight from a source's binary COPY into one or more sinks' COPY, streamed.

The bytes are never decoded: source and sink tables have the same column types (checked before,
``definition.check_same``), and binary COPY names the columns on both sides, so their order may
differ. Each sink's ``COPY FROM STDIN`` runs in a thread of its own and reads from a bounded
queue: memory stays at a few MiB whatever the size of the range, and the slowest sink sets the pace.

The server sends ``COPY TO STDOUT`` one row per message, and psycopg2 hands each message to
``write``; the rows are gathered into blocks of ``COPY_BLOCK`` bytes before they are queued, and each
sink's ``copy_expert`` reads a whole block at a time. Queueing row by row (one queue hand-off per row
and sink, one ``read`` and one send per row at each sink) made Python the bottleneck: 1M rows of
216 bytes to 2 sinks took 8.3 s (12.0 s of CPU) in one read, against 1.8 s (3.3 s of CPU) in 128 KiB
blocks; 64 KiB to 2 MiB blocks measured alike (docs/tables-bench.md, bench/table_bench.py).

A table with a column that binary COPY carries wrong is copied in COPY's text format instead, under
the same settings at both ends (``by_text``): ``int2vector``, ``oidvector`` and ``tsquery`` (an
empty one, sent by the source, is refused by the sink's receive function: the snapshot failed at
every cycle, for good) and the ``reg*`` types (binary carries the source's oid, which names another object or none at
the sink; as text, a value names the same object, as the stream's changes and ``pg_dump`` carry it).
What no path can carry is refused when the table is opened (``uncarried``).

Both ends copy in UTF8 (``copy_settings``), whatever each session's ``client_encoding``: the bytes
pass through undecoded, so a sink whose sessions took another encoding by default (a database of
``LATIN1``, or one whose ``client_encoding`` is set so) read the source's UTF8 as its own, and
stored ``é`` as ``Ã©``, silently; now its server converts them, or refuses a character its
encoding lacks, naming it.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator, Sequence

import psycopg2.extensions
from psycopg2 import sql

from airflow_provider_lr.engine.db.local_settings import local_settings
from airflow_provider_lr.engine.db.timeouts import DEADLINES, Clock
from airflow_provider_lr.engine.tables.definition import TableDefinition
from airflow_provider_lr.engine.tables.extras import AS_PRINTED

COPY_BLOCK = 128 * 1024  # rows of the source's output gathered into blocks of this size (bytes)
QUEUE_CHUNKS = 16  # blocks buffered per sink (2 MiB)
_END = b""


class _QueueReader:
    """``read`` target of ``copy_expert(COPY ... FROM STDIN)``: the chunks put in its queue."""

    def __init__(self, clock: Clock) -> None:
        self.chunks: queue.Queue[bytes] = queue.Queue(QUEUE_CHUNKS)
        self.pending = b""
        self.ended = False
        self.clock = clock

    def read(self, size: int = -1) -> bytes:
        while not self.pending and not self.ended:
            chunk = self.chunks.get()
            self.clock.moved()
            if chunk == _END:
                self.ended = True
            self.pending = chunk
        if size is None or size < 0 or size >= len(self.pending):
            out, self.pending = self.pending, b""
        else:
            out, self.pending = self.pending[:size], self.pending[size:]
        return out

    readline = read


class _Tee:
    """``write`` target of the source's ``COPY ... TO STDOUT``: every block to every sink."""

    def __init__(self, readers: Sequence[_QueueReader], failed: list[BaseException], clock: Clock) -> None:
        self.readers, self.failed, self.clock = readers, failed, clock
        self.bytes = 0
        self.block = bytearray()

    def write(self, chunk: bytes) -> int:
        if self.failed:
            raise self.failed[0]  # a sink gave up: stop the source's COPY too
        self.clock.moved()
        size = len(chunk)
        self.bytes += size
        self.block += chunk
        if len(self.block) >= COPY_BLOCK:
            self.flush()
        return size

    def flush(self) -> None:
        """Hand the rows gathered so far to every sink (never an empty block: it reads as the end)."""
        if self.block:
            data = bytes(self.block)
            self.block.clear()
            for reader in self.readers:
                reader.chunks.put(data)


# What a value of each column of table %(table)s is made of: its type, a domain's base, an array's
# element, a range's subtype, a multirange's range, a composite's fields (lr_parts: column, type).
_PARTS = """
WITH RECURSIVE lr_parts (attname, attnum, typid, depth) AS (
    SELECT a.attname::text, a.attnum, a.atttypid, 0 FROM pg_catalog.pg_attribute a
    WHERE a.attrelid = pg_catalog.to_regclass(%(table)s) AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = ''
    UNION ALL
    SELECT p.attname, p.attnum, x.typid, p.depth + 1
    FROM lr_parts p JOIN pg_catalog.pg_type t ON t.oid = p.typid
    CROSS JOIN LATERAL (
        SELECT t.typbasetype WHERE t.typtype = 'd'
        UNION ALL SELECT t.typelem WHERE t.typcategory = 'A' AND t.typelem <> 0
        UNION ALL SELECT r.rngsubtype FROM pg_catalog.pg_range r WHERE r.rngtypid = t.oid
        UNION ALL SELECT r.rngtypid FROM pg_catalog.pg_range r WHERE r.rngmultitypid = t.oid
        UNION ALL SELECT f.atttypid FROM pg_catalog.pg_attribute f
                  WHERE t.typtype = 'c' AND f.attrelid = t.typrelid AND f.attnum > 0 AND NOT f.attisdropped
    ) x (typid)
    WHERE p.depth < 10
)"""
# PostgreSQL's internal types: their input and receive functions refuse every value (a client can
# only read them), so no sink could take one
_INTERNAL = (
    "'pg_node_tree', 'pg_ndistinct', 'pg_dependencies', 'pg_mcv_list', 'pg_brin_bloom_summary', "
    "'pg_brin_minmax_multi_summary'"
)
_UNCARRIED = (
    _PARTS
    + """
SELECT pg_catalog.format('%%I (%%s)', p.attname, pg_catalog.string_agg(DISTINCT pg_catalog.format_type(t.oid, NULL), ', '))
FROM lr_parts p JOIN pg_catalog.pg_type t ON t.oid = p.typid
WHERE t.typsend = 0 OR t.typreceive = 0
   OR (t.typnamespace = 'pg_catalog'::pg_catalog.regnamespace AND t.typname IN ("""
    + _INTERNAL
    + """))
GROUP BY p.attnum, p.attname ORDER BY p.attnum"""
)
# Types binary COPY carries wrong (see the module): empty values the receive refuses, object references
_BY_TEXT_TYPES = (
    "'int2vector', 'oidvector', 'tsquery', 'regclass', 'regcollation', 'regconfig', 'regdictionary', 'regnamespace', "
    "'regoper', 'regoperator', 'regproc', 'regprocedure', 'regrole', 'regtype'"
)
_BY_TEXT = (
    _PARTS
    + """
SELECT EXISTS (SELECT FROM lr_parts p JOIN pg_catalog.pg_type t ON t.oid = p.typid
               WHERE t.typnamespace = 'pg_catalog'::pg_catalog.regnamespace AND t.typname IN ("""
    + _BY_TEXT_TYPES
    + "))"
)
# The settings a value's text depends on (those a created table's constants are printed by, and
# xmloption), the same at both ends of a text COPY: the source prints under them, the sink reads under
# them (search_path: at the source only, so every object outside pg_catalog prints with its schema;
# a sink's triggers keep theirs)
_SOURCE_SETTINGS = {**AS_PRINTED, "xmloption": "content", "search_path": "pg_catalog"}
_SINK_SETTINGS = {k: v for k, v in _SOURCE_SETTINGS.items() if k != "search_path"}
_ENCODING = {"client_encoding": "UTF8"}  # every copy's, binary too: its text values pass undecoded


def uncarried(cur: psycopg2.extensions.cursor, table: sql.Composable) -> list[str]:
    """The columns of ``table`` (each with the type at fault) no copy can carry: their type, or one a
    value of it is made of, has no binary send or receive function (``aclitem``, some extensions'
    types: a snapshot of such a table failed at every cycle, for good, long after it was opened), or
    is one of PostgreSQL's internal types, whose values no sink accepts (``pg_node_tree``, ...)."""
    cur.execute(_UNCARRIED, {"table": table.as_string(cur)})
    return [column for (column,) in cur.fetchall()]


def by_text(cur: psycopg2.extensions.cursor, definition: TableDefinition) -> bool:
    """Whether ``definition``'s table is copied in COPY's text format (see the module)."""
    cur.execute(_BY_TEXT, {"table": definition.table.ident.as_string(cur)})
    return bool(cur.fetchone()[0])


@contextlib.contextmanager
def copy_settings(
    source: psycopg2.extensions.cursor, sinks: Sequence[psycopg2.extensions.cursor], text: bool
) -> Iterator[None]:
    """The settings of a COPY (a text one's too, with ``text``), on ``source`` and each of ``sinks``
    for their transaction's copy; back as they were after it (not after a failure: the transaction
    is over then)."""
    with contextlib.ExitStack() as ends:
        ends.enter_context(local_settings(source, {**_ENCODING, **(_SOURCE_SETTINGS if text else {})}))
        for cur in sinks:
            ends.enter_context(local_settings(cur, {**_ENCODING, **(_SINK_SETTINGS if text else {})}))
        yield


# whether the row-level security of a table hides rows from the role reading it now: active for it,
# and no permissive policy USING (true) for SELECT of the role's (or PUBLIC's) with no restrictive one
_HIDDEN_ROWS = """
WITH t AS (SELECT pg_catalog.to_regclass(%s) AS oid),
mine AS (SELECT p.polpermissive, p.polqual, p.polrelid FROM pg_catalog.pg_policy p, t
         WHERE p.polrelid OPERATOR(pg_catalog.=) t.oid AND p.polcmd OPERATOR(pg_catalog.=) ANY ('{r,*}')
           AND (0::pg_catalog.oid OPERATOR(pg_catalog.=) ANY (p.polroles)
                OR EXISTS (SELECT FROM pg_catalog.unnest(p.polroles) r
                           WHERE pg_catalog.pg_has_role(current_user, r, 'USAGE'))))
SELECT pg_catalog.row_security_active(t.oid) AND NOT (
           EXISTS (SELECT FROM mine p WHERE p.polpermissive
                   AND pg_catalog.pg_get_expr(p.polqual, p.polrelid) OPERATOR(pg_catalog.=) 'true')
           AND NOT EXISTS (SELECT FROM mine p WHERE NOT p.polpermissive)),
       pg_catalog.quote_ident(current_user)
FROM t WHERE t.oid IS NOT NULL
"""


def hidden_rows(cur: psycopg2.extensions.cursor, definition: TableDefinition) -> str | None:
    """Why a snapshot read of the table as this connection's role would miss rows (its row-level
    security applies to the role, and no policy lets it read every row), or None. PostgreSQL filters
    such a read silently: a snapshot copied none of the rows and said the table was synced."""
    cur.execute(_HIDDEN_ROWS, (definition.table.ident.as_string(cur),))
    found = cur.fetchone()
    if not found or not found[0]:
        return None
    table, role = definition.table, found[1]
    return (
        f"table {table}'s row-level security applies to {role}, which reads its snapshot: the sinks would get "
        f"only the rows its policies show {role}; let it read every row (CREATE POLICY lr_snapshot ON {table} "
        f"FOR SELECT TO {role} USING (true)), then the next cycle goes on"
    )


def select_statement(
    definition: TableDefinition, where: sql.Composable | None = None, text: bool = False
) -> sql.Composed:
    """The source's rows of the table (``where``: a key range; ``text``: in COPY's text format, see
    ``by_text``), its columns by name: ``ONLY`` its own,
    as its capture follows only statements naming it. A table given an inheritance child after it
    was opened (the open refuses one that has any) has the child's rows in a plain ``SELECT``: they
    were copied into the sinks, where a key the child shares with the table refused every snapshot
    of it, for good."""
    cols = sql.SQL(", ").join(map(sql.Identifier, definition.column_names))
    query = sql.SQL("SELECT {} FROM ONLY {}").format(cols, definition.table.ident)
    if where is not None:
        query = sql.SQL("{} WHERE {}").format(query, where)
    return sql.SQL("COPY ({}) TO STDOUT (FORMAT {})").format(query, sql.SQL("text" if text else "binary"))


def insert_statement(
    definition: TableDefinition, target: sql.Composable | None = None, text: bool = False
) -> sql.Composed:
    cols = sql.SQL(", ").join(map(sql.Identifier, definition.column_names))
    return sql.SQL("COPY {} ({}) FROM STDIN (FORMAT {})").format(
        target or definition.table.ident, cols, sql.SQL("text" if text else "binary")
    )


def copy_rows(
    source: psycopg2.extensions.cursor,
    select: sql.Composed,
    sinks: Sequence[tuple[psycopg2.extensions.cursor, sql.Composed]],
) -> int:
    """Run ``select`` (a ``COPY ... TO STDOUT``) on ``source`` and feed its output to each sink's
    ``COPY ... FROM STDIN`` in the sinks' open transactions. Returns the bytes copied. A failure on
    any side raises here, with the sinks' transactions left for the caller to roll back.

    On connections ``lifted`` for it (a table snapshot in a cycle) each side's call is cut once no
    byte moved anywhere in the copy for the call deadline it had (``DEADLINES.stalled``): a stopped
    sink or a stalled link fails the copy instead of holding it, and the cycle, for good."""
    clock = Clock()
    readers = [_QueueReader(clock) for _ in sinks]
    failed: list[BaseException] = []

    def load(cur: psycopg2.extensions.cursor, statement: sql.Composed, reader: _QueueReader) -> None:
        try:
            with DEADLINES.stalled(cur.connection, clock):
                cur.copy_expert(statement, reader, size=COPY_BLOCK)
        except BaseException as exc:  # noqa: BLE001 - handed to the source's thread
            failed.append(exc)
            while not reader.ended:  # drain, so the source's writer never blocks on a full queue
                reader.read()

    threads = [
        threading.Thread(target=load, args=(cur, stmt, reader), daemon=True)
        for (cur, stmt), reader in zip(sinks, readers)
    ]
    for thread in threads:
        thread.start()
    tee = _Tee(readers, failed, clock)
    try:
        with DEADLINES.stalled(source.connection, clock):
            source.copy_expert(select, tee)
        tee.flush()  # the last rows (the binary trailer with them); after a failure, none: no cut row
    finally:
        for reader in readers:
            reader.chunks.put(_END)
        for thread in threads:
            thread.join()
    if failed:
        raise failed[0]
    return tee.bytes
