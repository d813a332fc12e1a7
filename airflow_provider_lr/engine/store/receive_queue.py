"""The owner of ``lr.receive_queue``: every statement that names it is here.

A sink keeps every session's entries in one table, ``seq`` the sink-side order; a session's rows
are those of its (source, client), and its *queue* is the name ``vocabulary.receive_queue_name``
gives them, registered in ``lr.registry`` so subscribers find it (``register``). Rows are in the
packed form of ``sink/queue_rows`` (this module writes and reads them as they are, it never
packs): ``kind``, the last entry's position and id, ``entry_count``, ``message``; ``delivered``
counts the leading entries a subscriber has consumed, ``visible`` is false for a full sync's rows
until it is applied.

* ``QueueWriter``: the one writer, an INSERT form (the session cycle's batches, a failover's copied
  gap) and a binary COPY form (the fan-out); ``move_staged_log`` / ``move_staged_snapshot`` move
  rows Spark jobs staged in ``lr.spark_staging`` server-side.
* the subscribers' side: ``lock_head``, ``declare_head``, ``messages``, ``consume``.
* a failover's cut: ``rows_after``, ``cut_row``, and ``consumed_position`` (``lr.receive_consumed``,
  the record of how far applications consumed a queue, which a trigger writes as rows are deleted).
* the operator's side: ``queue_report``, ``waiting``, ``drop``.
"""

from __future__ import annotations

import struct
from typing import Any, Protocol

import psycopg2
import psycopg2.extensions
from psycopg2.extras import execute_values

from airflow_provider_lr.engine.db.prepared import Prepared
from airflow_provider_lr.engine.errors import ConfigurationError
from airflow_provider_lr.engine.vocabulary import CONSUMER_LOCK_CLASS, receive_queue_name

TABLE = "lr.receive_queue"  # what a grants check names (``grants.held``): this module's table
COLUMNS = "source_site_id, client_name, kind, source_position, source_entry_id, sync_id, visible, entry_count, message"

_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")
# a visible row with no sync id after the prefix: 2, kind, 8, position, 8, entry id, NULL sync id,
# 1, visible, 4, count, message length (the fields of COLUMNS in order)
_COPY_ROW = struct.Struct(">ihiqiqiiBiii")


class Row(Protocol):
    """A row to write (``queue_rows.QueueRow``): kind, last entry's position and id, entry count, message.
    Read-only members, so a NamedTuple satisfies it."""

    @property
    def kind(self) -> int: ...
    @property
    def position(self) -> int: ...
    @property
    def entry_id(self) -> int: ...
    @property
    def entry_count(self) -> int: ...
    @property
    def message(self) -> bytes: ...


# --- the writer -----------------------------------------------------------------------------------
_INSERT_HEAD = f"INSERT INTO lr.receive_queue ({COLUMNS}) VALUES "
_INSERT = _INSERT_HEAD + "%s"  # execute_values fills in the rows
_VALUES = "(%s, %s, %s, %s, %s, %s::uuid, %s, %s, %s)"


# A stream's one row of a session's transaction (the usual one: consecutive entries pack into one
# row) and its subscribers' wake-up, prepared on the stream's sink connection: parsing and planning
# the INSERT as text cost the sink's backend a tenth to a fifth of the transaction.
STREAM_ROW = Prepared(
    "lr_stream_row_v1",
    f"WITH added AS (INSERT INTO lr.receive_queue ({COLUMNS}) VALUES (%(source)s, %(client)s, %(kind)s, "
    "%(position)s, %(entry_id)s, NULL, true, %(entry_count)s, %(message)s)) "
    "SELECT pg_catalog.pg_notify(%(channel)s, %(wakeup)s)",
    {
        "source": "pg_catalog.text",
        "client": "pg_catalog.text",
        "kind": "pg_catalog.int2",
        "position": "pg_catalog.int8",
        "entry_id": "pg_catalog.int8",
        "entry_count": "pg_catalog.int4",
        "message": "pg_catalog.bytea",
        "channel": "pg_catalog.text",
        "wakeup": "pg_catalog.text",
    },
)


