"""Commits a command reports as done are on the site's disk when it says so.

On a server whose ``synchronous_commit`` is ``off``, a commit returns before its WAL is flushed: a
crash of that server within the WAL writer's delay forgets it. lr's fenced sink writes raise it to
``local`` for their transaction (``store/sink_sessions``); the commands that change a site's
standing (``lr topology apply``, ``lr failover`` and its ``--rejoin``: a new topology, a fence, a
reconciled sink, a promotion; ``lr init``, ``lr roles grant|revoke``, ``lr tables open|close`` and
the close's note on each sink) raise it for their whole connection (``durable``, ``made_durable``);
a full-sync request (``source/full_sync``) and a lease taken anew, its epoch bumped
(``store/source_sessions.take_lease``), for their own transaction (``THIS_TRANSACTION``). Before, a
sink that crashed right after `lr failover` said it was done came back with the old topology and
its session from the old source open: the new source's sessions to it were refused
(``tests/guarantees/test_failover_durable.py``). A server set to ``on``, ``remote_write`` or
``remote_apply`` keeps its own setting (each flushes locally)."""

from __future__ import annotations

from collections.abc import Callable

import psycopg2.extensions

RAISE_TO_LOCAL = (
    "SELECT set_config('synchronous_commit', 'local', false) WHERE current_setting('synchronous_commit') = 'off'"
)
# the same for one transaction, ahead of its first statement: a full-sync request (``source/full_sync``)
# said `requested` and then forgotten by a crash of its source was never carried out
THIS_TRANSACTION = (
    "SELECT set_config('synchronous_commit', 'local', true) WHERE current_setting('synchronous_commit') = 'off'; "
)


def durable(
    connect: Callable[[str], psycopg2.extensions.connection],
) -> Callable[[str], psycopg2.extensions.connection]:
    """``connect`` whose connections commit durably (``RAISE_TO_LOCAL`` for the session)."""

    def connected(site: str) -> psycopg2.extensions.connection:
        return made_durable(connect(site))

    return connected


def made_durable(conn: psycopg2.extensions.connection) -> psycopg2.extensions.connection:
    """``conn``, its commits from now on durable (``RAISE_TO_LOCAL``; closed when that fails):
    ``lr init``'s schema and ``lr roles``' grants too, which a crash right after forgot."""
    try:
        with conn.cursor() as cur:
            cur.execute(RAISE_TO_LOCAL)
        conn.commit()
    except BaseException:
        conn.close()
        raise
    return conn
