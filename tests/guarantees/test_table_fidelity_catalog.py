"""Every type of the site's own catalog as a federated table's column, not a hand list: each base,
range and multirange type of ``pg_catalog`` a column can have, and its array type, carried by the
snapshot (``lr tables open`` on a populated table), by ``lr sync``'s stream (inserts, updates, a key
change, deletes) and by a full sync asked while it streams; or, for a type lr cannot carry, refused
by ``lr tables open`` naming the column and the type. A type the catalog has and this module has no
values for fails the sweep: a new PostgreSQL's types are swept too, or the test says which are not.

The sites' sessions do not share their settings: the writer's and the sinks' ``DateStyle``,
``IntervalStyle``, ``TimeZone``, ``extra_float_digits`` and ``bytea_output`` differ from the
source's, so a value whose text depends on them (a date, an interval, a ``timestamptz``, a float, a
``bytea``) shows if a path carries its text under one site's settings and reads it under another's.
site-c's sessions read an array's ``NULL`` as a string (``array_nulls = off``), which lr's apply
must not. site-b's sessions take ``LATIN1`` as their client encoding: a snapshot's bytes, copied undecoded,
must be read there as the source wrote them. The application's writer quotes every identifier (``quote_all_identifiers``: ``format_type`` prints
``"text"``), which the capture's note of its columns' types must not follow. Objects a ``reg*``
value names exist at every site under other oids (the sinks made more objects first): a value
arrives as the object it names, as PostgreSQL's text replication and ``pg_dump`` carry it, never as
the source's oid."""

from __future__ import annotations

import pytest

from airflow_provider_lr.engine.errors import TableError
from tests.guarantees.test_table_fidelity_streaming import FAST, forced_full_sync_of_site_b
from tests.support.session import Streaming, apply, replicator, wait_for
from tests.support.tables import federate

