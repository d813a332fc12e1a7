"""A connection in autocommit for a while: one round trip per statement.

psycopg2 in its default (transaction) mode sends ``BEGIN`` before a transaction's first statement
and ``COMMIT``/``ROLLBACK`` at its end, each a round trip of its own: a single statement costs three.
A hot loop's single statements (an acknowledgement, a renewal, a look at a server's WAL position)
run alone in autocommit instead, and its multi-statement transactions send their own ``BEGIN`` and
``COMMIT`` with their first and last statements (``FencedTransaction`` on an autocommit connection).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import psycopg2.extensions


@contextlib.contextmanager
def autocommit(conn: psycopg2.extensions.connection) -> Iterator[psycopg2.extensions.connection]:
    """``conn`` in autocommit inside the block, as it was after it (unless it was lost). A
    transaction still open on it (left by a statement that failed) is rolled back first: its
    callers commit what they mean to keep."""
    was = conn.autocommit
    if conn.get_transaction_status() != psycopg2.extensions.TRANSACTION_STATUS_IDLE:
        conn.rollback()
    conn.autocommit = True
    try:
        yield conn
    finally:
        if not conn.closed:
            conn.autocommit = was
