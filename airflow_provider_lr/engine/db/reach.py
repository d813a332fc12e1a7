"""Servers found unreachable within one command: not waited for a second time.

A stopped server (SIGSTOP, a hung host) accepts a TCP connect and never answers: a connect waits
``connect_timeout_s`` (10 s), a call its deadline. A command that reached the same server twice
(``lr status`` reading each site, then its drift; ``lr failover`` checking the sites, then
promoting) waited twice. While ``remembered`` (a CLI command; ``lr sync`` once it stops), a server
that made lr wait that way, a connect that timed out or a call cut by its deadline, is known lost
for the rest of the command: the next connect to it fails at once, and a call on another
connection to it is cut at once (``timeouts.Deadlines``). A long-running ``lr sync`` does not
remember (a site comes back, and is retried), until it stops.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

_lock = threading.RLock()  # RLock: ``remember`` runs in a signal handler too
_found: dict[str, str] = {}  # the server's key -> why it was found unreachable (one line)
_on = 0  # > 0: remembering (nested ``remembered``, and ``remember``)
_stopping = False  # ``remember`` was called


def key(params: Mapping[str, Any]) -> str:
    """Which server libpq parameters reach: host (or hostaddr) and port; '' and the default port
    stand for the local socket."""
    host = params.get("host") or params.get("hostaddr") or ""
    return f"{host}:{params.get('port') or 5432}"


def silent(reason: str, took: float, connect_timeout: Any) -> bool:
    """Whether a failed connect waited on a silent server (its connect timeout expired), not one
    refused at once (down, starting up: tried again, as a wait for it to start does)."""
    return "timeout expired" in reason or (bool(connect_timeout) and took >= float(connect_timeout))


@contextmanager
def remembered() -> Iterator[None]:
    """Remember unreachable servers for the duration (a CLI command): forgotten at its end."""
    global _on
    with _lock:
        _on += 1
    try:
        yield
    finally:
        with _lock:
            _on -= 1
            if not _on:
                _found.clear()


def remember(on: bool = True) -> None:
    """From now on, remember (``lr sync`` stopping: a site that stopped answering holds the stop
    once); ``on`` False: as before (``cli.main`` may run again in this process). Idempotent."""
    global _on, _stopping
    with _lock:
        if on != _stopping:
            _on += 1 if on else -1
            _stopping = on
        if not _on:
            _found.clear()


def lost(server: str | None, why: str) -> None:
    """``server`` made lr wait for nothing (``why``): remembered, while remembering."""
    if server is not None and _on:
        with _lock:
            _found.setdefault(server, why)


def known(server: str | None) -> str | None:
    """Why ``server`` is known unreachable in this command, or None."""
    if server is None or not _on:
        return None
    return _found.get(server)


# A server that answered but has no connection slot for lr (SQLSTATE 53300, which libpq does not pass
# on at connect): its max_connections, or the role's or the database's CONNECTION LIMIT, is reached.
# It is up: "is the server up?" sent the user to the wrong place.
_FULL_TEXT = ("too many clients", "connection slots are reserved", "too many connections for")


def advice(reason: str) -> str:
    """What a connect that failed with ``reason`` (retried: the server may free a slot) asks of the user."""
    if any(marker in reason.lower() for marker in _FULL_TEXT):
        return (
            "the server is up but its connections are all taken (max_connections, or the role's or database's "
            "CONNECTION LIMIT): see who holds them (SELECT application_name, count(*) FROM pg_stat_activity "
            "GROUP BY 1) and close some, or raise the limit; retried meanwhile"
        )
    return "is the server up? (`lr sites list` for embedded sites)"