# Values of each type (SQL expressions, cast to the column's type): NULL comes first, then these;
# empty and extreme ones, and ones whose text depends on a session's settings.
VALUES: dict[str, list[str]] = {
    "bool": ["true", "false"],
    "char": ["'x'", "'\\377'", "''"],
    "int2": ["-32768", "32767", "0"],
    "int4": ["-2147483648", "2147483647"],
    "int8": ["-9223372036854775808", "9223372036854775807"],
    "float4": ["'NaN'", "'-Infinity'", "'1.4e-45'", "0.1", "'-0'"],
    "float8": ["'Infinity'", "1.0000000000000002e-300", "0.1", "-1.7976931348623157e308", "'-0'"],
    "numeric": ["'NaN'", "'-Infinity'", "1.10", "-123456789012345678901234567890.12345678901234567890"],
    "money": ["12.34", "-92233720368547758.08", "0"],
    "text": ["''", "E'tab\\there\\nnew \\\\ ''q'' \"dq\"'", "'ünïcødé ✓ 😀 e\u0301'"],
    "varchar": ["''", "'  padded  '"],
    "bpchar": ["''", "'ab  '"],
    "name": ["''", "repeat('n', 63)"],
    "bytea": [
        "''::bytea",
        "(SELECT string_agg(set_byte('\\x00'::bytea, 0, g), ''::bytea) FROM generate_series(0, 255) g)",
    ],
    "uuid": ["'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'", "'00000000-0000-0000-0000-000000000000'"],
    "date": ["'infinity'", "'-infinity'", "'4713-01-01 BC'", "'5874897-12-31'", "'2026-01-02'"],
    "time": ["'24:00:00'", "'00:00:00.000001'"],
    "timetz": ["'23:59:59.999999-15:59'", "'12:00+14'"],
    "timestamp": ["'-infinity'", "'294276-12-31 23:59:59.999999'", "'4713-01-01 00:00 BC'", "'2026-01-02 03:04'"],
    "timestamptz": ["'infinity'", "'2026-03-29 01:30:00 Europe/Berlin'", "'1999-12-31 23:59:59.123456+05:30'"],
    "interval": ["'infinity'", "'-178000000 years'", "'1 mon -2 days 03:04:05.678901'", "'-1 days +02:03:00'"],
    "json": ['\'{"b": 1,  "a": [1, 2.50, null], "b": 2}\'', "'\"\"'", "'null'"],
    "jsonb": ["'null'", "'{}'", '\'{"n": 1.50, "deep": {"x": [true, null]}}\''],
    "jsonpath": ["'$.a[*] ? (@ > 1.5)'", "'strict $'"],
    "bit": ["B'1'", "B'0'"],
    "varbit": ["B''", "B'10101'"],
    "tsvector": ["''", "'a fat:1A cat:2B,3 sat'"],
    "tsquery": ["''", "'fat & (rat | cat) <-> !sat'"],
    "point": ["'(1.5,-2.25)'", "'(NaN,Infinity)'"],
    "line": ["'{1,-1,0}'", "'{0,1,2.5}'"],
    "lseg": ["'[(0,0),(1,1)]'", "'[(-1e300,2),(3,4)]'"],
    "box": ["'(1,1),(0,0)'", "'(2,3),(2,3)'"],
    "path": ["'[(0,0),(1,1),(2,0)]'", "'((0,0))'"],
    "polygon": ["'((0,0),(1,1),(1,0))'", "'((0,0))'"],
    "circle": ["'<(0,0),1.5>'", "'<(1e-300,2),0>'"],
    "inet": ["'192.168.0.1/24'", "'::ffff:1.2.3.4/128'"],
    "cidr": ["'10.0.0.0/8'", "'2001:db8::/32'"],
    "macaddr": ["'08:00:2b:01:02:03'", "'ff:ff:ff:ff:ff:ff'"],
    "macaddr8": ["'08:00:2b:01:02:03:04:05'", "'00:00:00:00:00:00:00:00'"],
    "pg_lsn": ["'0/0'", "'FFFFFFFF/FFFFFFFF'"],
    "oid": ["0", "4294967295"],
    "xid": ["'0'", "'4294967295'"],
    "xid8": ["'0'", "'18446744073709551615'"],
    "cid": ["'0'", "'4294967295'"],
    "tid": ["'(0,0)'", "'(4294967295,65535)'"],
    "refcursor": ["''", "'a cursor'"],
    "int2vector": ["''", "'1 -2 32767'"],
    "oidvector": ["''", "'0 4294967295'"],
    "pg_snapshot": ["'10:20:10,14,15'", "'1:1:'"],
    "txid_snapshot": ["'10:20:10,14,15'", "'1:1:'"],
    "int4range": ["'empty'", "'[1,10)'", "'(,)'"],
    "int8range": ["'[-9223372036854775808,9223372036854775807)'", "'empty'"],
    "numrange": ["'(,1.50]'", "'[-Infinity,Infinity)'"],
    "tsrange": ["'[2026-01-01,infinity)'", "'(-infinity,2026-01-02 12:00]'"],
    "tstzrange": ["'[2026-01-01 00:00+02,2026-01-02 00:00+02)'", "'(,)'"],
    "daterange": ["'[2026-01-31,2026-02-28]'", "'empty'"],
    "int4multirange": ["'{}'", "'{[1,3), [5,8)}'"],
    "int8multirange": ["'{(,)}'", "'{[1,3)}'"],
    "nummultirange": ["'{}'", "'{[1.5,2.5], [3,)}'"],
    "tsmultirange": ["'{[2026-01-31,2026-02-28)}'", "'{}'"],
    "tstzmultirange": ["'{[2026-01-01 00:00+02,2026-01-02 00:00+02)}'", "'{}'"],
    "datemultirange": ["'{[2026-02-01,2026-03-01)}'", "'{(,2026-01-01)}'"],
    # objects by name: built-in ones, and the sweep's own (other oids at every site), and 0 ('-')
    "regclass": ["'pg_class'", "'sweep.thing'", "'-'"],
    "regtype": ["'integer[]'", "'sweep.kind'"],
    "regproc": ["'now'", "'sweep.fn'", "'-'"],
    "regprocedure": ["'sum(integer)'", "'sweep.fn(integer)'"],
    "regoper": ["'||/'", "'sweep.==='"],
    "regoperator": ["'+(integer,integer)'", "'sweep.===(integer,integer)'"],
    "regnamespace": ["'pg_catalog'", "'sweep'"],
    "regrole": ["'pg_monitor'", "'-'"],
    "regcollation": ["'\"C\"'", "'sweep.coll'"],
    "regconfig": ["'english'", "'sweep.cfg'"],
    "regdictionary": ["'simple'", "'sweep.dict'"],
    "xml": [],  # values only where the server was built with libxml (``xml_values``)
}
XML = ["'<a b=\"1\">x &amp; y</a>'", "''", "'text only'"]
# What lr cannot carry, refused by ``lr tables open``: no binary send/receive (``aclitem``: and its
# text names roles that differ between sites), or values no client can write (PostgreSQL's own
# internal types: their input and receive refuse every value).
REFUSED = {
    "aclitem",
    "gtsvector",
    "pg_node_tree",
    "pg_ndistinct",
    "pg_dependencies",
    "pg_mcv_list",
    "pg_brin_bloom_summary",
    "pg_brin_minmax_multi_summary",
}
# The types binary COPY carries wrong: a table with one is copied as text (``tables/copy.by_text``)
BY_TEXT = {"int2vector", "oidvector", "tsquery"} | {t for t in VALUES if t.startswith("reg")}
TABLES = ("public.sweep", "public.sweep_binary")
# Objects the reg* values name, made at every site (the sinks made others first: other oids).
OBJECTS = (
    "CREATE SCHEMA sweep; CREATE TABLE sweep.thing (x int); CREATE TYPE sweep.kind AS (x int); "
    "CREATE FUNCTION sweep.fn(integer) RETURNS integer LANGUAGE sql AS 'SELECT $1'; "
    "CREATE OPERATOR sweep.=== (LEFTARG = integer, RIGHTARG = integer, FUNCTION = int4pl); "
    'CREATE COLLATION sweep.coll FROM "C"; CREATE TEXT SEARCH CONFIGURATION sweep.cfg (COPY = simple); '
    "CREATE TEXT SEARCH DICTIONARY sweep.dict (TEMPLATE = simple)"
)
# Each site's own session settings (the database's defaults: lr's connections and the writer's take them).
SETTINGS = {
    "site-a": "DateStyle = 'SQL, DMY'; IntervalStyle = 'iso_8601'; TimeZone = 'Pacific/Chatham'; "
    "extra_float_digits = -15; bytea_output = 'escape'",
    "site-b": "DateStyle = 'German'; IntervalStyle = 'sql_standard'; TimeZone = 'America/St_Johns'; "
    "extra_float_digits = 0; client_encoding = 'LATIN1'",
    "site-c": "DateStyle = 'Postgres, MDY'; IntervalStyle = 'postgres_verbose'; TimeZone = 'Asia/Kathmandu'; "
    "array_nulls = off",
}
# How rows are compared: every site's text read under the same settings.
READ = (
    "SET DateStyle = 'ISO'; SET IntervalStyle = 'postgres'; SET TimeZone = 'UTC'; SET extra_float_digits = 3; "
    "SET bytea_output = 'hex'; SET search_path = pg_catalog"
)


