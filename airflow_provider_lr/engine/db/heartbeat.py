"""The heartbeat of a long call on a ``lifted`` connection (``timeouts.Deadlines.heartbeat``).

Such a call has no deadline (a full sync's apply, a provider's queries may run for hours), so a
server that stopped answering, or a link that stalled, would hold it for good. Each deadline the
call runs, a second connection asks the server whether the call's backend still works on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg2.extensions

from airflow_provider_lr.engine.db import orphans
from airflow_provider_lr.engine.errors import error_line


@dataclass(eq=False)
class Beat:
    """A call on a lifted connection under watch."""

    conn: Any  # the call's ``BoundedConnection``
    pid: int  # its backend
    seconds: float  # probed this often: the call deadline the connection had
    reopen: Callable[[], psycopg2.extensions.connection]
    due: float  # the next probe (monotonic)
    probing: bool = False
    finished: int = 0  # probes in a row that found the backend not working on a call


def verdict(beat: Beat, cap: Callable[[Any, float], Any]) -> str:
    """One probe: "" while the call's backend works on it; else why the call is lost: the server
    cannot be reached within the call's deadline (a stalled link, a stopped server), or the backend
    has sat idle twice in a row (the answer was lost on the way, or the call never reached it: a
    backend stopped between calls). A backend stopped in the middle of a statement looks like a
    long statement: only a COPY's progress (``Deadlines.stalled``) tells them apart."""
    try:
        probe = cap(beat.reopen(), beat.seconds)
        try:
            with probe.cursor() as cur:  # idle a moment between the statements of one call: working
                cur.execute(
                    "SELECT state, state = 'active' OR pg_catalog.now() - state_change < interval '1 s' "
                    "FROM pg_catalog.pg_stat_activity WHERE pid = %s",
                    (beat.pid,),
                )
                row = cur.fetchone()
            # no such backend: gone, unless the probe reached another server (a DSN of several hosts)
            row = row or (None, orphans.server(probe) != orphans.server(beat.conn))
        finally:
            probe.close()
    except Exception as exc:  # noqa: BLE001 - any failure to reach the server is the verdict
        if _answered(exc):  # it is up (no free connection slot, say): the call may well be working
            beat.finished = 0
            return ""
        return f"a second connection to its server failed ({error_line(exc)})"
    state, working = row
    beat.finished = 0 if working else beat.finished + 1
    if beat.finished >= 2:
        return f"its server shows no work on the call (backend {state or 'gone'}) and no answer came"
    return ""


def _answered(exc: BaseException | None) -> bool:
    """True when a failed probe got an error from the server itself (an SQLSTATE, or a FATAL at
    connect: too many clients, a password refused): the server is up and answering."""
    while exc is not None:
        if getattr(exc, "pgcode", None) or "FATAL:" in str(exc):
            return True
        exc = exc.__cause__
    return False
