"""The owner of ``lr.sink_sessions``: every statement that names it is here.

A sink keeps one row per session it receives (source, client): where the session's full sync
stands, the last position it processed, the lease epoch of the newest writer it has seen, and,
once the session was failed over, the site its client now comes from.

``FencedTransaction`` is the sink transaction every writer of a session opens: the row locked,
a writer whose lease was taken over (or a session failed over) refused before it writes anything.
The sink's rules about what a write may do (``sink/writes``: never move backwards, a full sync
applied once) sit above it; table snapshots (``tables/snapshot``) use it as it is.
"""

from __future__ import annotations

import contextlib
from datetime import datetime
from typing import Any

import psycopg2
import psycopg2.extensions

from airflow_provider_lr.engine.db.durable_commits import THIS_TRANSACTION
from airflow_provider_lr.engine.db.prepared import Prepared
from airflow_provider_lr.engine.errors import FencedError
from airflow_provider_lr.engine.vocabulary import SessionKey

# the row as a writer reads it (``writes.SinkMetadata``'s fields, in this order)
COLUMNS = (
    "source_site_id",
    "client_name",
    "topology_config_id",
    "snapshot_request_id",
    "snapshot_started",
    "snapshot_transferred",
    "snapshot_applied",
    "snapshot_transferred_seq",
    "snapshot_last_entry",
    "base_snapshot",
    "base_upto",
    "last_log_entry_processed",
    "data_consistent",
    "lease_epoch",
    "failed_over_to",
)
_SELECT = f"SELECT {', '.join(COLUMNS)} FROM lr.sink_sessions WHERE source_site_id = %s AND client_name = %s"
_CREATE = "INSERT INTO lr.sink_sessions (source_site_id, client_name) VALUES (%s, %s) ON CONFLICT DO NOTHING"
# A fenced transaction names its epoch as its backend's application_name (for the transaction
# only): a writer stopped inside it (SIGSTOP, hung) holds the row, and the next epoch's holder,
# finding it so, ends it (``stale_writers``); any other transaction holding the row is waited for.
WRITER = "lr fenced writer, epoch "

# An asynchronous commit (PostgreSQL's apply worker commits so) returns before its WAL is flushed:
# whoever acknowledges what it wrote waits for the sink's flush position to pass it. The row lock
# writes WAL, so a synchronous commit of a fenced transaction flushes everything committed before it.
# The default (None) is durable: whoever commits it acknowledges what it wrote on the source right
# after, so a sink server whose synchronous_commit is 'off' has it raised to 'local' for the
# transaction ('on', 'local', 'remote_write' and 'remote_apply' all flush locally and are kept).
_COMMIT_MODE = {
    None: THIS_TRANSACTION,
    True: "SET LOCAL synchronous_commit = on; ",
    False: "SET LOCAL synchronous_commit = off; ",
}

Row = dict[str, Any]  # COLUMNS -> value


def read(cur: psycopg2.extensions.cursor, source: str, client: str) -> Row | None:
    """The session's row as ``cur``'s transaction sees it (None: no such session); no row made."""
    cur.execute(_SELECT, (source, client))
    row = cur.fetchone()
    return None if row is None else dict(zip(COLUMNS, row))


def read_or_create(cur: psycopg2.extensions.cursor, source: str, client: str) -> Row:
    """The session's row, made on first contact."""
    cur.execute(_CREATE, (source, client))
    cur.execute(_SELECT, (source, client))
    return dict(zip(COLUMNS, cur.fetchone()))


def _sink_id(cur: psycopg2.extensions.cursor) -> str:
    """This site's id, for messages."""
    cur.execute("SELECT site_id FROM lr.site_info")
    return (cur.fetchone() or ("this sink",))[0]