class QueueWriter:
    """Rows of one session into ``lr.receive_queue``, in the caller's transaction and in the order
    given, so ``seq`` follows it.

    INSERT form: ``add`` each row, ``send`` what was added (a multi-row INSERT per 1000 rows).
    COPY form (visible rows with no sync id): ``copy_sql`` opens it, ``copy_head`` forms a row's
    binary form to a ``COPY ... FROM STDIN (FORMAT binary)`` block, ``copy_finish`` ends it.
    PostgreSQL refuses ``COPY FROM`` into a table whose row-level security applies to the caller:
    a replicator role (docs/security.md) copies into a temporary table of its transaction instead,
    which ``copy_finish`` moves into the queue in the order copied."""

    _STAGED = "lr_receive_copy"  # the COPY form's temporary table (one per transaction: ON COMMIT DROP)

    def __init__(self, source: str, client: str, sync_id: str | None = None, visible: bool = True) -> None:
        self.source, self.client, self.sync_id, self.visible = source, client, sync_id, visible
        self.rows: list[tuple] = []  # the INSERT form's rows not sent yet
        self.staged = False  # the COPY form goes through the temporary table
        raw_source, raw_client = source.encode(), client.encode()
        self.prefix = (
            _I16.pack(9)
            + _I32.pack(len(raw_source))
            + raw_source  # field count, source, client
            + _I32.pack(len(raw_client))
            + raw_client
        )

    # INSERT form
    def add(self, row: Row) -> None:
        self.rows.append(
            (
                self.source,
                self.client,
                row.kind,
                row.position,
                row.entry_id,
                self.sync_id,
                self.visible,
                row.entry_count,
                psycopg2.Binary(row.message),
            )
        )

    def send(self, cur: psycopg2.extensions.cursor) -> None:
        """INSERT the rows added (then forget them)."""
        if not self.rows:
            return
        execute_values(cur, _INSERT, self.rows, template=_VALUES, page_size=1000)
        self.rows.clear()

    def statement(self, cur: psycopg2.extensions.cursor) -> bytes:
        """The INSERT of the rows added, as a statement for the caller to send with its next one (then
        forget them); empty when there are none."""
        if not self.rows:
            return b""
        values = b",".join(cur.mogrify(_VALUES, row) for row in self.rows)
        self.rows.clear()
        return _INSERT_HEAD.encode() + values

    def stream_statement(self, cur: psycopg2.extensions.cursor, channel: str, wakeup: str) -> bytes:
        """The rows added and their subscribers' wake-up (``pg_notify(channel, wakeup)``), as statements
        for a stream's one-round-trip transaction (then forget the rows): a single row, the usual, by
        ``STREAM_ROW``, prepared on ``cur``'s connection; several by the INSERT form."""
        assert self.rows and self.sync_id is None and self.visible, "a stream writes visible rows of no sync"
        if len(self.rows) > 1:
            return self.statement(cur) + b"; " + cur.mogrify("SELECT pg_notify(%s, %s)", (channel, wakeup))
        source, client, kind, position, entry_id, _, _, entry_count, message = self.rows.pop()
        params = {"source": source, "client": client, "kind": kind, "position": position, "entry_id": entry_id}
        params.update(entry_count=entry_count, message=message, channel=channel, wakeup=wakeup)
        return cur.mogrify(STREAM_ROW.execute_sql, params)

    # COPY form
    def copy_sql(self, conn: psycopg2.extensions.connection) -> str:
        """The COPY statement of this transaction's blocks (the temporary table made first when
        row-level security applies)."""
        assert self.sync_id is None and self.visible, "the COPY form writes visible rows of no sync"
        self.staged = _rls_applies(conn)
        if not self.staged:
            return f"COPY lr.receive_queue ({COLUMNS}) FROM STDIN (FORMAT binary)"
        with conn.cursor() as cur:
            cur.execute(
                f"CREATE TEMP TABLE {self._STAGED} (ord bigint GENERATED ALWAYS AS IDENTITY, source_site_id text, "
                "client_name text, kind smallint, source_position bigint, source_entry_id bigint, sync_id uuid, "
                "visible boolean, entry_count integer, message bytea) ON COMMIT DROP"
            )
        return f"COPY {self._STAGED} ({COLUMNS}) FROM STDIN (FORMAT binary)"

    def copy_head(self, row: Row) -> bytes:
        """A row in binary COPY form up to its message, which follows it (packs are ~8 kB: the
        caller keeps the message as it is, with no copy of the row made first)."""
        return self.prefix + _COPY_ROW.pack(
            2, row.kind, 8, row.position, 8, row.entry_id, -1, 1, 1, 4, row.entry_count, len(row.message)
        )

    def copy_finish(self, conn: psycopg2.extensions.connection) -> int | None:
        """After the last block: the temporary table's rows into the queue in the order copied;
        how many (None: the COPY went straight into the queue, its blocks counted them)."""
        if not self.staged:
            return None
        with conn.cursor() as cur:
            cur.execute(f"INSERT INTO lr.receive_queue ({COLUMNS}) SELECT {COLUMNS} FROM {self._STAGED} ORDER BY ord")
            moved = cur.rowcount
            cur.execute(f"DROP TABLE {self._STAGED}")
        return moved


