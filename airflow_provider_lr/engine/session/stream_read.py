"""What a source's stream reads: the wait for a commit, and the routed read.

Every read goes through one autocommit connection to the source (``peek``), each one round trip.

* **The wait** (``wait_for_commit``): with nothing to read, the stream takes the source's wake-up
  key and reads the last drawn commit position after it (``lr.stream_may_sleep_beside``, V0024);
  nothing new, it sleeps on the connection until a writer's commit NOTIFYs ``lr_commit`` (a writer
  does when it cannot take the key shared: only while a stream sleeps, so writers pay nothing while
  streams are busy). It cannot miss a commit: one that drew its position before the key was taken
  either still holds the key shared (the stream could not take it: it pauses and looks again) or
  shows in the position read after it; one drawn later notifies. The key is given back with the
  next statement. Another replicator's stream of the same source finding the key held by a stream
  asleep sleeps beside it (it holds the watch key shared: the holder notifies when it gives the
  wake-up key back, writers notify meanwhile), so every replicator of a source sleeps.
* **The routed read** (``source/routed_read``, prepared once on the connection: planning it costs
  more than running it).
"""

from __future__ import annotations

import select
import time
from collections.abc import Callable, Sequence

import psycopg2
import psycopg2.extensions

from airflow_provider_lr.engine.db import schema
from airflow_provider_lr.engine.session.stream_member import Member
from airflow_provider_lr.engine.source import routed_read
from airflow_provider_lr.engine.source.routed_read import ROUTED, RoutedBatch
from airflow_provider_lr.engine.vocabulary import COMMIT_CHANNEL, STREAM_WATCH_KEY


class StreamRead:
    """The reads of one source's stream (on the stream's thread only)."""

    def __init__(self, connect: Callable[[str], psycopg2.extensions.connection], source: str, max_bytes: int) -> None:
        self.source, self.max_bytes = source, max_bytes
        self._asleep = ""  # the key held while asleep (given back with the next statement): "" none
        self.drawn = 0  # the last drawn commit position, as the last wait read it
        self.peek = connect(source)
        try:
            self.peek.autocommit = True
            schema.require_current(self.peek, "streaming from it")
            ROUTED.prepare(self.peek)
            with self.peek.cursor() as cur:
                cur.execute(f"LISTEN {COMMIT_CHANNEL}")
            self._pid = self.peek.info.backend_pid  # its own NOTIFYs come back to it: not a commit
        except BaseException:
            self.peek.close()
            raise

    def wait_for_commit(self, low: int, pause: float, longest: float) -> bool:
        """True when a commit position after ``low`` was drawn, or a commit woke the stream within
        ``longest`` seconds (read now); False after ``longest`` without one, or after ``pause``
        when the stream could not sleep (a writer is committing: its position shows in a moment)."""
        self.peek.notifies.clear()  # what they told is in the position read next
        with self.peek.cursor() as cur:
            cur.execute(self._awake() + "SELECT asleep, beside, latest FROM lr.stream_may_sleep_beside()")
            asleep, beside, latest = cur.fetchone()
        self.drawn = latest
        self._asleep = ("beside" if beside else "key") if asleep else ""
        if latest > low or self._woken():
            return True
        if not asleep:
            time.sleep(pause)
            return False
        until = time.monotonic() + longest
        while select.select([self.peek], [], [], max(0.0, until - time.monotonic()))[0]:
            self.peek.poll()
            if self._woken():
                return True
            # only its own wake-up of those asleep beside it came: sleep on
        return False

    def _woken(self) -> bool:
        """Whether another session's commit (or stream) notified since the last look."""
        woken = any(n.pid != self._pid for n in self.peek.notifies)
        self.peek.notifies.clear()
        return woken

    def read(self, members: Sequence[Member]) -> RoutedBatch | None:
        """The routed read after where each of ``members`` was read to (``read_routed``: None for a
        transaction too large, ``TrimmedError``)."""
        readers = [m.routed() for m in members]
        return routed_read.read_routed(
            self.peek, readers, self.max_bytes, self.source, prepared=True, before=self._awake()
        )

    def _awake(self) -> str:
        """The statement that gives the key held while asleep back, when one is held (for the next
        statement to send first, in the same round trip): the wake-up key with a NOTIFY to those
        asleep beside it (``lr.stream_awake``), or the watch key."""
        held, self._asleep = self._asleep, ""
        if held == "key":
            return "SELECT lr.stream_awake(); "
        if held == "beside":
            return f"SELECT pg_catalog.pg_advisory_unlock_shared({STREAM_WATCH_KEY}); "
        return ""

    def close(self) -> None:
        """Close the connection, first waking those asleep beside this stream (a lost connection
        frees the key without: they wake at their own next look, within ``sleep_max``)."""
        if self.peek.closed:
            return
        awake = self._awake()
        if awake:
            try:
                with self.peek.cursor() as cur:
                    cur.execute(awake)
            except psycopg2.Error:
                pass  # the connection is lost: its locks went with it
        self.peek.close()