class FencedTransaction:
    """One fenced sink transaction: ``open`` locks the session row and checks the writer's lease
    epoch (a replicator whose lease was taken over is refused before it writes anything), the
    writes follow, then ``commit`` or ``abort``. As a context manager
    (``with FencedTransaction(...) as (cur, row)``) it commits on a clean exit and aborts on an
    exception; the fan-out calls the methods itself, its transactions span a whole chunk's read."""

    cur: psycopg2.extensions.cursor  # the transaction's cursor, from ``open`` on

    def __init__(
        self,
        conn: psycopg2.extensions.connection,
        source: str,
        client: str,
        epoch: int,
        synchronous: bool | None = None,
    ) -> None:
        self.conn, self.source, self.client, self.epoch = conn, source, client, epoch
        # the commit: on the sink's disk before it returns, as the server's synchronous_commit says
        # unless that is 'off' (None), waiting for the WAL flush (True), or not (False: the stream's
        # applies, acknowledged by flush position)
        self.synchronous = synchronous

    def open(self) -> Any:
        """Lock the session's row (a concurrent writer of the session waits here), refuse a stale
        epoch or a failed-over session, raise the sink's epoch to ours; the row as it stands under
        the lock."""
        self.cur = self.conn.cursor()
        # on an autocommit connection BEGIN and COMMIT ride with the first and last statements
        # (two round trips fewer: a stream's hot path); otherwise psycopg2 sends them itself
        self.explicit, self.ended = self.conn.autocommit, False
        try:
            self.cur.execute(
                ("BEGIN; " if self.explicit else "")
                + _COMMIT_MODE[self.synchronous]
                + "SELECT pg_catalog.set_config('application_name', %s, true); "
                + _CREATE
                + "; "
                + _SELECT
                + " FOR UPDATE",  # one round trip: made if missing, locked, read
                (f"{WRITER}{self.epoch}", self.source, self.client, self.source, self.client),
            )
            row = dict(zip(COLUMNS, self.cur.fetchone()))
            if row["failed_over_to"] is not None:
                here = _sink_id(self.cur)
                raise FencedError(
                    f"session {SessionKey(self.source, here, self.client)} was failed over: {self.client!r} now "
                    f"comes from {row['failed_over_to']!r} (`lr failover`); {self.source!r} writes no more here, "
                    f"whatever its epoch (rejoin the site that came back: `lr failover --rejoin {self.source}`, or "
                    f"`lr failover --rejoin {here}` when {self.source!r} is the source again after a later failover)"
                )
            if row["lease_epoch"] > self.epoch:
                here = _sink_id(self.cur)
                raise FencedError(
                    f"session {SessionKey(self.source, here, self.client)}: lease epoch {self.epoch} is stale "
                    f"(the sink has seen epoch {row['lease_epoch']}); another replicator owns this session",
                    sink_epoch=row["lease_epoch"],
                )
            if row["lease_epoch"] < self.epoch:
                self.cur.execute(
                    "UPDATE lr.sink_sessions SET lease_epoch = %s WHERE source_site_id = %s AND client_name = %s",
                    (self.epoch, self.source, self.client),
                )
            return row
        except BaseException:
            self.abort()
            raise

    def commit(self) -> None:
        """Make data and metadata visible together."""
        try:
            if not self.explicit:
                self.conn.commit()
            elif not self.ended:
                self.cur.execute("COMMIT")
        finally:
            self.cur.close()

    def abort(self) -> None:
        """Roll back: nothing of the transaction becomes visible."""
        try:
            if self.conn.closed:  # a lost server: keep its error, not the rollback's
                pass
            elif self.explicit:
                with (
                    contextlib.suppress(psycopg2.Error),
                    self.conn.cursor() as cur,
                ):  # keep the error that brought us here
                    cur.execute("ROLLBACK")
            else:
                self.conn.rollback()
        finally:
            self.cur.close()

    def __enter__(self) -> tuple[psycopg2.extensions.cursor, Any]:
        opened = self.open()
        return self.cur, opened

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc_type is None:
            try:
                self.commit()
            except BaseException:  # a failed last statement leaves the connection in no transaction
                self.abort()
                raise
        else:
            self.abort()

    def update(self, **values: object) -> None:
        """Set columns of the session's row (names from the code, never from input)."""
        sets = ", ".join(f"{k} = %s" for k in values)
        self.cur.execute(
            f"UPDATE lr.sink_sessions SET {sets}, updated_at = now() WHERE source_site_id = %s AND client_name = %s",
            (*values.values(), self.source, self.client),
        )

    def advance_to(
        self, end: int, notify: tuple[str, str] | None = None, last: bool = False, before: bytes = b""
    ) -> None:
        """Record the last processed position; with ``notify`` (channel, payload), wake at commit in
        the same round trip. ``last``: the transaction's last statement (its COMMIT may ride along);
        ``before``: statements of the transaction sent in the same round trip, ahead of it."""
        wake = "; SELECT pg_notify(%s, %s)" if notify else ""
        self.ended = last and self.explicit
        statement = self.cur.mogrify(
            "UPDATE lr.sink_sessions SET last_log_entry_processed = %s, updated_at = now() "
            "WHERE source_site_id = %s AND client_name = %s" + wake + ("; COMMIT" if self.ended else ""),
            (end, self.source, self.client) + (notify or ()),
        )
        self.cur.execute(before + b"; " + statement if before else statement)

    def row(self) -> Row:
        """The session's row as this transaction has just written it."""
        self.cur.execute(_SELECT, (self.source, self.client))
        return dict(zip(COLUMNS, self.cur.fetchone()))


