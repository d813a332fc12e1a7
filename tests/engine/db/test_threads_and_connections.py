"""Other threads act on a connection its owner uses: the deadline thread cuts a call past its
deadline, a heartbeat asks which server it reached. Its owner may close it meanwhile (the call
failed, the work ended): libpq then frees the connection under the other thread, so that thread
must ask libpq nothing of it. Before, a cut read the connection's server, backend and socket from
libpq: a cut meeting a close crashed the whole process with a segmentation fault (every thread of
`lr sync` gone at once; seen as the test process dying)."""

from __future__ import annotations

import threading

import psycopg2
import pytest

from airflow_provider_lr.engine.db import conninfo, orphans
from airflow_provider_lr.engine.db.timeouts import DEADLINES, BoundedConnection, cap


class OwnedConnection(BoundedConnection):
    """A connection that notes every question put to libpq about it from a thread other than the
    one that opened it."""

    strangers: list[str] = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.owner = threading.get_ident()

    def _asked(self, what: str) -> None:
        if threading.get_ident() != self.owner:
            OwnedConnection.strangers.append(f"{what} from {threading.current_thread().name}")

    @property
    def info(self):
        self._asked("info")
        return super().info

    def fileno(self) -> int:
        self._asked("fileno")
        return super().fileno()


def test_a_call_cut_by_the_deadline_thread_asks_libpq_nothing_of_its_connection(sites, monkeypatch):
    monkeypatch.setattr(conninfo, "BoundedConnection", OwnedConnection)
    OwnedConnection.strangers.clear()
    conn = cap(sites[0].conninfo.connect(), 1.0)
    assert isinstance(conn, OwnedConnection)
    cuts = DEADLINES.cut
    try:
        with pytest.raises(psycopg2.OperationalError), conn.cursor() as cur:
            cur.execute("SELECT pg_catalog.pg_sleep(30)")
        assert DEADLINES.cut == cuts + 1 and conn.was_cut
        reached = (str(conn.info.host), str(conn.info.port), str(conn.info.dbname))  # (asked by its owner)
        heard: list[tuple[str, str, str]] = []
        heartbeat = threading.Thread(target=lambda: heard.append(orphans.server(conn)), name="a heartbeat")
        heartbeat.start()
        heartbeat.join()
        assert heard == [reached]
        assert OwnedConnection.strangers == []
    finally:
        conn.close()
        sites[0].conninfo.connect().close()  # lr's next connection there ends the cut call's backend
        orphans.CUT.clear()
