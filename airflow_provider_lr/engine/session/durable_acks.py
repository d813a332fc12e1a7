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

import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

import psycopg2
import psycopg2.extensions

from airflow_provider_lr.engine.db.autocommit import autocommit
from airflow_provider_lr.engine.errors import FencedError, LRError, one_line
from airflow_provider_lr.engine.session.sink_writers import SinkBusy
from airflow_provider_lr.engine.session.stream_member import Member
from airflow_provider_lr.engine.sink import writes
from airflow_provider_lr.engine.vocabulary import SessionKey

log = logging.getLogger(__name__)
Conn = Callable[[str], psycopg2.extensions.connection]  # a sink site's connection, by site
Positions = tuple[int, int]  # a sink's WAL flush and insert positions
Ask = Callable[[str, Callable[[psycopg2.extensions.connection], Positions]], Positions]  # ``SinkWriters.ask``

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

    def observe(self, site: str, positions: Mapping[SessionKey, int], wal: Positions) -> dict[SessionKey, int]:
        """Mark ``positions`` (where ``site``'s sessions stand now, committed, maybe not flushed) at
        the ``wal`` positions read after them and return the newest position of each session now
        known durable on ``site``."""
        flushed, inserted = wal
        marks = self._marks.setdefault(site, [])
        if positions and (not marks or marks[-1].positions != positions):
            marks.append(_Mark(inserted, dict(positions)))
            if len(marks) > MAX_MARKS:  # a sink that does not flush: bounded all the same
                marks[-2:] = [_Mark(marks[-1].lsn, {**marks[-2].positions, **marks[-1].positions})]
        durable: dict[SessionKey, int] = {}
        while marks and marks[0].lsn <= flushed:
            durable.update(marks.pop(0).positions)  # positions only grow: a later mark's win
        return durable

    def observe_members(self, members: Collection[Member], ask: Ask) -> dict[SessionKey, Exception]:
        """``observe`` for each sink site of ``members`` whose position is not known durable, raising
        their ``durable``; the sessions of a site that could not be asked, with why (the sink is
        lost: they go back to the cycles). A site busy writing is asked at the next ack."""
        standing: dict[str, dict[SessionKey, int]] = {}
        for member in members:
            if member.after > member.durable:
                standing.setdefault(member.key.sink, {})[member.key] = member.after
        by_key = {m.key: m for m in members}
        failed: dict[SessionKey, Exception] = {}
        for site, positions in standing.items():
            try:
                durable = self.observe(site, positions, ask(site, wal_positions))
            except SinkBusy:
                continue
            except Exception as exc:
                failed.update(dict.fromkeys(positions, exc))
                continue
            for key, position in durable.items():
                by_key[key].durable = max(by_key[key].durable, position)
        return failed

    def flush(self, members: Collection[Member], conn: Conn, source: str) -> None:
        """Make what ``members`` were written durable on their sinks now (their stream stops or they
        leave): their last acks then say all of it. A sink that cannot be flushed keeps what its
        flush was last seen to pass (the next holder reads the sink)."""
        for site, one in {m.key.sink: m for m in members if m.after > m.durable}.items():
            try:  # one session's fenced transaction flushes all the site's
                writes.flush(conn(site), source, one.key.client, one.position.epoch)
                for member in (m for m in members if m.key.sink == site):
                    member.durable = member.after
            except FencedError as exc:  # its session moved to another member, which reads the sink's position
                log.debug("stream of %s: sink %s left to the session's new holder: %s", source, site, one_line(exc))
            except (psycopg2.Error, LRError) as exc:
                log.info("stream of %s: sink %s not flushed: %s", source, site, one_line(exc))

    def forget(self, site: str) -> None:
        """Drop ``site``'s marks: its connection was lost or one of its sessions left. A mark read
        before a crash names WAL the restarted server may never have had; its sessions' positions
        are marked again by the next round."""
        self._marks.pop(site, None)


def wal_positions(conn: psycopg2.extensions.connection) -> Positions:
    """The sink's WAL flush and insert positions, in one round trip."""
    with autocommit(conn), conn.cursor() as cur:
        cur.execute(WAL_POSITIONS_SQL)
        flushed, inserted = cur.fetchone()
    return int(flushed), int(inserted)
