"""Statements prepared once on a connection and executed by name.

psycopg2 sends every statement as text, which the server parses and plans on every call. For a
statement a stream runs hundreds of times a second that costs more than running it: the routed read
plans in ~0.3 ms and runs in ~0.1 ms. ``Prepared`` turns a statement written with psycopg2's named
placeholders (``%(name)s``) into a server-side prepared statement with typed parameters, prepared by
the connection's owner once (``prepare``), then executed by name with the same parameters as before.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Mapping

import psycopg2.extensions

_PLACEHOLDER = re.compile(r"%\((\w+)\)s")


class Prepared:
    """One statement, prepared under ``name`` on the connections that ``prepare`` it."""

    def __init__(self, name: str, sql: str, types: Mapping[str, str]) -> None:
        names = list(dict.fromkeys(_PLACEHOLDER.findall(sql)))  # in order of first use
        missing = [n for n in names if n not in types]
        assert not missing, f"no SQL type given for {missing} of prepared statement {name}"
        numbered = _PLACEHOLDER.sub(lambda m: f"${names.index(m.group(1)) + 1}", sql).replace("%%", "%")  # sent as is
        self.name, self.names = name, names
        self.prepare_sql = f"PREPARE {name} ({', '.join(types[n] for n in names)}) AS {numbered}"
        self.execute_sql = f"EXECUTE {name} ({', '.join(f'%({n})s::{types[n]}' for n in names)})"

    def prepare(self, conn: psycopg2.extensions.connection) -> None:
        """Prepare it on ``conn`` (once: a prepared statement lives as long as the connection)."""
        with conn.cursor() as cur:
            cur.execute(self.prepare_sql)
        if not conn.autocommit:
            conn.commit()

    def execute(self, cur: psycopg2.extensions.cursor, params: Mapping[str, object], before: str = "") -> None:
        """Run it on ``cur``'s connection, where it was prepared; ``before``: statements (no
        parameters) sent ahead of it in the same round trip."""
        cur.execute(before.replace("%", "%%") + self.execute_sql, {n: params[n] for n in self.names})


# the statements known to be prepared on each connection (by this process): one registry for every
# part of lr that prepares on a connection it keeps (a stream's sink writes, table targets, delivery)
_READY: weakref.WeakKeyDictionary[psycopg2.extensions.connection, set[str]] = weakref.WeakKeyDictionary()


def ensure(conn: psycopg2.extensions.connection, *statements: Prepared) -> None:
    """``statements`` prepared on ``conn``, each once: a connection that already holds one by that
    name (a pooler's reused session) keeps it (the names are versioned, so a statement of that name
    is this one). On the connection as it is, in the caller's transaction if one is open: a PREPARE
    outlives the transaction, whatever its end."""
    ready = _READY.setdefault(conn, set())
    missing = [s for s in statements if s.name not in ready]
    if not missing:
        return
    with conn.cursor() as cur:
        cur.execute(
            "SELECT name FROM pg_catalog.pg_prepared_statements WHERE name OPERATOR(pg_catalog.=) ANY(%s)",
            ([s.name for s in missing],),
        )
        there = {name for (name,) in cur.fetchall()}
        for statement in missing:
            if statement.name not in there:
                cur.execute(statement.prepare_sql)
    ready.update(s.name for s in missing)


def ready(conn: psycopg2.extensions.connection, statement: Prepared) -> bool:
    """Whether ``ensure`` prepared ``statement`` on ``conn`` (and nothing said it is gone since)."""
    return statement.name in _READY.get(conn, ())


def forget(conn: psycopg2.extensions.connection) -> None:
    """The statements ``ensure`` prepared on ``conn`` are gone (a pooler's ``DISCARD ALL``, a
    ``DEALLOCATE``): ``ready`` says so until the next ``ensure`` looks again."""
    _READY.pop(conn, None)