def catalog_types(site) -> list[tuple[str, str]]:
    """(type name, array type name or None) of every base, range and multirange type of pg_catalog a
    column can have, arrays left out (they come with their element type)."""
    return site.query(
        "SELECT t.typname, a.typname FROM pg_catalog.pg_type t "
        "JOIN pg_catalog.pg_namespace n ON n.oid = t.typnamespace LEFT JOIN pg_catalog.pg_type a ON a.oid = t.typarray "
        "WHERE n.nspname = 'pg_catalog' AND t.typtype IN ('b', 'r', 'm') AND t.typisdefined "
        "AND NOT EXISTS (SELECT FROM pg_catalog.pg_type e WHERE e.typarray = t.oid) ORDER BY t.typname"
    )


def xml_values(site) -> list[str]:
    try:
        site.query("SELECT '<a/>'::xml")
    except Exception:  # noqa: BLE001 - built without libxml: only NULL
        return []
    return XML


def columns(site) -> dict[str, list[str]]:
    """Every carried column (its name: the type's, ``_`` for the array) and its values, NULL first."""
    found = {}
    for typname, array in catalog_types(site):
        if typname in REFUSED:
            continue
        values = xml_values(site) if typname == "xml" else VALUES[typname]
        kind = f'pg_catalog."{typname}"'
        cast = [f"({v})::{kind}" for v in values]
        found[f'"{typname}" {kind}'] = ["NULL", *cast]
        if array:
            none = f"NULL::{kind}"
            first, last = cast[0] if cast else none, cast[-1] if cast else none
            found[f'"_{typname}" {kind}[]'] = [
                "NULL",
                "'{}'",
                f"ARRAY[{first}, {none}, {last}]",
                f"array_fill({last}, ARRAY[2, 1], ARRAY[-1, 5])",  # two dimensions, with bounds
            ]
    return found