def _rls_applies(conn: psycopg2.extensions.connection) -> bool:
    """Whether row-level security applies to this connection's role on ``lr.receive_queue`` (not to
    its owner, a superuser or a BYPASSRLS role)."""
    with conn.cursor() as cur:
        cur.execute("SELECT row_security_active('lr.receive_queue')")
        return bool(cur.fetchone()[0])


# a session's staged log entries in (last, reach]: the rows a publish moves
_STAGED_LOG = (
    "source_position > %(last)s AND source_position <= %(reach)s AND source_site_id = %(source)s "
    "AND client_name = %(client)s AND sync_id IS NULL"
)


def move_staged_log(cur: psycopg2.extensions.cursor, source: str, client: str, last: int, reach: int) -> int:
    """The session's staged log entries in ``(last, reach]`` (``bulk/staged_tee``) into the queue,
    visible, in (position, entry id) order; how many entries moved. ``drop_staged_log`` removes
    them from the stage once the caller has checked the count."""
    where = {"source": source, "client": client, "last": last, "reach": reach}
    # the staging table has no statistics worth the name (rows come and go by the chunk): a
    # sequential scan would read every session's packs and the dead ones of earlier publishes
    cur.execute("SET LOCAL enable_seqscan = off; SET LOCAL enable_sort = off; SET LOCAL enable_bitmapscan = off")
    cur.execute(  # in the staging key's order: an index range scan, no sort of the packs
        "WITH queued AS (INSERT INTO lr.receive_queue (source_site_id, client_name, kind, source_position, "
        " source_entry_id, visible, entry_count, message) SELECT source_site_id, client_name, kind, "
        " source_position, source_entry_id, true, entry_count, message FROM lr.spark_staging "
        " WHERE " + _STAGED_LOG + " ORDER BY source_position, source_entry_id RETURNING entry_count) "
        "SELECT coalesce(sum(entry_count), 0) FROM queued",
        where,
    )
    return cur.fetchone()[0]


def drop_staged_log(cur: psycopg2.extensions.cursor, source: str, client: str, last: int, reach: int) -> None:
    """Remove from the stage what ``move_staged_log`` moved."""
    cur.execute(
        "DELETE FROM lr.spark_staging WHERE " + _STAGED_LOG,
        {"source": source, "client": client, "last": last, "reach": reach},
    )


def move_staged_snapshot(
    cur: psycopg2.extensions.cursor, source: str, client: str, sync_id: str, after: int, end_kind: int
) -> tuple[int, int | None, bool]:
    """A full sync's staged rows after entry ``after`` (``bulk/snapshot_transfer``) into the queue,
    invisible, in entry order: (entries moved, the last entry id moved, whether the ``end_kind``
    marker was among them)."""
    cur.execute(
        "WITH moved AS (INSERT INTO lr.receive_queue (source_site_id, client_name, kind, source_position, "
        " source_entry_id, sync_id, visible, entry_count, message) "
        " SELECT source_site_id, client_name, kind, source_position, source_entry_id, sync_id, false, "
        " entry_count, message FROM lr.spark_staging WHERE source_site_id = %s AND client_name = %s "
        " AND sync_id = %s AND source_entry_id > %s ORDER BY source_entry_id "
        " RETURNING source_entry_id, kind, entry_count) "
        "SELECT coalesce(sum(entry_count), 0), max(source_entry_id), coalesce(bool_or(kind = %s), false) "
        "FROM moved",
        (source, client, sync_id, after, end_kind),
    )
    moved, last, ended = cur.fetchone()
    return moved, last, ended