# --- a stream's transaction in one round trip -----------------------------------------------------
NOT_WHERE_LEFT = "LR409"  # SQLSTATE of ``lr.stream_advance``: the row is not as the stream left it


STREAM_ADVANCE = Prepared(  # prepared on a stream's sink connection (``db.prepared.ensure``)
    "lr_stream_advance_v1",
    "SELECT lr.stream_advance(%(source)s, %(client)s, %(epoch)s, %(base)s, %(after)s, %(end)s)",
    {
        "source": "pg_catalog.text",
        "client": "pg_catalog.text",
        "epoch": "pg_catalog.int8",
        "base": "pg_catalog.int8",
        "after": "pg_catalog.int8",
        "end": "pg_catalog.int8",
    },
)
STREAM_BEGIN = "BEGIN; " + _COMMIT_MODE[False] + STREAM_ADVANCE.execute_sql
"""The opening statements of a stream's asynchronously committed transaction (parameters as
``STREAM_ADVANCE``'s), for the caller to send with its rows and COMMIT in one round trip: the
session's row locked and moved from ``after`` to ``end`` when it is where the stream left it
(``epoch``, ``base``, not failed over: V0021); else the statement raises ``NOT_WHERE_LEFT`` and
nothing of the transaction stays."""


# --- checks of a writer outside the session's fenced transaction --------------------------------
def last_processed(cur: psycopg2.extensions.cursor, source: str, client: str) -> int:
    """The session's last processed position (the row exists)."""
    cur.execute(
        "SELECT last_log_entry_processed FROM lr.sink_sessions WHERE source_site_id = %s AND client_name = %s",
        (source, client),
    )
    return cur.fetchone()[0]


def share_position(cur: psycopg2.extensions.cursor, source: str, client: str) -> tuple[int, int, str | None]:
    """(last processed position, lease epoch, failed over to), the row share-locked until commit:
    a fenced transaction of the session waits for this one."""
    cur.execute(
        "SELECT last_log_entry_processed, lease_epoch, failed_over_to FROM lr.sink_sessions "
        "WHERE source_site_id = %s AND client_name = %s FOR SHARE",
        (source, client),
    )
    last, epoch, failed_over_to = cur.fetchone()
    return last, epoch, failed_over_to


def share_epoch(cur: psycopg2.extensions.cursor, source: str, client: str) -> int | None:
    """The session's lease epoch, the row share-locked until commit (None: no such session)."""
    cur.execute(
        "SELECT lease_epoch FROM lr.sink_sessions WHERE source_site_id = %s AND client_name = %s FOR SHARE",
        (source, client),
    )
    row = cur.fetchone()
    return None if row is None else row[0]


def still_transferring(cur: psycopg2.extensions.cursor, source: str, client: str, sync_id: str) -> bool:
    """Whether the sink still transfers full sync ``sync_id`` of the session (not applied, not
    failed over), the row share-locked until commit."""
    cur.execute(
        "SELECT snapshot_request_id = %s AND snapshot_transferred <> snapshot_started "
        "AND failed_over_to IS NULL FROM lr.sink_sessions "
        "WHERE source_site_id = %s AND client_name = %s FOR SHARE",
        (sync_id, source, client),
    )
    row = cur.fetchone()
    return bool(row and row[0])