def texts(site, table: str) -> dict:
    """Every row of ``table`` as each column's text, read under the same settings at every site."""
    conn = site.connect()
    conn.set_client_encoding("UTF8")  # site-b's sessions take LATIN1 (SETTINGS)
    try:
        with conn.cursor() as cur:
            cur.execute(READ)
            cur.execute(
                "SELECT pg_catalog.array_agg(pg_catalog.quote_ident(attname) ORDER BY attnum) FROM pg_catalog.pg_attribute "
                "WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped",
                (table,),
            )
            (names,) = cur.fetchone()
            cur.execute(f"SELECT {', '.join(f'{n}::text' for n in names)} FROM {table}")
            return {row[0]: dict(zip(names, row)) for row in cur.fetchall()}
    finally:
        conn.close()


def differences(source, sink, table: str) -> list[str]:
    here, there = texts(source, table), texts(sink, table)
    if set(here) != set(there):
        return [f"{table}: rows {sorted(here)} at the source, {sorted(there)} at {sink.site_id}"]
    return [
        f"{sink.site_id}: {table} row {key} column {col}: {value!r} at the source, {there[key][col]!r} there"
        for key, row in here.items()
        for col, value in row.items()
        if there[key][col] != value
    ]


def alike(source, sinks, what: str) -> None:
    """Every sink's sweep tables hold the source's rows, each column's text the same."""
    found: list[str] = []

    def same() -> bool:
        found[:] = [d for sink in sinks for table in TABLES for d in differences(source, sink, table)]
        return not found

    try:
        wait_for(same, 30, what)
    except AssertionError:
        raise AssertionError(f"{what}: {found[:20]}") from None


def changes(table: str, names: list[str], height: int) -> list[str]:
    """Inserts, updates of every value, key changes and deletes of ``table``'s rows, a statement each."""
    cols = ", ".join(names)
    return [
        f"INSERT INTO {table} SELECT id + 100, {cols} FROM {table}",
        f"UPDATE {table} s SET ({cols}) = (SELECT {cols} FROM {table} o WHERE o.id = s.id %% {height} + 1) "
        f"WHERE s.id <= {height}",  # every value moves to another row
        f"UPDATE {table} SET id = id + 1000 WHERE id IN (102, 103)",
        f"DELETE FROM {table} WHERE id IN (1, 101, 1102)",
    ]