# --- a session's rows as a whole ------------------------------------------------------------------
def discard_invisible(cur: psycopg2.extensions.cursor, source: str, client: str) -> None:
    """Drop the session's rows never made visible (a full sync's, not applied)."""
    cur.execute(
        "DELETE FROM lr.receive_queue WHERE source_site_id = %s AND client_name = %s AND NOT visible", (source, client)
    )


def make_visible(cur: psycopg2.extensions.cursor, source: str, client: str, sync_id: str | None) -> None:
    """A full sync's rows become visible (it is applied)."""
    cur.execute(
        "UPDATE lr.receive_queue SET visible = true "
        "WHERE source_site_id = %s AND client_name = %s AND sync_id = %s AND NOT visible",
        (source, client, sync_id),
    )


def is_empty(cur: psycopg2.extensions.cursor, source: str, client: str) -> bool:
    """Whether the session holds no row on this sink, visible or not."""
    cur.execute(
        "SELECT NOT EXISTS (SELECT 1 FROM lr.receive_queue WHERE source_site_id = %s AND client_name = %s)",
        (source, client),
    )
    return cur.fetchone()[0]


def register(cur: psycopg2.extensions.cursor, source: str, client: str) -> None:
    """Register the session's queue so subscribers discover it by prefix (idempotent). A name once
    registered for another session (client ``a_b`` from ``c``, then client ``a`` from ``b_c`` in a
    later topology) is taken over when nothing of that session waits in the queue; otherwise the
    write is refused: registering nothing would hide this session's data from its subscribers."""
    name = receive_queue_name(client, source)
    cur.execute(
        "INSERT INTO lr.registry (stream_name, kind, stream_tags, source_site_id, client_name) "
        "VALUES (%s, 'receive_queue', ARRAY[%s], %s, %s) ON CONFLICT (stream_name) DO NOTHING",
        (name, f"lrq_recv_{client}", source, client),
    )
    cur.execute("SELECT source_site_id, client_name FROM lr.registry WHERE stream_name = %s", (name,))
    owner = tuple(cur.fetchone())
    if owner == (source, client):
        return
    cur.execute("SELECT 1 FROM lr.receive_queue WHERE source_site_id = %s AND client_name = %s LIMIT 1", owner)
    if cur.fetchone() is not None:
        raise ConfigurationError(
            f"receive queue {name!r} on this sink still holds entries of client {owner[1]!r} from {owner[0]!r}; "
            f"client {client!r} from {source!r} would get the same queue name. Let the subscribers "
            "drain it, or rename the client or site (avoid '_' in their names)"
        )
    cur.execute(
        "UPDATE lr.registry SET kind = 'receive_queue', stream_tags = ARRAY[%s], source_site_id = %s, "
        "client_name = %s WHERE stream_name = %s",
        (f"lrq_recv_{client}", source, client, name),
    )


# --- the subscribers' side ------------------------------------------------------------------------
# The consumer lock's outcome, for the statements after it in the delivery transaction (a setting
# local to the transaction: it ends with it).
_LOCKED = "pg_catalog.current_setting('lr.receive_locked')::pg_catalog.bool"
_LOCK = (
    "SELECT pg_catalog.set_config('lr.receive_locked', "
    "pg_catalog.pg_try_advisory_xact_lock(%(lock_class)s, pg_catalog.hashtext(%(queue)s))::pg_catalog.text, true)"
)
# the head's columns: (seq, kind, entry_count, delivered, message length, message when it is at most
# %(inline)s bytes, else NULL), of the queue's visible rows
_HEAD = (
    "seq, kind, entry_count, delivered, pg_catalog.octet_length(message), "
    "CASE WHEN pg_catalog.octet_length(message) OPERATOR(pg_catalog.<=) %(inline)s THEN message END "
    "FROM lr.receive_queue WHERE client_name OPERATOR(pg_catalog.=) %(client)s "
    "AND source_site_id OPERATOR(pg_catalog.=) %(source)s AND visible"
)
# the snapshot barrier: the lowest seq of an invisible row (a full sync still being transferred)
_BARRIER = (
    "(SELECT pg_catalog.min(seq) FROM lr.receive_queue WHERE source_site_id OPERATOR(pg_catalog.=) %(source)s "
    "AND client_name OPERATOR(pg_catalog.=) %(client)s AND NOT visible)"
)

