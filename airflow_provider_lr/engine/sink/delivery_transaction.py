"""The transaction one delivery of a receive queue runs in, on its consumer's connection.

A delivery (``receive.ReceiveQueueReader``) is one transaction: it takes the queue's consumer lock,
reads the head, hands a run to the listener, and consumes the run; the listener writes through the
same connection, so its writes commit or roll back with the consume (exactly once).

Its round trips are the latency of a streamed entry's last step. On an autocommit connection (a
subscriber's and a relay's, made by ``delivery_connection``) the transaction's ``BEGIN`` is sent
with the lock and the first rows and its ``COMMIT`` with the consume: two round trips, plus what
the listener sends, where psycopg2 would add its own ``BEGIN`` and ``COMMIT``. There the head read
is a statement prepared once per connection (planning it costs more than running it); a connection
that lost it (``DEALLOCATE``, a pooler's ``DISCARD ALL``) reads it as text from then on. On any
other connection (the bulk apply's, a caller's) psycopg2 sends ``BEGIN`` and ``COMMIT`` itself.

What a listener may do to the connection during a callback does not split its writes from the
consume: on the autocommit connection psycopg2's ``commit()`` and ``rollback()`` do nothing; a
listener that turns autocommit off fails the delivery (rolled back, redelivered, autocommit set
back); one that ends the transaction itself (``with conn:``) has the consume run in a transaction
of its own, as it always had. A delivery that raised to its caller (a ``KeyboardInterrupt`` in a
callback) is rolled back when the next one opens.
"""

from __future__ import annotations

import psycopg2
import psycopg2.errors
import psycopg2.extensions

from airflow_provider_lr.engine.db import prepared, schema
from airflow_provider_lr.engine.errors import ConfigurationError, shown
from airflow_provider_lr.engine.store import receive_queue

_IDLE = psycopg2.extensions.TRANSACTION_STATUS_IDLE


def delivery_connection(conn: psycopg2.extensions.connection) -> psycopg2.extensions.connection:
    """Make a new connection a consumer's delivery connection: autocommit, the head read prepared,
    once its site is known to hold the lr schema a consumer reads (``SchemaError`` naming the site
    and `lr init` otherwise, the connection closed: a site without lr failed with "relation
    lr.receive_queue does not exist")."""
    conn.autocommit = True
    try:
        schema.require_current(conn, "consuming its receive queues", schema.REPLICATION_SCHEMA)
        prepared.ensure(conn, receive_queue.HEAD)
    except BaseException:
        conn.close()
        raise
    return conn


# (may the caller consume, the grants it holds): the owner of the queue's table and a role that bypasses
# row-level security read every queue; any other reads those its grants give it (the policies, V0006).
# On the application's connection, with its search_path: every function and operator is named with its schema.
# NULL where lr's schema or its grants cannot be read (a site without lr: its own refusal follows).
_CONSUMER_GRANTS = """
SELECT pg_catalog.pg_has_role(c.relowner, 'USAGE') OR r.rolsuper OR r.rolbypassrls
       OR EXISTS (SELECT FROM lr.role_grants g WHERE g.kind OPERATOR(pg_catalog.=) 'replicator'
                  OR (g.kind OPERATOR(pg_catalog.=) 'consumer' AND g.client_name OPERATOR(pg_catalog.=) %s)),
       (SELECT pg_catalog.string_agg(CASE WHEN g.client_name OPERATOR(pg_catalog.=) '' THEN g.kind
                                          ELSE pg_catalog.concat(g.kind, ' of ', g.client_name) END,
                                     ', ' ORDER BY g.kind, g.client_name) FROM lr.role_grants g)
FROM pg_catalog.pg_class c, pg_catalog.pg_roles r
WHERE c.oid OPERATOR(pg_catalog.=) 'lr.receive_queue'::pg_catalog.regclass AND r.rolname OPERATOR(pg_catalog.=) current_user
"""
_READABLE = (
    "SELECT pg_catalog.has_schema_privilege(n.oid, 'USAGE') AND pg_catalog.to_regclass('lr.receive_queue') IS NOT NULL "
    "AND pg_catalog.has_table_privilege(pg_catalog.to_regclass('lr.role_grants'), 'SELECT') "
    "FROM pg_catalog.pg_namespace n "
    "WHERE n.nspname OPERATOR(pg_catalog.=) 'lr'"
)


