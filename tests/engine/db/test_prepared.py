"""A statement prepared once on a connection runs by name with the same named parameters, NULLs
and empty arrays included, and returns what the statement sent as text returns."""

from __future__ import annotations

import pytest

from airflow_provider_lr.engine.db import prepared
from airflow_provider_lr.engine.db.prepared import Prepared

SQL = """
SELECT %(n)s + 1, array_length(%(ids)s::int8[], 1), %(ids)s::int8[], %(word)s || '%%', %(n)s * 2
"""
STATEMENT = Prepared("lr_test_prepared", SQL, {"n": "int8", "ids": "int8[]", "word": "text"})


@pytest.mark.parametrize(
    "params",
    [
        {"n": 41, "ids": [1, 2, 3], "word": "a"},
        {"n": 0, "ids": [], "word": ""},
        {"n": 7, "ids": [None, 5], "word": "x"},
    ],
)
def test_a_prepared_statement_returns_what_the_text_returns(lr_sites, params):
    conn = lr_sites[0].connect()
    conn.autocommit = True
    STATEMENT.prepare(conn)
    with conn.cursor() as cur:
        cur.execute(SQL, params)
        as_text = cur.fetchall()
        STATEMENT.execute(cur, params)
        assert cur.fetchall() == as_text
        cur.execute("SELECT count(*) FROM pg_prepared_statements WHERE name = 'lr_test_prepared'")
        assert cur.fetchone()[0] == 1
    conn.close()


def test_every_placeholder_needs_a_type():
    with pytest.raises(AssertionError, match="no SQL type given for \\['m'\\]"):
        Prepared("lr_test_untyped", "SELECT %(n)s, %(m)s", {"n": "int8"})


def test_ensure_prepares_once_keeps_one_a_reused_session_holds_and_forget_makes_it_look_again(lr_sites):
    """One registry for every connection lr keeps: ``ensure`` prepares what is missing (a session a
    pooler hands over may hold it already), ``ready`` says so, ``forget`` after a DISCARD ALL."""
    other = Prepared("lr_test_prepared_other", "SELECT %(n)s", {"n": "int8"})
    conn = lr_sites[0].connect()
    conn.autocommit = True
    STATEMENT.prepare(conn)  # as a session reused from a pooler would hold it
    assert not prepared.ready(conn, STATEMENT)
    prepared.ensure(conn, STATEMENT, other)
    assert prepared.ready(conn, STATEMENT) and prepared.ready(conn, other)
    with conn.cursor() as cur:
        cur.execute("DISCARD ALL")
        prepared.forget(conn)
        assert not prepared.ready(conn, other)
        prepared.ensure(conn, other)
        other.execute(cur, {"n": 5})
        assert cur.fetchone() == (5,)
    conn.close()
