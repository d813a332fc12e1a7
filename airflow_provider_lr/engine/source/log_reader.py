"""Reading the shared log for one destination: complete, in commit order, whole transactions.

Why not ``entry_id > last_seen``: ids come from a sequence before commit, so a transaction that
commits late has a smaller id than entries already read and would be skipped forever. Why not xid
order below ``pg_snapshot_xmin``: complete, but not commit order, so two transactions that touch the
same application row can arrive swapped. lr instead reads by *commit position*, drawn at commit
time under a shared advisory lock (see ``V0002__shared_log.sql``), behind the commit barrier
(``commit_barrier``: every position up to the one it returns is final), or, for a stream reading
again at once, up to the final prefix (``LogReader.read_stream(final=True)``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import psycopg2
import psycopg2.extensions

from airflow_provider_lr.engine.errors import ConfigurationError, TrimmedError
from airflow_provider_lr.engine.source.commit_barrier import HoldBack, commit_barrier
from airflow_provider_lr.engine.vocabulary import STREAM_LOG_ENTRIES, STREAM_TABLE_CHANGES
from airflow_provider_lr.proto import lr_pb2

DEFAULT_MAX_ENTRIES = 10_000
DEFAULT_MAX_BYTES = 16 * 1024 * 1024
# A read fetches at most FETCH_ROWS rows per round trip, and at most ``fetch_bytes(max_bytes)`` of
# messages: a message larger than that over FETCH_ROWS comes back out of line (NULL in the cursor's
# row, its size beside it) and is fetched by key with its neighbours, up to that many bytes at once.
FETCH_ROWS = 2000
MIN_FETCH_BYTES = 1 << 20
MAX_FETCH_BYTES = 8 << 20


def fetch_bytes(max_bytes: int) -> int:
    """Bytes of messages one round trip of a read may bring, from the batch's byte budget: half of
    it (so a batch takes a few round trips, not one huge one), between 1 and 8 MiB."""
    return min(MAX_FETCH_BYTES, max(MIN_FETCH_BYTES, max_bytes // 2))


@dataclass(frozen=True)
class LogRecord:
    position: int  # commit position of the entry's transaction
    entry_id: int  # transmit order within the transaction
    message: bytes  # serialized RoutingTableEntryMsg (a table change: lr's capture format)
    table_id: int | None = None  # a federated table's change (stream 3): which table

    def decode(self) -> lr_pb2.RoutingTableEntryMsg:
        return lr_pb2.RoutingTableEntryMsg.FromString(self.message)


@dataclass(frozen=True)
class BaseSplit:
    """How a full sync's base snapshot splits the log: entries with a commit position <= ``upto``
    whose transaction is visible in ``snapshot`` (a ``pg_snapshot``) were covered by the full sync."""

    snapshot: str
    upto: int


@dataclass(frozen=True)
class TableSplits:
    """The federated tables a session's sink has synced (their ``table_id``s) and the split of each
    one's snapshot: the read brings their changes (stream 3) with the session's entries, less the
    changes a table's snapshot already holds (position <= upto and visible in its snapshot: the
    same rule as ``BaseSplit``). Changes of other tables are left out: a table not synced yet gets
    a snapshot, taken after everything the sink has read, which holds them."""

    ids: tuple[int, ...] = ()
    uptos: tuple[int, ...] = ()
    snapshots: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.ids)

    def params(self) -> dict:
        return {
            "t_ids": list(self.ids),
            "t_uptos": list(self.uptos),
            "t_snaps": list(self.snapshots),
            "t_stream": STREAM_TABLE_CHANGES,
        }


# The entries a read takes of one commit (``e``, lateral to ``c`` the commit): the stream's own,
# and, with tables, the synced tables' changes their snapshots do not hold.
_TABLES_CLAUSE = """OR (e.stream = %(t_stream)s AND e.table_id = ANY (%(t_ids)s::int[]) AND NOT EXISTS (
                    SELECT 1 FROM unnest(%(t_ids)s::int[], %(t_uptos)s::bigint[], %(t_snaps)s::text[]) s(id, upto, snap)
                    WHERE s.id = e.table_id AND {c}.position <= s.upto
                      AND pg_visible_in_snapshot({c}.tx, s.snap::pg_snapshot)))"""


@dataclass
class LogBatch:
    """Entries for one destination in ``(after, end]``; persist ``end`` to resume after it."""

    after: int
    end: int
    records: list[LogRecord] = field(default_factory=list)
    barrier: int = 0  # everything up to here was final when the batch was read
    blocked_by: list[HoldBack] = field(default_factory=list)

    @property
    def has_more(self) -> bool:
        return self.end < self.barrier

    @property
    def bytes(self) -> int:
        return sum(len(r.message) for r in self.records)

    @property
    def entries(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[LogRecord]:
        return iter(self.records)

    def __enter__(self) -> LogBatch:  # read already: used where a LogStream would be
        return self

    def __exit__(self, *exc: object) -> None:
        pass


@dataclass(frozen=True)
class StreamRead:
    """What a ``LogStream`` with entries to read runs: its query (in the read's snapshot, open on the
    connection) and the bounds its batch stops at (whole transactions: the first boundary past one)."""

    query: tuple[str, dict]
    max_entries: int = DEFAULT_MAX_ENTRIES
    max_bytes: int = DEFAULT_MAX_BYTES


class LogStream:
    """A ``LogBatch`` read as it is consumed (``LogReader.read_stream``): iterating yields the entries in
    (position, entry id) order without ever holding more than about ``fetch_bytes`` of them, so a
    batch is bounded by bytes in memory too, even when it is one source transaction larger than
    ``max_bytes`` (a transaction is never split: the batch still ends at a transaction boundary).

    ``end`` is an upper bound until the entries have been read, then the batch's end (persist it to
    resume after it). The read's REPEATABLE READ transaction on the source stays open until the
    entries are read or ``close`` (use it as a context manager). Read once."""

    def __init__(
        self,
        conn: psycopg2.extensions.connection,
        after: int,
        end: int,
        barrier: int,
        blocked_by: list[HoldBack] | None = None,
        read: StreamRead | None = None,
    ) -> None:
        self.conn = conn
        self.after, self.end, self.barrier = after, end, barrier
        self.blocked_by = blocked_by or []
        self.fetch_bytes = fetch_bytes(read.max_bytes if read is not None else DEFAULT_MAX_BYTES)
        self.entries = 0  # read so far
        self.bytes = 0  # of their messages
        self._read = read  # None: nothing to read (no transaction open)
        self._started = False

    @property
    def has_more(self) -> bool:
        return self.end < self.barrier

    def __enter__(self) -> LogStream:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(quiet=exc_type is not None)

    def close(self, quiet: bool = False) -> None:
        """End the read's transaction (``quiet``: on an error path, keep the caller's error)."""
        if self._read is None:
            return
        self._read = None
        if self.conn.closed:
            return
        try:
            self.conn.rollback()
        except psycopg2.Error:
            if not quiet:
                raise

    def collect(self) -> LogBatch:
        """All of it in memory, as a ``LogBatch`` (tests and small reads; the session path streams)."""
        with self:
            records = list(self)
        return LogBatch(
            after=self.after, end=self.end, records=records, barrier=self.barrier, blocked_by=self.blocked_by
        )

    def __iter__(self) -> Iterator[LogRecord]:
        if self._started:
            raise RuntimeError("a LogStream is read once")
        self._started = True
        if self._read is None:
            return
        (sql, params), max_entries, max_bytes = self._read.query, self._read.max_entries, self._read.max_bytes
        inline = max(1, self.fetch_bytes // FETCH_ROWS)
        group: list[
            tuple[int, int, str, int | None]
        ] = []  # consecutive out-of-line entries: (position, entry id, tx, table)
        group_bytes = 0
        last: int | None = None
        try:
            with self.conn.cursor(name=f"lr_read_{id(self)}") as cur:
                cur.itersize = FETCH_ROWS  # a round trip brings at most FETCH_ROWS * inline bytes
                cur.execute(sql, {**params, "inline": inline})
                for position, entry_id, size, message, tx, table_id in cur:
                    if (
                        last is not None
                        and position != last
                        and (self.entries >= max_entries or self.bytes >= max_bytes)
                    ):
                        self.end = last  # whole transactions only: stop at this boundary
                        break
                    last = position
                    self.entries += 1
                    self.bytes += size
                    if message is None:  # out of line: fetched with its out-of-line neighbours
                        if group and group_bytes + size > self.fetch_bytes:
                            yield from self._out_of_line(group)
                            group, group_bytes = [], 0
                        group.append((position, entry_id, tx, table_id))
                        group_bytes += size
                        continue
                    if group:
                        yield from self._out_of_line(group)
                        group, group_bytes = [], 0
                    yield LogRecord(position, entry_id, bytes(message), table_id)
                if group:
                    yield from self._out_of_line(group)
        finally:
            self.close(quiet=True)

    def _out_of_line(self, group: list[tuple[int, int, str, int | None]]) -> Iterator[LogRecord]:
        """The messages of ``group`` (at most ``fetch_bytes``, or one entry), by key, in the read's
        snapshot; yielded in order, each dropped once handed over."""
        with self.conn.cursor() as cur:
            cur.execute(
                "SELECT e.entry_id, e.message FROM unnest(%s::text[]::xid8[], %s::bigint[]) AS k(tx, entry_id) "
                "JOIN lr.log_entries e ON e.tx = k.tx AND e.entry_id = k.entry_id",
                ([tx for _, _, tx, _ in group], [entry_id for _, entry_id, _, _ in group]),
            )
            found = dict(cur.fetchall())
        for position, entry_id, _, table_id in group:
            yield LogRecord(position, entry_id, bytes(found.pop(entry_id)), table_id)


class LogReader:
    """Reads one destination's entries from a source site's shared log."""

    def __init__(
        self,
        conn: psycopg2.extensions.connection,
        destination: str,
        stream: int = STREAM_LOG_ENTRIES,
        barrier_timeout: float = 5.0,
        client_name: str | None = None,
    ) -> None:
        self.conn = conn
        self.destination = destination
        self.stream = stream
        self.barrier_timeout = barrier_timeout
        self.client_id: int | None = None
        with conn.cursor() as cur:
            cur.execute("SELECT tag_id FROM lr.remote_sites WHERE site_id = %s", (destination,))
            row = cur.fetchone()
            if client_name is not None:
                cur.execute("SELECT client_id FROM lr.clients WHERE client_name = %s", (client_name,))
                client = cur.fetchone()
                if client is None:
                    conn.rollback()
                    raise ConfigurationError(f"client {client_name!r} is not in the topology applied to this source")
                self.client_id = client[0]
        conn.rollback()
        if row is None:
            raise ConfigurationError(f"destination {destination!r} is not a known remote site of this source")
        self.tag_id: int = row[0]

    def read_stream(
        self,
        after: int,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        max_bytes: int = DEFAULT_MAX_BYTES,
        split: BaseSplit | None = None,
        final: bool = False,
        tables: TableSplits | None = None,
        until: int | None = None,
    ) -> LogStream:
        """Entries after ``after`` (a persisted ``end``), whole transactions only, bounded by count and
        bytes (a single larger transaction is still returned whole); ``split``: leave out what a
        full sync with that base snapshot already covered; ``tables``: the session's synced federated
        tables, whose changes come along (``TableSplits``). Read as they are consumed (see
        ``LogStream``; ``collect()`` for a ``LogBatch``): what a batch holds in memory is bounded by
        bytes whatever the size of its transactions. The barrier (or,
        ``final``, the final prefix) and the trim check (``TrimmedError``) happen here, before
        anything is read. ``until``: no further than that position (a cut taken earlier, which
        commits since then must not pass)."""
        if final:
            return self._read_final(after, max_entries, max_bytes, split, tables)
        upto, blocked = commit_barrier(self.conn, self.barrier_timeout)
        if upto is None:  # a commit in flight outlasted the timeout: no position is known final
            return LogStream(self.conn, after, after, after, blocked)
        if until is not None:
            upto = min(upto, until)
        if upto <= after:
            return LogStream(self.conn, after, max(after, upto), upto)
        check_trim(self.conn, after, f"destination {self.destination!r}")  # starts the read's snapshot
        read = StreamRead(self._query(after, upto, split, tables), max_entries, max_bytes)
        return LogStream(self.conn, after, upto, upto, [], read)

    def _read_final(
        self, after: int, max_entries: int, max_bytes: int, split: BaseSplit | None, tables: TableSplits | None
    ) -> LogStream:
        """``read_stream`` without the barrier, for a reader that reads again at once (streaming):
        reads the *final prefix* after ``after``, the positions ``after + 1, after + 2, ...`` that
        are all committed in the read's snapshot, up to the first one that is not.

        Why that is complete and in commit order: positions are drawn one by one from a sequence at
        commit, and a position present in a snapshot is committed; when every position up to ``end``
        is present, no transaction still in flight holds one of them, so none can appear there
        later. A position missing from the middle is a commit in flight (it shows up in a moment)
        or a transaction that rolled back after drawing it (it never does): the stream's
        ``barrier`` is then the highest committed position, above ``end``, and the caller, seeing
        no progress, decides with ``read_stream``'s barrier. Costs no ``pg_locks`` read."""
        end, highest = check_trim(
            self.conn,
            after,
            f"destination {self.destination!r}",  # the read's snapshot
            (FINAL_PREFIX_SQL, {"after": after, "scan": max(1, max_entries)}),
        )
        if end <= after:
            self.conn.rollback()
            return LogStream(self.conn, after, after, max(after, highest))
        read = StreamRead(self._query(after, end, split, tables), max_entries, max_bytes)
        return LogStream(self.conn, after, end, max(end, highest), [], read)

    def read_final_batch(
        self,
        after: int,
        max_bytes: int = DEFAULT_MAX_BYTES,
        split: BaseSplit | None = None,
        tables: TableSplits | None = None,
    ) -> LogBatch | None:
        """The final prefix after ``after`` in ONE statement (one snapshot: trim mark, prefix and
        entries together), for a stream reading again at once: a whole batch when it is small (at
        most ``FETCH_ROWS`` entries, each inline), else None and the caller takes
        ``read_stream(final=True)``, which bounds what it holds by bytes. One round trip on an
        autocommit connection (two otherwise: the statement and its rollback) where the general
        read takes six: a stream under load reads
        hundreds of times a second, and each read is work the source server does beside its writers."""
        clauses, params = self._filters("f", after, split, tables)
        params.update(
            after=after, scan=FETCH_ROWS, rows=FETCH_ROWS + 1, inline=max(1, fetch_bytes(max_bytes) // FETCH_ROWS)
        )
        try:
            with self.conn.cursor() as cur:
                cur.execute(_FINAL_BATCH_SQL.format(**clauses), params)
                rows = cur.fetchall()
        finally:
            if not self.conn.autocommit:  # on an autocommit connection the statement was all of it
                self.conn.rollback()
        mark, end, highest = rows[0][:3]
        if mark > after:
            raise trimmed_error(f"destination {self.destination!r}", after, mark)
        entries = [r[3:] for r in rows if r[3] is not None]
        if len(entries) > FETCH_ROWS or any(message is None for _, _, message, _ in entries):
            return None  # large: read by the general path
        return LogBatch(after, end, [LogRecord(p, e, bytes(m), t) for p, e, m, t in entries], max(end, highest))

    def _filters(
        self, commit: str, after: int, split: BaseSplit | None, tables: TableSplits | None
    ) -> tuple[dict[str, str], dict]:
        """What both reads add to their query, for the commit row ``commit``: the client's entries only,
        less what the base snapshot ``split`` covered, plus the synced tables' changes (``tables``).
        Returns the clauses (``client``, ``covered``, ``tables``) and their parameters."""
        params: dict = {"stream": self.stream, "tag": self.tag_id, "client": self.client_id}
        clauses = {
            "client": "AND e.client_id = %(client)s" if self.client_id is not None else "",
            "covered": "",
            "tables": "",
        }
        if split is not None and split.upto > after:
            clauses["covered"] = (
                f"AND NOT ({commit}.position <= %(split_upto)s "
                f"AND pg_visible_in_snapshot({commit}.tx, %(split_snap)s::pg_snapshot))"
            )
            params.update(split_upto=split.upto, split_snap=split.snapshot)
        if tables:
            clauses["tables"] = _TABLES_CLAUSE.format(c=commit)
            params.update(tables.params())
        return clauses, params

    def _query(
        self, after: int, upto: int, split: BaseSplit | None, tables: TableSplits | None = None
    ) -> tuple[str, dict]:
        """The read of this destination's entries with positions in ``(after, upto]``, in (position,
        entry id) order, less what the base snapshot ``split`` covered (and, with ``tables``, the
        synced tables' changes less what their snapshots hold)."""
        clauses, params = self._filters("c", after, split, tables)
        params.update(after=after, upto=upto)
        client, covered, extra = clauses["client"], clauses["covered"], clauses["tables"]
        sql = f"""
            SELECT c.position, e.entry_id, octet_length(e.message),
                   CASE WHEN octet_length(e.message) <= %(inline)s THEN e.message END, c.tx::text, e.table_id
            FROM lr.log_commits c
            CROSS JOIN LATERAL (
                SELECT e.entry_id, e.message, e.table_id FROM lr.log_entries e
                WHERE e.tx = c.tx AND e.tag_ids @> ARRAY[%(tag)s] {client}
                  AND (e.stream = %(stream)s {extra})
                OFFSET 0  -- keeps this a per-commit index lookup: drive the read by position range
            ) e
            WHERE c.position > %(after)s AND c.position <= %(upto)s {covered}
            ORDER BY c.position, e.entry_id
            """
        return sql, params


# The final prefix after a position, once for both reads that take it: ``f`` is the longest run
# after + 1, after + 2, ... of committed positions (at most ``scan`` of them, by the primary key),
# and ``FINAL_ENDS`` its end and the highest committed position.
FINAL_PREFIX = """
WITH d AS (
    SELECT position, tx, position - row_number() OVER (ORDER BY position) AS gap
    FROM (SELECT position, tx FROM lr.log_commits WHERE position > %(after)s ORDER BY position LIMIT %(scan)s) p
), f AS (SELECT position, tx FROM d WHERE gap = %(after)s)
"""
FINAL_ENDS = (
    "coalesce((SELECT max(position) FROM f), %(after)s) AS final_end, "
    "coalesce((SELECT max(position) FROM lr.log_commits), 0) AS highest"
)
FINAL_PREFIX_SQL = FINAL_PREFIX + "SELECT " + FINAL_ENDS


# ``read_final_batch``'s one statement: the trim mark, the final prefix's end, the highest committed
# position and the destination's entries in the prefix (at most ``rows``; a message over ``inline``
# bytes comes back NULL), a row each (one row with NULL entry columns when there is none).
_FINAL_BATCH_SQL = (
    FINAL_PREFIX
    + """
SELECT (SELECT trim_mark FROM lr.log_trim), """
    + FINAL_ENDS
    + """, r.position, r.entry_id, r.message, r.table_id
FROM (SELECT 1) one LEFT JOIN LATERAL (
    SELECT f.position, e.entry_id, CASE WHEN octet_length(e.message) <= %(inline)s THEN e.message END AS message,
           e.table_id
    FROM f CROSS JOIN LATERAL (
        SELECT e.entry_id, e.message, e.table_id FROM lr.log_entries e
        WHERE e.tx = f.tx AND e.tag_ids @> ARRAY[%(tag)s] {client} AND (e.stream = %(stream)s {tables})
        OFFSET 0  -- a per-commit index lookup, as the general read
    ) e
    WHERE true {covered}
    ORDER BY f.position, e.entry_id LIMIT %(rows)s
) r ON true
"""
)


def snapshot_trim_mark(conn: psycopg2.extensions.connection, also: tuple[str, dict] | None = None) -> tuple:
    """Open a REPEATABLE READ transaction on ``conn`` and return the trim mark in its snapshot (and
    the columns of the one-row query ``also`` after it, read in the same snapshot and round trip).

    Every read of log entries runs in such a transaction, after this: the trim deletes entries and
    raises the mark in one transaction, so the snapshot sees both or neither, and a trim that
    commits meanwhile cannot remove part of what the read returns."""
    if conn.get_transaction_status() != psycopg2.extensions.TRANSACTION_STATUS_IDLE:
        conn.rollback()
    sql, params = also or ("SELECT", {})
    with conn.cursor() as cur:
        cur.execute(
            f"SET TRANSACTION ISOLATION LEVEL REPEATABLE READ; SELECT t.trim_mark, a.* FROM lr.log_trim t, ({sql}) a",
            params,
        )
        return tuple(cur.fetchone())


def trimmed_error(reader: str, after: int, mark: int) -> TrimmedError:
    return TrimmedError(
        f"{reader}: the log was trimmed to position {mark}, past position {after} where the sink stands; "
        "entries it needs are gone, so nothing was delivered and a snapshot sync follows",
        after,
        mark,
    )


def check_trim(
    conn: psycopg2.extensions.connection, after: int, reader: str, also: tuple[str, dict] | None = None
) -> tuple:
    """``snapshot_trim_mark``, refusing (``TrimmedError``, transaction ended) when the log no
    longer holds every entry after ``after``; returns the columns of ``also``."""
    mark, *extra = snapshot_trim_mark(conn, also)
    if mark > after:
        conn.rollback()
        raise trimmed_error(reader, after, mark)
    return tuple(extra)
