"""What a source's stream reads: the probe of the newest commit, the routed read, and the read ahead.

Every read goes through one autocommit connection to the source (``peek``), each one round trip:
the probe (``LAST_DRAWN_POSITION_SQL``) says whether anything was committed after the lowest
session, the routed read (``source/routed_read``, prepared once on the connection: planning it costs
more than running it) brings it. Below the busy rate the stream hands the next round's read over
to this while its sink transactions are in flight (``ahead``): a read is free of side effects, so
one taken on an assumption that turns out false (a write failed, a session joined or left) is
simply not used, and the next round reads again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import psycopg2
import psycopg2.extensions

from airflow_provider_lr.engine.errors import LRError, one_line
from airflow_provider_lr.engine.session.stream_member import Member
from airflow_provider_lr.engine.source import routed_read
from airflow_provider_lr.engine.source.commit_barrier import LAST_DRAWN_POSITION_SQL
from airflow_provider_lr.engine.source.routed_read import ROUTED, Reader, RoutedBatch
from airflow_provider_lr.engine.vocabulary import SessionKey

log = logging.getLogger(__name__)


class StreamRead:
    """The reads of one source's stream (on the stream's thread only)."""

    def __init__(self, connect: Callable[[str], psycopg2.extensions.connection], source: str, max_bytes: int) -> None:
        self.source, self.max_bytes = source, max_bytes
        self._ahead: tuple[list[SessionKey], list[Reader], RoutedBatch] | None = None
        self.peek = connect(source)
        try:
            self.peek.autocommit = True
            ROUTED.prepare(self.peek)
        except BaseException:
            self.peek.close()
            raise

    def latest(self) -> int:
        """The newest commit position drawn on the source (committed or not yet)."""
        with self.peek.cursor() as cur:
            cur.execute(LAST_DRAWN_POSITION_SQL)
            return cur.fetchone()[0]

    def read(self, members: Sequence[Member]) -> RoutedBatch | None:
        """The routed read after where each of ``members`` was read to: the one taken ahead when it
        was taken for exactly these sessions from exactly there and found something, else a new one
        (``read_routed``: None for a transaction too large, ``TrimmedError``)."""
        ahead, self._ahead = self._ahead, None
        readers = [m.routed() for m in members]
        if ahead is not None and ahead[0] == [m.key for m in members] and ahead[1] == readers:
            if ahead[2].end > min(r.after for r in readers):
                return ahead[2]
        return self._read(readers)

    def ahead(self, members: Sequence[Member], end: int) -> None:
        """Take the next read for ``members`` as if each had been written up to ``end``, for the next
        ``read`` to use if they then stand there; a read that fails is left to the next ``read``."""
        readers = [m.routed(end) for m in members]
        try:
            batch = self._read(readers)
        except (psycopg2.Error, LRError) as exc:  # trimmed past a session, the source lost: said by the next read
            log.debug("stream of %s: read ahead not taken: %s", self.source, one_line(exc))
            return
        if batch is not None:
            self._ahead = ([m.key for m in members], readers, batch)

    def _read(self, readers: list[Reader]) -> RoutedBatch | None:
        return routed_read.read_routed(self.peek, readers, self.max_bytes, self.source, prepared=True)

    def close(self) -> None:
        if not self.peek.closed:
            self.peek.close()
