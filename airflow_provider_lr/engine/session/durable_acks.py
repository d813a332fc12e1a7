"""Acknowledge on the source only what a sink holds durably.

A stream commits its sink transactions asynchronously (``synchronous_commit = off`` for those
transactions alone: the commit returns before its WAL reaches disk, as PostgreSQL's own apply
worker commits). A sink server that crashes before its WAL flush loses such a commit; had its
position been acknowledged on the source already, safe trim could remove entries the sink no longer
has. So a position is acknowledged once the sink's WAL *flush* position has passed the commit that
wrote it, what the apply worker reports to its publisher as ``flush_lsn``:

* after the writes of a round, a sink site's WAL *insert* position, read then, is at or after every
  commit already made there: a mark (that position, and where each of the site's sessions stands);
* a mark is durable once the site's flush position reached it, and its positions may be
  acknowledged. The WAL writer flushes asynchronous commits within ``wal_writer_delay`` (200 ms by
  default); any synchronous commit on the server flushes everything before it too.

``writes.flush`` makes everything committed so far durable at once: a stream that stops acknowledges
all it wrote. After a crash the sink's own recorded position is the truth (the cycle that takes the
session back reads it in a fenced, synchronously committed transaction) and the stream resends
from there (docs/crash-windows.md, row 22).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import psycopg2.extensions

from airflow_provider_lr.engine.vocabulary import SessionKey

# pg_lsn minus the zero position: a number, compared in Python
WAL_POSITIONS_SQL = (
    "SELECT pg_catalog.pg_current_wal_flush_lsn() - '0/0'::pg_lsn, "
    "pg_catalog.pg_current_wal_insert_lsn() - '0/0'::pg_lsn"
)
MAX_MARKS = 64  # per site; beyond, the newest two merge (acknowledged a little later, never earlier)


@dataclass(frozen=True)
class _Mark:
    lsn: int  # the sink's WAL insert position once these positions were committed
    positions: dict[SessionKey, int]


class DurableAcks:
    """The marks of each sink site not yet known flushed."""

    def __init__(self) -> None:
        self._marks: dict[str, list[_Mark]] = {}

    def observe(
        self, conn: psycopg2.extensions.connection, site: str, positions: Mapping[SessionKey, int]
    ) -> dict[SessionKey, int]:
        """Mark ``positions`` (where ``site``'s sessions stand now, committed, maybe not flushed) and
        return the newest position of each session now known durable on ``site``."""
        with conn.cursor() as cur:
            cur.execute(WAL_POSITIONS_SQL)
            flushed, inserted = (int(v) for v in cur.fetchone())
        conn.rollback()
        marks = self._marks.setdefault(site, [])
        if positions and (not marks or marks[-1].positions != positions):
            marks.append(_Mark(inserted, dict(positions)))
            if len(marks) > MAX_MARKS:  # a sink that does not flush: bounded all the same
                marks[-2:] = [_Mark(marks[-1].lsn, {**marks[-2].positions, **marks[-1].positions})]
        durable: dict[SessionKey, int] = {}
        while marks and marks[0].lsn <= flushed:
            durable.update(marks.pop(0).positions)  # positions only grow: a later mark's win
        return durable

    def forget(self, site: str) -> None:
        """Drop ``site``'s marks: its connection was lost or one of its sessions left. A mark read
        before a crash names WAL the restarted server may never have had; its sessions' positions
        are marked again by the next round."""
        self._marks.pop(site, None)