_FIRST = f"SELECT {_BARRIER}, {_HEAD} AND {_LOCKED} ORDER BY seq LIMIT %(limit)s"  # the first rows, with the lock
# prepared on a subscriber's delivery connection: planning it costs more than running it
HEAD = Prepared(
    "lr_receive_head_v2",  # versioned: another lr's statement of this name is never taken for this one
    _FIRST,
    {"source": "pg_catalog.text", "client": "pg_catalog.text", "inline": "pg_catalog.int4", "limit": "pg_catalog.int8"},
)


def lock_head(
    cur: psycopg2.extensions.cursor,
    source: str,
    client: str,
    inline_bytes: int,
    limit: int,
    begin: bool = False,
    prepared: bool = False,
) -> tuple[bool, int | None, list[tuple]]:
    """Take the queue's consumer lock for this transaction and read its first ``limit`` visible
    rows (the head's columns: seq, kind, entry_count, delivered, message length, message when it is
    at most ``inline_bytes``, else None) with the snapshot barrier, in one round trip (``begin``: the
    transaction's BEGIN rides with it too; ``prepared``: ``HEAD`` was prepared on the connection):
    (locked, the lowest seq of an invisible row, the rows).

    The lock and the read are two statements: the read's snapshot is taken after the lock is held,
    so it sees everything the previous holder of the lock committed (a statement that took the lock
    itself would read with a snapshot from before it). An empty read asks once more whether the
    lock was taken: the queue is empty, or another consumer holds it (nothing read, locked False)."""
    params = {
        "lock_class": CONSUMER_LOCK_CLASS,
        "queue": receive_queue_name(client, source),
        "inline": inline_bytes,
        "client": client,
        "source": source,
        "limit": limit,
    }
    cur.execute(
        ("BEGIN; " if begin else "") + f"{_LOCK}; " + (HEAD.execute_sql if prepared else _FIRST),
        params,
    )
    rows = cur.fetchall()
    if rows:
        return True, rows[0][0], [row[1:] for row in rows]
    cur.execute(f"SELECT {_LOCKED}")
    return cur.fetchone()[0], None, []


def declare_head(
    cur: psycopg2.extensions.cursor, name: str, source: str, client: str, inline_bytes: int, after: int
) -> bytes:
    """The statement that declares the cursor ``name`` (it ends with the transaction) over the
    queue's visible rows after ``after`` in ``seq`` order, the head's columns, for the caller to
    send with its first ``FETCH`` from it."""
    return cur.mogrify(
        f"DECLARE {name} NO SCROLL CURSOR FOR SELECT {_HEAD} AND seq OPERATOR(pg_catalog.>) %(after)s ORDER BY seq; ",
        {"inline": inline_bytes, "client": client, "source": source, "after": after},
    )


def messages(cur: psycopg2.extensions.cursor, seqs: list[int]) -> dict[int, Any]:
    """The messages of the rows ``seqs`` (those still there)."""
    cur.execute("SELECT seq, message FROM lr.receive_queue WHERE seq OPERATOR(pg_catalog.=) ANY(%s)", (seqs,))
    return dict(cur.fetchall())


def consume(
    cur: psycopg2.extensions.cursor, finished: list[int], partial: tuple[int, int] | None, commit: bool = False
) -> None:
    """Delivered: the rows ``finished`` are deleted, ``partial`` = (entries delivered, seq) records
    how far a row was delivered, in one round trip (``commit``: the transaction's COMMIT too)."""
    statements: list[str] = []
    params: list[Any] = []
    if finished:
        statements.append("DELETE FROM lr.receive_queue WHERE seq OPERATOR(pg_catalog.=) ANY(%s)")
        params.append(finished)
    if partial is not None:
        statements.append("UPDATE lr.receive_queue SET delivered = %s WHERE seq OPERATOR(pg_catalog.=) %s")
        params.extend(partial)
    if commit:
        statements.append("COMMIT")
    if statements:
        cur.execute("; ".join(statements), params)


