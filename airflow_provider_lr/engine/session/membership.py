"""This replicator process as a member at the sources of its sessions: the others see it, and it
works its share (``assignment.assign``) of the sessions.

At every source of its sessions the process registers (``store/members``) on a connection of its
own, holding a session-level advisory lock for as long as it lives, and moves its heartbeat every
``member_heartbeat`` seconds. Each heartbeat also reads the source's live members; from every
source's view the process computes its share, the same answer every member computes from the same
view. A member killed outright is dead the moment its backend sees the connection close (its
lock goes); a member that hangs is dead once its heartbeat is ``member_dead_after`` old. A lease
held by a dead member is taken at once (``store/source_sessions.take_lease``, the epoch bumped as
always, so a member thought dead that was only cut off is fenced at the sink).

Each heartbeat also says the sites this process cannot reach now (``unreached``: its connections
failed to reach them and have not since, V0050), so that the members give a session whose sink its
member cannot reach to one that can (``assignment.assign``'s cut).

The heartbeats run on a thread per source (``start``): a cycle that takes minutes (a full sync) or
a source that does not answer must not make the process look dead at the other sources.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence

import psycopg2
import psycopg2.extensions

from airflow_provider_lr.engine.db import schema
from airflow_provider_lr.engine.errors import LRError, one_line
from airflow_provider_lr.engine.session.assignment import assign
from airflow_provider_lr.engine.session.settings import SessionSettings
from airflow_provider_lr.engine.store import members
from airflow_provider_lr.engine.vocabulary import SessionKey

log = logging.getLogger(__name__)
UNREACHED_SCHEMA = 50  # the members say the sites they cannot reach (lr.replicator_members.unreached)

Connect = Callable[[str], psycopg2.extensions.connection]


class Membership:
    """``owner`` as a member at every source of ``sessions``: ``beat`` (or ``start`` for heartbeats
    on threads), ``assigned`` (this member's share now), ``leave`` (a clean exit)."""

    def __init__(
        self,
        connect: Connect,
        sessions: Sequence[SessionKey],
        owner: str,
        settings: SessionSettings,
        unreached: Callable[[], Collection[str]] | None = None,
    ) -> None:
        self.connect, self.owner, self.settings = connect, owner, settings
        self.unreached = unreached  # the sites this process cannot reach now, said with each heartbeat
        self.sessions = sorted(set(sessions))
        self.sources = sorted({key.source for key in self.sessions})
        # the live members of each source as last read; a source never reached counts this member
        # alone, so a process that cannot reach a source works its sessions and reports their errors
        self._view: dict[str, list[str]] = {source: [owner] for source in self.sources}
        self._cut: dict[str, dict[str, tuple[str, ...]]] = {}  # source -> member -> the sites it cannot reach
        self._assigned = self._share()
        self._guard = threading.Lock()  # the view and the share, between the heartbeat threads
        self._conns: dict[str, psycopg2.extensions.connection] = {}
        self._keys: dict[str, int] = {}
        self._last: dict[str, float] = {}  # monotonic time of each source's last heartbeat
        self._failing: set[str] = set()  # sources whose heartbeat failed (said once, and once more when back)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # --- the share ----------------------------------------------------------------------------
    def assigned(self) -> list[SessionKey]:
        """The sessions this member works now, sorted."""
        with self._guard:
            return list(self._assigned)

    def view(self) -> dict[str, list[str]]:
        """source → its live members, as last read."""
        with self._guard:
            return {source: list(found) for source, found in self._view.items()}

    def _share(self) -> list[SessionKey]:
        return assign(self.sessions, self._view, self._cut).get(self.owner, [])

    # --- heartbeats ---------------------------------------------------------------------------
    def beat(self) -> bool:
        """A heartbeat at each source (one whose last was less than ``member_heartbeat`` ago is left
        alone), registering at the first; True when this member's share changed."""
        return self._beat_everywhere(due=False)

    def _beat_everywhere(self, due: bool) -> bool:
        changed = False
        for source in self.sources:
            changed = self._beat_at(source, due) or changed
        return changed

    def start(self) -> None:
        """Join everywhere and read the members a heartbeat later (processes started together see
        each other before they work: no share taken only to be handed over), then a thread per
        source keeps beating until ``leave``."""
        self._beat_everywhere(due=True)
        self._stop.wait(self.settings.member_heartbeat)
        self._beat_everywhere(due=True)
        for source in self.sources:
            thread = threading.Thread(target=self._keep, args=(source,), daemon=True, name=f"lr-member-{source}")
            self._threads.append(thread)
            thread.start()

    def _keep(self, source: str) -> None:
        pause = self.settings.member_heartbeat
        while not self._stop.wait(max(0.0, self._last.get(source, 0.0) + pause - time.monotonic())):
            if source not in self.sources:  # no session of it any more (``follow``): leave it
                self._drop(source)
                return
            self._beat_at(source)

    def follow(self, sessions: Sequence[SessionKey]) -> None:
        """Share ``sessions`` from now on (the topology changed): a new source is joined, with a
        heartbeat thread of its own; one with no session any more is left by its thread."""
        with self._guard:
            self.sessions = sorted(set(sessions))
            self.sources = sorted({key.source for key in self.sessions})
            self._view = {source: self._view.get(source, [self.owner]) for source in self.sources}
            self._cut = {source: cut for source, cut in self._cut.items() if source in self.sources}
            self._assigned = self._share()
        beating = {thread.name for thread in self._threads if thread.is_alive()}
        for source in self.sources:
            if f"lr-member-{source}" not in beating and not self._stop.is_set():
                self._beat_at(source, due=True)
                thread = threading.Thread(target=self._keep, args=(source,), daemon=True, name=f"lr-member-{source}")
                self._threads.append(thread)
                thread.start()

    def _beat_at(self, source: str, due: bool = False) -> bool:
        now = time.monotonic()
        if not due and now - self._last.get(source, float("-inf")) < self.settings.member_heartbeat:
            return False
        self._last[source] = now
        try:
            found = self._heartbeat(source)
        except (psycopg2.Error, LRError) as exc:
            self._drop(source)
            if source not in self._failing:
                self._failing.add(source)
                log.warning(
                    "replicator member %s: no heartbeat at %s (%s); its sessions keep their last assignment",
                    self.owner,
                    source,
                    one_line(exc),
                )
            return False
        if source in self._failing:
            self._failing.discard(source)
            log.info("replicator member %s: heartbeats at %s again", self.owner, source)
        with self._guard:
            if source in self.sources:  # not one ``follow`` just left
                self._view[source] = [m.owner for m in found]
                self._cut[source] = {m.owner: m.unreached for m in found if m.unreached}
            share = self._share()
            changed, self._assigned = share != self._assigned, share
        if changed:
            log.info(
                "replicator member %s works %d of %d sessions now (members: %s)",
                self.owner,
                len(share),
                len(self.sessions),
                "; ".join(f"{s}: {len(ms)}" for s, ms in sorted(self.view().items())),
            )
        return changed

    def _heartbeat(self, source: str) -> list[members.Member]:
        """Beat (join first, or again when found dead and forgotten); forget the long dead; the live
        members."""
        conn = self._conns.get(source)
        if conn is None or conn.closed:
            conn = self._conns[source] = self.connect(source)
            conn.autocommit = True  # the lock is the session's; each statement stands alone
            schema.require_current(conn, "sharing its sessions between replicators", schema.REPLICATION_SCHEMA)
            with conn.cursor() as cur:  # a statement stuck this long: this member is as good as dead
                cur.execute("SELECT pg_catalog.set_config('statement_timeout', %s, false)", (self._bound_ms(),))
        says = schema.at_least(conn, UNREACHED_SCHEMA)  # the sites a member cannot reach: V0050
        unreached = sorted(self.unreached()) if says and self.unreached is not None else None
        with conn.cursor() as cur:
            key = self._keys.get(source)
            if key is None or not members.beat(cur, self.owner, key, unreached):
                self._keys[source] = members.join(cur, self.owner, self.settings.member_dead_after)
            # a dead member's row stays while a lease it held may still be unexpired: until then
            # that lease is known as a dead member's, and taken at once
            forgotten = members.forget_dead(cur, max(self.settings.lease_seconds, self.settings.member_dead_after))
            found = members.live(cur, with_unreached=says)
        if forgotten:
            log.info("replicator members gone from %s: %s", source, ", ".join(forgotten))
        return found

    def _bound_ms(self) -> str:
        return str(int(self.settings.member_dead_after * 1000))

    def _drop(self, source: str) -> None:
        conn = self._conns.pop(source, None)
        self._keys.pop(source, None)  # its lock went with the connection
        if conn is not None and not conn.closed:
            conn.close()

    def quiet(self) -> None:
        """No new heartbeat from now on (the replicator is closing): one started after a stop, on a
        source that stopped answering, held ``leave`` for its connect and calls (the one in progress
        still ends first)."""
        self._stop.set()

    def leave(self) -> None:
        """Stop beating and unregister everywhere it can: the other members take this one's
        sessions at their next heartbeat (where the source cannot be reached, the lock goes with
        the connection anyway). The caller releases its leases first."""
        self._stop.set()
        for thread in self._threads:
            thread.join()
        self._threads.clear()
        for source in list(self._conns):
            conn, key = self._conns[source], self._keys.get(source)
            try:
                if key is not None and not conn.closed:
                    with conn.cursor() as cur:
                        members.leave(cur, self.owner, key)
            except psycopg2.Error as exc:
                log.info("replicator member %s: not unregistered at %s: %s", self.owner, source, one_line(exc))
            finally:
                self._drop(source)