def stale_writers(
    cur: psycopg2.extensions.cursor, source: str, client: str, epoch: int
) -> list[tuple[int, float, str]]:
    """(pid, seconds its transaction has been open, state) of the backend whose fenced transaction
    of an epoch below ``epoch`` holds the session's row locked (its lock is the row's ``xmax``; its
    ``application_name`` says the epoch: ``WRITER``); read without waiting for the lock."""
    cur.execute(
        "SELECT a.pid, pg_catalog.date_part('epoch', pg_catalog.clock_timestamp() - a.xact_start), a.state "
        "FROM lr.sink_sessions s JOIN pg_catalog.pg_stat_activity a ON a.backend_xid = s.xmax "
        "WHERE s.source_site_id = %s AND s.client_name = %s AND a.pid <> pg_catalog.pg_backend_pid() "
        "AND a.application_name ~ %s AND pg_catalog.substr(a.application_name, %s)::bigint < %s",
        # (at most 18 digits: any login may name its backend so, and one epoch past bigint's range failed
        # the cast for every look, whatever backend held the row)
        (source, client, "^" + WRITER + "[0-9]{1,18}$", len(WRITER) + 1, epoch),
    )
    return [(pid, float(age), state) for pid, age, state in cur.fetchall()]


# --- failover -------------------------------------------------------------------------------------
def fence_failed_over(
    cur: psycopg2.extensions.cursor, source: str, to_site: str, failover_id: str, clients: list[str]
) -> None:
    """Close the sessions of ``clients`` from ``source`` to every writer (failed over to ``to_site``;
    epoch raised); a session already reconciled (it has a note) is left as it is."""
    cur.execute(
        "UPDATE lr.sink_sessions SET failed_over_to = %s, failover_id = %s, lease_epoch = lease_epoch + 1, "
        "updated_at = now() WHERE source_site_id = %s AND client_name = ANY (%s) AND failover_note IS NULL",
        (to_site, failover_id, source, clients),
    )


def lock_cut(cur: psycopg2.extensions.cursor, source: str, client: str) -> tuple[int, bool] | None:
    """(last processed position, data consistent) of the session, its row locked (None: no session)."""
    cur.execute(
        "SELECT last_log_entry_processed, data_consistent FROM lr.sink_sessions "
        "WHERE source_site_id = %s AND client_name = %s FOR UPDATE",
        (source, client),
    )
    row = cur.fetchone()
    return None if row is None else (row[0], row[1])


def close_promoted(
    cur: psycopg2.extensions.cursor, source: str, to_site: str, failover_id: str, note: str, clients: list[str]
) -> None:
    """The promoted site's sessions of ``clients`` from the old source: failed over, with ``note``."""
    cur.execute(
        "UPDATE lr.sink_sessions SET failed_over_to = %s, failover_id = %s, failover_note = %s, "
        "lease_epoch = lease_epoch + 1, updated_at = now() WHERE source_site_id = %s AND client_name = ANY (%s)",
        (to_site, failover_id, note, source, clients),
    )


def lock_reconcile(
    cur: psycopg2.extensions.cursor, source: str, client: str
) -> tuple[int, bool, int, str | None, Any] | None:
    """(last processed, data consistent, snapshot applied, failover note, failover id) of the
    session, its row locked (None: no session)."""
    cur.execute(
        "SELECT last_log_entry_processed, data_consistent, snapshot_applied, failover_note, failover_id "
        "FROM lr.sink_sessions WHERE source_site_id = %s AND client_name = %s FOR UPDATE",
        (source, client),
    )
    row = cur.fetchone()
    return None if row is None else tuple(row)


def close_reconciled(
    cur: psycopg2.extensions.cursor, source: str, client: str, to_site: str, failover_id: str, note: str, position: int
) -> None:
    """A reconciled session from the old source: failed over at ``position``, with what was done."""
    cur.execute(
        "UPDATE lr.sink_sessions SET failed_over_to = %s, failover_id = %s, failover_note = %s, "
        "last_log_entry_processed = %s, lease_epoch = lease_epoch + 1, updated_at = now() "
        "WHERE source_site_id = %s AND client_name = %s",
        (to_site, failover_id, note, position, source, client),
    )


def reopen_closed(cur: psycopg2.extensions.cursor, source: str, clients: list[str]) -> list[str]:
    """The clients whose session from ``source`` an EARLIER failover closed here (``source`` was its
    old source then, and is the source again: a fail-back), reopened for a full sync (not consistent,
    epoch raised): what this site holds of ``source``'s stream stopped at that failover's cut."""
    cur.execute(
        "UPDATE lr.sink_sessions SET failed_over_to = NULL, failover_id = NULL, failover_note = NULL, "
        "data_consistent = false, lease_epoch = lease_epoch + 1, updated_at = now() "
        "WHERE source_site_id = %s AND client_name = ANY (%s) AND failed_over_to IS NOT NULL RETURNING client_name",
        (source, clients),
    )
    return sorted(row[0] for row in cur.fetchall())


