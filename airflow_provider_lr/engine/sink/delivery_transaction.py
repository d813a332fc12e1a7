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

from airflow_provider_lr.engine.db import grants, prepared, schema
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


def require_consumer(conn: psycopg2.extensions.connection, client: str) -> None:
    """Refuse (``ConfigurationError``: the role, the site, what it holds, the grant to give) a role that
    row-level security shows none of ``client``'s queues: it polled nothing, for ever, without a word."""
    found = grants.held(conn, receive_queue.TABLE, ("consumer", "replicator"), client)
    if found is not None and not found.may:
        params = conn.get_dsn_parameters()
        where = f"{params.get('host', '?')}:{params.get('port', '?')}/{params.get('dbname', '?')}"
        doing = f"consume the receive queues of client {shown(client)}"
        raise ConfigurationError(
            found.refusal(doing, "consumer", client, where, ": nothing would ever be delivered to it")
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
