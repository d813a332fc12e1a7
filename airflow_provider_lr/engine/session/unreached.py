"""The sites this replicator process cannot reach now: what its member's heartbeats say (V0050), so
that the members give a session whose sink this process is cut off from to one that reaches it
(``assignment.assign``'s cut).

A site is marked when a connection to it waited for nothing (a connect timed out, a call was cut at
its deadline: a stalled or half-open link, a firewall dropping packets), not when it refused at once
(a server restarting refuses everyone alike: moving its sessions would gain nothing), and only in
a process that shares its sessions with others (``shared``). While it lasts the cycles do not wait
on the site again (their sessions of it fail at once, until the heartbeats hand them over); it goes
when a probe, every ``probe_every`` seconds on a thread of its own, connects and is answered again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import psycopg2.extensions

log = logging.getLogger(__name__)


class Unreached:
    """The marks, ``failed`` and ``reached`` as connections fail and succeed; called, the sites
    marked now (sorted)."""

    def __init__(
        self, connect: Callable[[str], psycopg2.extensions.connection], shared: bool = True, probe_every: float = 5.0
    ) -> None:
        # ``shared``: the process is a member (else nobody else could take its sessions: nothing marked)
        self.connect, self.shared, self.probe_every = connect, shared, probe_every
        self._marks: dict[str, str] = {}  # site -> why it is taken as cut off
        self._guard = threading.Lock()
        self._stop = threading.Event()
        self._probe: threading.Thread | None = None

    def __call__(self) -> list[str]:
        with self._guard:
            return sorted(self._marks)

    def why(self, site: str) -> str | None:
        """Why ``site`` is marked, or None."""
        with self._guard:
            return self._marks.get(site)

    def failed(self, site: str, why: str) -> None:
        """A connection to ``site`` waited for nothing (``why``): marked until one is made again."""
        with self._guard:
            if site in self._marks or self._stop.is_set() or not self.shared:
                return
            self._marks[site] = why
            if self._probe is None:
                self._probe = threading.Thread(target=self._probing, daemon=True, name="lr-unreached-probe")
                self._probe.start()
        log.warning(
            "site %s cannot be reached from here (%s): its sessions go to a replicator member that reaches it, if any",
            site,
            why,
        )

    def reached(self, site: str) -> None:
        with self._guard:
            if site not in self._marks:
                return
            del self._marks[site]
        log.info("site %s reached from here again", site)

    def close(self) -> None:
        self._stop.set()

    def _probing(self) -> None:
        while not self._stop.wait(self.probe_every):
            for site in self():
                try:
                    conn = self.connect(site)
                    try:  # answered, not only let in: a link that stalls after the login stays marked
                        with conn.cursor() as cur:
                            cur.execute("SELECT 1")
                    finally:
                        conn.close()
                except Exception:  # still cut off (or down): the mark stays
                    continue
                self.reached(site)
            with self._guard:
                if not self._marks:  # (under the guard: a mark made now starts a new probe)
                    self._probe = None
                    return