def require_consumer(conn: psycopg2.extensions.connection, client: str) -> None:
    """Refuse, naming the role, the site, what it holds and the grant to give, a role that row-level
    security shows none of ``client``'s queues: it polled nothing, for ever, without a word. Reads
    only; ends the transaction it ran in (none on an autocommit connection)."""
    try:
        with conn.cursor() as cur:
            cur.execute(_READABLE)
            readable = cur.fetchone()
            if not readable or not readable[0]:
                return
            cur.execute(_CONSUMER_GRANTS, (client,))
            may, held = cur.fetchone()
    finally:
        if not conn.autocommit:
            conn.rollback()
    if not may:
        params = conn.get_dsn_parameters()
        user, where = (
            params.get("user", "?"),
            f"{params.get('host', '?')}:{params.get('port', '?')}/{params.get('dbname', '?')}",
        )
        raise ConfigurationError(
            f"role {user!r} may not consume the receive queues of client {shown(client)} on site {where} (it holds "
            f"{held or 'no grant of lr'} there): nothing would ever be delivered to it; the owner of the lr schema "
            f"grants it: lr roles grant consumer --client {client} --role {user} --site <this site> (docs/security.md)"
        )


class DeliveryTransaction:
    """One delivery's transaction on ``conn``: ``open``, then ``consume`` or ``rollback``."""

    def __init__(self, conn: psycopg2.extensions.connection) -> None:
        self.conn = conn
        self.explicit = conn.autocommit  # lr sends BEGIN and COMMIT with its statements

    def open(self, source: str, client: str, inline_bytes: int, first: int) -> tuple[int | None, list[tuple]] | None:
        """Take the queue's consumer lock and read its ``first`` rows (``receive_queue.lock_head``):
        (the snapshot barrier, the rows), or None (rolled back) when another consumer holds it."""
        if self.explicit and self.conn.info.transaction_status != _IDLE:
            self.rollback()  # what a delivery that raised to its caller left open
        head = prepared.ready(self.conn, receive_queue.HEAD)
        try:
            with self.conn.cursor() as cur:  # one round trip: the lock, the snapshot barrier, the first rows
                locked, barrier, rows = receive_queue.lock_head(
                    cur, source, client, inline_bytes, first, self.explicit, head
                )
        except psycopg2.errors.InvalidSqlStatementName:  # deallocated: read as text from now on
            prepared.forget(self.conn)
            self.rollback()
            return self.open(source, client, inline_bytes, first)
        if not locked:
            self.rollback()
            return None
        return barrier, rows

    def check(self) -> None:
        """After a callback: refuse a connection whose autocommit the listener changed."""
        if self.conn.autocommit != self.explicit:
            raise psycopg2.ProgrammingError("the listener changed the delivery connection's autocommit")

    def consume(self, finished: list[int], partial: tuple[int, int] | None) -> None:
        """Consume (``receive_queue.consume``) and commit."""
        with self.conn.cursor() as cur:
            if self.explicit and self.conn.info.transaction_status == _IDLE:
                cur.execute("BEGIN")  # the listener ended the transaction itself: the consume is one of its own
            receive_queue.consume(cur, finished, partial, commit=self.explicit)
        if not self.explicit:
            self.conn.commit()

    def rollback(self) -> None:
        """End the transaction, whatever state the listener left the connection in."""
        conn = self.conn
        if conn.closed:
            return
        if conn.autocommit != self.explicit:  # the listener changed it: end what psycopg2 began, set it back
            conn.rollback()
            conn.autocommit = self.explicit
        if not self.explicit:
            conn.rollback()
        elif conn.info.transaction_status != _IDLE:
            with conn.cursor() as cur:
                cur.execute("ROLLBACK")
