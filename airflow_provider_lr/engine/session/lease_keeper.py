"""A thread that keeps a long run's session leases alive (the fan-out's plan takes them; its
chunks may run for longer than ``lease_seconds``, and a lease that ran out would let another
replicator take the session over in the middle of the run)."""

from __future__ import annotations

import logging
import threading

import psycopg2

from airflow_provider_lr.engine.db.conninfo import connect_dsn
from airflow_provider_lr.engine.db.timeouts import DEFAULT, Purpose, Timeouts
from airflow_provider_lr.engine.errors import FencedError, LRError, SiteUnreachableError, one_line
from airflow_provider_lr.engine.session import lease as leases

log = logging.getLogger(__name__)


class LeaseKeeper:
    """Renews ``held`` on the source every third of ``seconds`` (on its own connection) until
    ``stop``. A lease taken over since is left alone: the sink fences its writer. A source that
    cannot be reached is tried again at the next renewal (a new connection); anything else stops
    the keeper, logged on one line and kept in ``error``: the owner's writes are then fenced once
    the leases run out, and its ``finish`` names the sessions."""

    def __init__(self, dsn: str, held: list[leases.Lease], seconds: float, timeouts: Timeouts = DEFAULT) -> None:
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.timeouts = timeouts  # the topology's: the heartbeat of its connection
        self._thread = threading.Thread(
            target=self._run, args=(dsn, held, seconds), daemon=True, name="lr-fanout-lease-keeper"
        )
        if held:
            self._thread.start()

    def _run(self, dsn: str, held: list[leases.Lease], seconds: float) -> None:
        conn = None
        try:
            while not self._stop.wait(max(1.0, seconds / 3)):
                try:
                    # a bulk connection: a bulk plan's DSN sets no statement timeout, so a session one would
                    # have no call deadline; the heartbeat cuts a renewal on a server that stopped
                    conn = (
                        conn if conn is not None and not conn.closed else connect_dsn(dsn, Purpose.BULK, self.timeouts)
                    )
                except (psycopg2.OperationalError, SiteUnreachableError) as exc:  # conninfo names the site
                    log.warning(
                        "leases not renewed (source unreachable, tried again in %.0f s): %s",
                        max(1.0, seconds / 3),
                        one_line(exc),
                    )
                    continue
                for lease in held:
                    try:
                        leases.renew(conn, lease, seconds)
                    except (FencedError, psycopg2.Error) as exc:
                        log.warning("lease of %s/%s not renewed: %s", lease.sink, lease.client, one_line(exc))
        except Exception as exc:  # a bug: never silent
            self.error = exc
            (log.error if isinstance(exc, LRError) else log.exception)("lease keeper stopped: %s", one_line(exc))
        finally:
            if conn is not None:
                conn.close()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