def written(source, statements: list[str]) -> None:
    """``statements``, each committed, by an application whose session quotes every identifier: its
    changes reach the sinks as any other's (before, the capture printed its columns' types quoted,
    ``"text"``, and every sink refused each change as of a type it has not, for good)."""
    conn = source.connect()
    try:
        with conn.cursor() as cur:
            cur.execute("SET quote_all_identifiers = on")
            for statement in statements:
                cur.execute(statement, ())  # a format, as source.query takes it (%% is %)
                conn.commit()
    finally:
        conn.close()


def refused_at_open(source) -> None:
    """A table with a column of each type lr cannot carry is refused by ``lr tables open``, naming
    each column and its type (before, PostgreSQL's internal types were let in: their snapshot and
    every change failed at every cycle, for good)."""
    refused = sorted(REFUSED & {t for t, _ in catalog_types(source)})
    source.query(
        "CREATE TABLE public.odd (id int PRIMARY KEY, "
        + ", ".join(f'c_{t} pg_catalog."{t}"' for t in refused)
        + ", fine int2vector)"
    )
    with pytest.raises(TableError) as refusal:
        federate(source, "public.odd")
    for t in refused:
        assert f"c_{t} ({t})" in str(refusal.value), str(refusal.value)
    assert "fine" not in str(refusal.value)


def test_every_type_of_the_catalog_arrives_by_snapshot_stream_and_a_full_sync_or_is_refused_at_open(lr_sites):
    """Two tables: one with a column of every type (its snapshot copied as text: it has types binary
    COPY carries wrong, ``BY_TEXT``), one with the others (copied in binary). Before, the snapshot of
    an empty ``int2vector``, ``oidvector`` or ``tsquery`` failed at every cycle, for good (the sink's
    receive function refuses what the source's send wrote), and a ``reg*`` value arrived as the
    source's oid: another object at the sink (``sweep.thing`` read ``other.t`` there), or a number."""
    source, *sinks = lr_sites
    for site in lr_sites:
        if site is not source:  # more objects first: the sweep's objects get other oids there
            site.query("CREATE SCHEMA other; CREATE TABLE other.t (x int); CREATE TYPE other.k AS (x int)")
        site.query(OBJECTS)
        for setting in SETTINGS[site.site_id].split("; "):
            site.query(f'ALTER DATABASE "{site.dbname}" SET {setting}')
    topo = apply(lr_sites)
    missing = sorted({t for t, _ in catalog_types(source)} - set(VALUES) - REFUSED)
    assert not missing, f"types of this server's catalog the sweep has no values for: {missing}"
    refused_at_open(source)
    every = columns(source)
    height = max(len(v) for v in every.values())
    binary = {c: v for c, v in every.items() if c.split(" ")[0].strip('"_') not in BY_TEXT}
    statements = []
    for table, found in zip(TABLES, (every, binary)):
        source.query(f"CREATE TABLE {table} (id int PRIMARY KEY, {', '.join(found)})")
        for n in range(height):  # row n + 1: each column's value n (NULL past its last)
            values = [v[n] if n < len(v) else "NULL" for v in found.values()]
            source.query(f"INSERT INTO {table} VALUES ({n + 1}, {', '.join(values)})".replace("%", "%%"))
        federate(source, table)  # populated: the snapshot carries its rows
        statements.append(changes(table, [c.split(" ")[0] for c in found], height))
    with Streaming(replicator(topo, lr_sites, lease_seconds=2.0), FAST) as streaming:
        streaming.streaming()
        alike(source, sinks, "the snapshot")
        cycles = len(streaming.cycles)
        written(source, [s for together in zip(*statements) for s in together])
        alike(source, sinks, "the stream")
        assert len(streaming.cycles) == cycles, f"cycles ran: {streaming.cycles[cycles:]}"
        forced_full_sync_of_site_b(source, streaming)
        for statement in statements[0][1:2] + statements[1][1:2]:
            source.query(statement)
        alike(source, sinks, "the full sync, and changes after it")
    assert not [r.error for r in streaming.cycles if r.error]