# --- a failover's cut -----------------------------------------------------------------------------
def consumed_position(cur: psycopg2.extensions.cursor, source: str, client: str) -> int:
    """The highest position of ``source``'s entries this site's applications consumed whole (-1: none)."""
    cur.execute(
        "SELECT position FROM lr.receive_consumed WHERE source_site_id = %s AND client_name = %s", (source, client)
    )
    row = cur.fetchone()
    return row[0] if row else -1


def rows_after(
    cur: psycopg2.extensions.cursor, source: str, client: str, after: int
) -> list[tuple[int, int, int, int, int, int, bytes]]:
    """The visible rows of the session that hold entries after position ``after``, in ``seq``
    order: (seq, kind, entry_count, delivered, last position, last entry id, message)."""
    cur.execute(
        "SELECT seq, kind, entry_count, delivered, source_position, source_entry_id, message FROM lr.receive_queue "
        "WHERE source_site_id = %s AND client_name = %s AND visible AND source_position > %s ORDER BY seq",
        (source, client, after),
    )
    return [
        (seq, kind, count, delivered, position, entry_id, bytes(message))
        for seq, kind, count, delivered, position, entry_id, message in cur.fetchall()
    ]


def cut_row(cur: psycopg2.extensions.cursor, seq: int, keep: int, position: int | None, message: bytes | None) -> None:
    """A row cut to its first ``keep`` entries (the last at ``position``, ``message`` their packed
    form); ``keep`` 0 deletes it."""
    if keep == 0:
        cur.execute("DELETE FROM lr.receive_queue WHERE seq = %s", (seq,))
    else:
        cur.execute(
            "UPDATE lr.receive_queue SET entry_count = %s, source_position = %s, message = %s WHERE seq = %s",
            (keep, position, psycopg2.Binary(message), seq),
        )


# --- the operator's side --------------------------------------------------------------------------
def queue_report(cur: psycopg2.extensions.cursor) -> list[tuple[str, str, int, int, float, int]]:
    """Per session queue on this sink (dead letters of a queue emptied since included): (source,
    client, entries waiting for subscribers, snapshot entries not applied, age in seconds of the
    oldest waiting row, never below 0 though rows may have arrived after this transaction began,
    dead letters)."""
    cur.execute(
        """
        SELECT q.source_site_id, q.client_name,
               coalesce(sum(q.entry_count - q.delivered) FILTER (WHERE q.visible), 0)::bigint,
               coalesce(sum(q.entry_count) FILTER (WHERE NOT q.visible), 0)::bigint,
               greatest(extract(epoch FROM now() - min(q.received_at) FILTER (WHERE q.visible)), 0)::float8,
               (SELECT count(*) FROM lr.receive_dead_letters d
                WHERE d.source_site_id = q.source_site_id AND d.client_name = q.client_name)
        FROM lr.receive_queue q GROUP BY 1, 2
        UNION
        SELECT d.source_site_id, d.client_name, 0, 0, 0.0, count(*)
        FROM lr.receive_dead_letters d
        WHERE NOT EXISTS (SELECT 1 FROM lr.receive_queue q
                          WHERE q.source_site_id = d.source_site_id AND q.client_name = d.client_name)
        GROUP BY 1, 2
        ORDER BY 1, 2
        """
    )
    return cur.fetchall()


def waiting(cur: psycopg2.extensions.cursor, source: str, client: str) -> int:
    """Entries of the session's queue that wait for subscribers."""
    cur.execute(
        "SELECT coalesce(sum(entry_count - delivered), 0) FROM lr.receive_queue "
        "WHERE source_site_id = %s AND client_name = %s AND visible",
        (source, client),
    )
    return cur.fetchone()[0]


def drop(cur: psycopg2.extensions.cursor, source: str, client: str) -> None:
    """Remove the session's queue: its rows and its registration."""
    cur.execute("DELETE FROM lr.receive_queue WHERE source_site_id = %s AND client_name = %s", (source, client))
    cur.execute(
        "DELETE FROM lr.registry WHERE kind = 'receive_queue' AND source_site_id = %s AND client_name = %s",
        (source, client),
    )
