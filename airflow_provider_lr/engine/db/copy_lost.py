"""A COPY whose connection its server ended in the middle (``pg_terminate_backend``, the next lease
holder ending a stopped replicator's fenced transaction, a server restart): one clear error, and
nothing printed.

psycopg2 (2.9) meets the server's error twice there: it raises the first (``AdminShutdown:
terminating connection due to administrator command``), then, with that still set, decodes the
second, which fails as ``SystemError: ... returned a result with an exception set``; its C code
prints that pair through ``sys.excepthook`` (a chained traceback on stderr, in the middle of ``lr
sync``'s lines) and the COPY raises a bare ``OperationalError`` ("invalid socket", "server closed
the connection unexpectedly") that says nothing of why. ``guarded`` runs a COPY with a hook that
keeps that pair from stderr and raises instead an ``OperationalError`` naming the site and the
server's reason; every other exception the hook sees goes to the hook that was there before. A
COPY whose server stopped at once or whose link broke (no error sent: psycopg2's "error with status
PGRES_COPY_OUT and no message from the libpq") fails the same way, saying the connection was lost.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

import psycopg2

from airflow_provider_lr.engine.errors import error_line

_DOUBLE_RAISE = "returned a result with an exception set"
_NO_MESSAGE = "no message from the libpq"  # psycopg2's error for a COPY whose connection went silent
_seen = threading.local()  # the server's error psycopg2 printed, in the thread whose COPY met it


def _psycopg2_double_raise(value: BaseException) -> psycopg2.Error | None:
    cause = value.__cause__
    if isinstance(value, SystemError) and _DOUBLE_RAISE in str(value) and isinstance(cause, psycopg2.Error):
        return cause
    return None


class _Hook:
    """``sys.excepthook`` in front of the one that was there: takes the pair above, passes the rest."""

    def __init__(self, previous: Callable[[type[BaseException], BaseException, TracebackType | None], Any]) -> None:
        self.previous = previous

    def __call__(self, kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> Any:
        cause = _psycopg2_double_raise(value)
        if cause is None:
            return self.previous(kind, value, tb)
        _seen.error = cause
        return None


_install_lock = threading.Lock()


def _install() -> None:
    if not isinstance(sys.excepthook, _Hook):
        with _install_lock:
            if not isinstance(sys.excepthook, _Hook):
                sys.excepthook = _Hook(sys.excepthook)


def guarded(conn: Any, call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)``, a COPY on ``conn`` (lr's ``BoundedConnection``): a connection its server ended
    meanwhile fails it with that reason, on one line (a call lr cut itself keeps its error, which
    ``explain`` reads)."""
    _install()
    _seen.error = None
    try:
        return call(*args)
    except psycopg2.Error as exc:
        server_said, _seen.error = _seen.error, None
        if getattr(conn, "was_cut", False):
            raise
        if server_said is None:
            if _NO_MESSAGE in str(exc) and conn.closed:  # a server stopped at once, a link broken
                raise psycopg2.OperationalError(
                    f"{conn.describe()} was lost in the middle of a COPY: its server stopped or the link "
                    "to it broke, without a word from the server"
                ) from exc
            raise
        lost = psycopg2.OperationalError(
            f"{conn.describe()} was ended in the middle of a COPY by its server ({error_line(server_said)})"
        )
        raise lost from server_said
    finally:
        _seen.error = None