def start_in_log_entry_sync(
    cur: psycopg2.extensions.cursor, source: str, client: str, topology_config_id: str, base: int
) -> None:
    """The session from ``source`` consistent at ``base`` and in log-entry sync from there (made
    or reset: no full sync, no failover left on it)."""
    cur.execute(
        "INSERT INTO lr.sink_sessions (source_site_id, client_name, topology_config_id, snapshot_started, "
        "snapshot_transferred, snapshot_applied, last_log_entry_processed, data_consistent) "
        "VALUES (%s, %s, %s, %s, %s, %s, %s, true) ON CONFLICT (source_site_id, client_name) DO UPDATE SET "
        "topology_config_id = EXCLUDED.topology_config_id, snapshot_started = EXCLUDED.snapshot_started, "
        "snapshot_transferred = EXCLUDED.snapshot_transferred, snapshot_applied = EXCLUDED.snapshot_applied, "
        "last_log_entry_processed = EXCLUDED.last_log_entry_processed, data_consistent = true, "
        "snapshot_request_id = NULL, base_snapshot = NULL, base_upto = NULL, failed_over_to = NULL, "
        "failover_id = NULL, failover_note = NULL, updated_at = now()",
        (source, client, topology_config_id, base, base, base, base),
    )


# --- the operator's side --------------------------------------------------------------------------
def failed_over(cur: psycopg2.extensions.cursor) -> dict[tuple[str, str], tuple[str, str | None]]:
    """(source, client) -> (failed over to, note) of every session failed over."""
    cur.execute(
        "SELECT source_site_id, client_name, failed_over_to, failover_note FROM lr.sink_sessions "
        "WHERE failed_over_to IS NOT NULL"
    )
    return {(source, client): (to, note) for source, client, to, note in cur.fetchall()}


def failovers_seen(cur: psycopg2.extensions.cursor) -> list[tuple[str, str, str, datetime]]:
    """(old source, client, failed over to, when this site last changed that session) of every
    session failed over here: a client failed over twice (a->b, and after a's rejoin a->c) and one
    chained (a->b, then b->c) are told apart by when (``site.topology.newest_moves``)."""
    cur.execute(
        "SELECT source_site_id, client_name, failed_over_to, updated_at FROM lr.sink_sessions "
        "WHERE failed_over_to IS NOT NULL"
    )
    return [(source, client, to, when) for source, client, to, when in cur.fetchall()]


def processed(cur: psycopg2.extensions.cursor) -> dict[tuple[str, str], int]:
    """The last position this site applied of each (source, client) log: read in a snapshot's
    transaction at its source, what the snapshot holds of each (its rows and the position commit
    together; ``tables.own_rows``)."""
    cur.execute("SELECT source_site_id, client_name, last_log_entry_processed FROM lr.sink_sessions")
    return {(source, client): position for source, client, position in cur.fetchall()}


def keys(cur: psycopg2.extensions.cursor) -> list[tuple[str, str]]:
    """(source, client) of every session of this sink, sorted."""
    cur.execute("SELECT source_site_id, client_name FROM lr.sink_sessions ORDER BY 1, 2")
    return [(source, client) for source, client in cur.fetchall()]


def delete(cur: psycopg2.extensions.cursor, source: str, client: str) -> None:
    """Forget the session (its row)."""
    cur.execute("DELETE FROM lr.sink_sessions WHERE source_site_id = %s AND client_name = %s", (source, client))


def tables_of_closed_sessions(cur: psycopg2.extensions.cursor, states: tuple[str, ...]) -> list[tuple]:
    """The sink tables in ``states`` held from a session that is gone or failed over: (table, client,
    source, session gone, failed over to), by table then source."""
    cur.execute(
        "SELECT t.table_name, t.client_name, t.source_site_id, s.source_site_id IS NULL, s.failed_over_to "
        "FROM lr.sink_tables t LEFT JOIN lr.sink_sessions s ON s.source_site_id = t.source_site_id "
        "AND s.client_name = t.client_name WHERE (s.source_site_id IS NULL OR s.failed_over_to IS NOT NULL) "
        "AND t.state IN %s ORDER BY 1, 3",
        (states,),
    )
    return cur.fetchall()
