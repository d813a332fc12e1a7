"""Key ranges of a table (``range_copy.plan_ranges``, what the Spark snapshot's tasks each copy):
whatever the type of the key, the ranges cover every row of the table exactly once."""

from __future__ import annotations

from psycopg2 import sql

from airflow_provider_lr.engine.tables.definition import TableName, read_definition
from airflow_provider_lr.engine.tables.range_copy import plan_ranges

# a key type, and its value for row g of 1..300 (NaN, -0 and ±Infinity among the floats)
KEYS = {
    "int[]": "ARRAY[g % 10, g]",  # an array: it has no array type of its own to hold percentiles
    "int4range": "int4range(g, g + g % 5 + 1)",
    "text": "chr(65 + g % 26) || chr(97 + g * 7 % 26) || g",
    "float8": "(CASE g WHEN 1 THEN 'NaN' WHEN 2 THEN '-0' WHEN 3 THEN 'Infinity' WHEN 4 THEN '-Infinity' "
    "ELSE (g / 7.0)::text END)::float8",
    "timestamptz": "'2026-01-01'::timestamptz + g * interval '1 minute 0.333 sec'",
    "bytea": "decode(md5(g::text), 'hex')",
}


def test_the_key_ranges_of_a_table_cover_each_row_once_whatever_the_type_of_its_key(lr_sites):
    site = lr_sites[0]
    conn = site.connect()
    try:
        with conn.cursor() as cur:
            for n, (kind, value) in enumerate(KEYS.items()):
                cur.execute(f"CREATE TABLE public.r{n} (k {kind} PRIMARY KEY, v int)")
                cur.execute(f"INSERT INTO public.r{n} SELECT {value}, g FROM generate_series(1, 300) g")
                definition = read_definition(cur, TableName("public", f"r{n}"))
                assert definition is not None
                ranges = plan_ranges(cur, definition, 5)
                assert len(ranges) > 1, kind
                seen: list[int] = []
                for key_range in ranges:
                    where = key_range.where(definition)
                    assert where is not None
                    cur.execute(sql.SQL("SELECT v FROM {} WHERE {}").format(definition.table.ident, where))
                    seen += [v for (v,) in cur.fetchall()]
                assert sorted(seen) == list(range(1, 301)), kind
    finally:
        conn.close()
