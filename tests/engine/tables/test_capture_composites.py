"""``lr.capture_composites`` (V0049): what a capture trigger notes of a table's composites when it is
opened and reads again at each statement, compared by each sink with its own as
``definition.SHAPE_COMPOSITES`` reads them. Two texts of one rule (SQL in a migration, SQL in the
engine): a difference in how either prints a type would refuse every change of such a table."""

from __future__ import annotations

import json

import psycopg2
import pytest

from airflow_provider_lr.engine.tables.definition import (
    EXPECT_COMPOSITES,
    TableName,
    changed_composites,
    read_definition,
)

TYPES = (
    'CREATE SCHEMA "Odd Schema"; '
    'CREATE TYPE "Odd Schema"."Inner Pair" AS ("First" int, "sp ace" numeric(12,4), "dot.ted" text[]); '
    'CREATE TYPE public.outer_t AS (p "Odd Schema"."Inner Pair", ts timestamptz(3), v varchar(7)); '
    "CREATE DOMAIN public.outer_d AS public.outer_t; "
    "CREATE TYPE public.mood AS ENUM ('sad', 'ok'); "
    "CREATE TABLE public.holds (id int PRIMARY KEY, d public.outer_d, a public.outer_t[], m public.mood)"
)


def composites(site) -> tuple[list, list]:
    """(what the capture reads, the composites of what a sink's shape reads), on ``site``."""
    conn = site.connect()
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT lr.capture_composites('public.holds')")
            (captured,) = cur.fetchone()
            definition = read_definition(cur, TableName("public", "holds"))
    finally:
        conn.close()
    assert definition is not None
    shaped = [[n, w] for n, w in definition.composites if not w.startswith(("enum [", "domain over ", "range of "))]
    return json.loads(captured), shaped


def test_the_capture_reads_a_tables_composites_as_a_sinks_shape_does_through_domains_arrays_and_nesting(lr_sites):
    site = lr_sites[0]
    site.query(TYPES)
    captured, shaped = composites(site)
    assert captured == shaped
    assert [n for n, _ in captured] == ['"Odd Schema"."Inner Pair"', "public.outer_t"]  # the enum is not one
    site.query('ALTER TYPE "Odd Schema"."Inner Pair" DROP ATTRIBUTE "First", ADD ATTRIBUTE "First" int')
    after, shaped = composites(site)
    assert after == shaped
    assert changed_composites(after, captured) == [
        'type "Odd Schema"."Inner Pair" is ("sp ace" numeric(12,4), "dot.ted" text[], "First" integer) on the '
        'source but ("First" integer, "sp ace" numeric(12,4), "dot.ted" text[]) on the sink (a composite\'s value '
        "travels by position: give the sink's type the source's attributes, in its order)"
    ]
    conn = site.connect()  # what the stream's fast transaction checks: the sink's are the carried ones
    try:
        with conn.cursor() as cur:
            cur.execute(EXPECT_COMPOSITES, {"t": "public.holds", "carried": json.dumps(after)})
            with pytest.raises(psycopg2.Error, match="the composites of a session's table differ") as raised:
                cur.execute(EXPECT_COMPOSITES, {"t": "public.holds", "carried": json.dumps(captured)})
            assert raised.value.pgcode == "LR409"
    finally:
        conn.close()
    site.query("DROP TABLE public.holds; CREATE TABLE public.holds (id int PRIMARY KEY, m public.mood)")
    assert site.query("SELECT lr.capture_composites('public.holds')") == [(None,)]
