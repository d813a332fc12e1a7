"""Helpers for federated-table scenarios: a table at a source, writers that change it in every
way (inserts, updates, key changes, deletes, TRUNCATE), and the rows a site holds."""

from __future__ import annotations

import random
import threading

import psycopg2

from airflow_provider_lr.engine.site import status
from airflow_provider_lr.engine.tables import registry
from tests.support.session import apply

ACCOUNTS = (
    "CREATE TABLE IF NOT EXISTS public.accounts (id bigint PRIMARY KEY, owner text NOT NULL, "
    "balance numeric(12, 2) NOT NULL DEFAULT 0, tags text[], note jsonb, updated_at timestamptz)"
)


def create_accounts(site, rows: int = 0, start: int = 0) -> None:
    site.query(ACCOUNTS)
    if rows:
        site.query(
            "INSERT INTO public.accounts SELECT g, 'owner' || g, g * 1.5, ARRAY['t' || (g %% 3)], "
            "jsonb_build_object('n', g), '2026-01-01'::timestamptz + g * interval '1 second' "
            "FROM generate_series(%s, %s) g",
            (start + 1, start + rows),
        )


def federate(site, table: str = "public.accounts", client: str = "policy", federated: bool = True):
    conn = site.connect()
    try:
        return registry.open_table(conn, table, client, federated)
    finally:
        conn.close()


def two_sources_into_one_sink(sites):
    """Client policy replicated from the first two of ``sites`` into the third: its topology."""
    a, b, sink = sites
    return apply(
        sites,
        replication=[
            {"source": a.site_id, "sinks": [sink.site_id], "clients": ["policy"]},
            {"source": b.site_id, "sinks": [sink.site_id], "clients": ["policy"]},
        ],
    )


def site_status(site) -> status.SiteStatus:
    """What ``lr status`` reads on one site (its tables, and those that diverged)."""
    conn = site.connect()
    try:
        return status.site_status(conn)
    finally:
        conn.close()


def sync(repl, cycles: int = 40) -> list:
    """Replicator cycles until idle; every cycle's reports."""
    seen: list = []
    repl.run(max_cycles=cycles, until_idle=True, interval=0.05, on_cycle=seen.extend)
    return seen


def status_text(site) -> str:
    """What ``lr status`` prints for ``site``."""
    return status.render(site_status(site))


def swap_unique(cur, table: str, a: int, b: int, note: str) -> None:
    """Swap ``u`` (UNIQUE) between rows ``a`` and ``b`` of ``table`` in three statements, the
    constraint holding after each (a sink that applies them in another order refuses them); both
    rows get ``n + 1``, and ``b`` the ``nonkey`` note. Rows locked in key order: writers never deadlock."""
    cur.execute(f"SELECT id, u FROM {table} WHERE id IN (%s, %s) ORDER BY id FOR UPDATE", (a, b))
    u = dict(cur.fetchall())
    cur.execute(f"UPDATE {table} SET u = -u WHERE id = %s", (a,))
    cur.execute(f"UPDATE {table} SET u = %s, n = n + 1, nonkey = %s WHERE id = %s", (u[a], note, b))
    cur.execute(f"UPDATE {table} SET u = %s, n = n + 1 WHERE id = %s", (u[b], a))


def rows(site, table: str = "public.accounts") -> list[tuple]:
    """Every row, by key, as text (so types compare exactly across sites)."""
    return site.query(f"SELECT t::text FROM {table} t ORDER BY 1")


def rows_by_key(site, table: str = "public.accounts") -> dict:
    return dict(site.query(f"SELECT id, t::text FROM {table} t"))


class TableWriter:
    """Changes ``public.accounts`` in small transactions of every kind until stopped (``truncate``:
    also TRUNCATE now and then); some transactions also touch several rows at once."""

    def __init__(self, site, seed: int = 7, key_space: int = 400, truncate: bool = True) -> None:
        self.site, self.rng, self.key_space, self.truncate = site, random.Random(seed), key_space, truncate
        self.stop = threading.Event()
        self.transactions = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> TableWriter:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)
        if self.error is not None:
            raise self.error

    def step(self, cur) -> None:
        rng, n = self.rng, self.key_space
        op = rng.random()
        k = rng.randrange(1, n)
        if op < 0.35:
            cur.execute(
                "INSERT INTO public.accounts (id, owner, balance, tags, note, updated_at) "
                "VALUES (%s, %s, %s, %s, %s, now()) ON CONFLICT (id) DO UPDATE SET balance = EXCLUDED.balance",
                (k, f"o{k}", rng.randrange(10_000) / 100, [f"x{k % 5}"], '{"w": 1}'),
            )
        elif op < 0.6:
            cur.execute(
                "UPDATE public.accounts SET balance = balance + 1, note = jsonb_build_object('u', %s) "
                "WHERE id BETWEEN %s AND %s",
                (k, k, k + rng.randrange(3)),
            )
        elif op < 0.72:  # a key change (and a collision is refused by the source: fine)
            cur.execute(
                "UPDATE public.accounts SET id = id + %s WHERE id = %s "
                "AND NOT EXISTS (SELECT 1 FROM public.accounts WHERE id = %s)",
                (n, k, k + n),
            )
        elif op < 0.9:
            cur.execute("DELETE FROM public.accounts WHERE id = %s", (k,))
        elif op < 0.99 or not self.truncate:
            cur.execute(
                "INSERT INTO public.accounts (id, owner) SELECT g, 'bulk' FROM generate_series(%s, %s) g "
                "ON CONFLICT DO NOTHING",
                (k, k + 20),
            )
        else:
            cur.execute("TRUNCATE public.accounts")

    def _run(self) -> None:
        conn = psycopg2.connect(self.site.dsn)
        try:
            while not self.stop.is_set():
                with conn.cursor() as cur:
                    for _ in range(self.rng.randrange(1, 4)):
                        self.step(cur)
                conn.commit()
                self.transactions += 1
        except BaseException as exc:  # noqa: BLE001 - raised in the test's thread
            self.error = exc
        finally:
            conn.close()


def cycle_errors(reports) -> list[str]:
    """The errors of cycle reports."""
    return [r.error for r in reports if r.error]


# --- tables whose columns are named like lr's own words ----------------------------------------
# Columns named like every identifier of the capture trigger (its variables, its aliases, its
# transition tables, the JSON keys it writes) and like SQL words, quoted mixed case and spaces.
HOSTILE_COLUMNS = [
    "n",
    "o",
    "k",
    "r",
    "c",
    "g",
    "s",
    "a",
    "nonkey",
    "keys",
    "key",
    "old",
    "new",
    "op",
    "row",
    "rows",
    "data",
    "lr",
    "table_id",
    "client",
    "tid",
    "cid",
    "tags",
    "gen",
    "chunk",
    "gone",
    "lr_old",
    "lr_new",
    "lr_o",
    "lr_n",
    "lr_key",
    "lr_row",
    "lr_seq",
    "lr_tags",
    "lr_keys",
    "lr_nonkey",
    "lr_generated",
    "lr_table_id",
    "lr_client_id",
    "lr_gone",
    "lr_changed",
    "lr_k",
    "lr_types",
    "lr_shape",
    "lr_floats",
    "lr_columns",
    "lr_deferred",
    "lr_held",
    "types",
    "composites",
    "entry",
    "payload",
    "MixedCase",
    "with space",
    "select",
    "from",
    "order",
    "user",
    "tg_op",
    "tg_argv",
    "message",
    "stream",
    "50%",  # the apply's statement is a format for mogrify: a % in a name is not a parameter's start
    "%(docs)s",
    "%s",
    # the apply's and the snapshot's aliases and columns (tables/sink, upsert, targets, clearing,
    # stream_batch), and names only a quoted identifier spells
    "position",
    "v",
    "t",
    "x",
    "d",
    "p",
    "i",
    "doc",
    "lo",
    "hi",
    "ord",
    "lr_0",
    "lr_1",
    "_lr_stage",
    "excluded",
    "source_site_id",
    "table_name",
    "split_upto",
    'a"b',
    "it's",
    "back\\slash",
    "dot.ted",
    "pay$load",
    "Ünï Cødé ✓",
    "l" * 63,  # the longest name PostgreSQL keeps
    "✓" * 21,  # 63 bytes
]


HOSTILE_TYPES = {"data": "jsonb", "tags": "int[]", "lr_row": "int[]", "lr_image": "json", "row": "text[]"}


def quoted(name: str) -> str:
    """``name`` as an SQL identifier."""
    return '"' + name.replace('"', '""') + '"'


def hostile_table(site, name: str, key: list[str]) -> None:
    """Text columns, some (also named like lr's words) of types that travel as their text form."""
    cols = ", ".join(
        f"{quoted(c)} int NOT NULL" if c in key else f"{quoted(c)} {HOSTILE_TYPES.get(c, 'text')}"
        for c in HOSTILE_COLUMNS + ["lr_image", "lr_text", "lr_extra", "lr_col", "q"]
    )
    keys = ", ".join(map(quoted, key))
    site.query(f"CREATE TABLE public.{name} ({cols}, PRIMARY KEY ({keys}))".replace("%", "%%"))


# --- constraints the sink shares with the source -----------------------------------------------
def on_every_site(sites, ddl: str) -> None:
    """``ddl`` run on each of ``sites`` (a table the sinks have with the source's constraints)."""
    for site in sites:
        site.query(ddl)


def in_one_transaction(site, *statements: str) -> None:
    """``statements`` in one transaction of ``site``."""
    conn = site.connect()
    try:
        with conn.cursor() as cur:
            for statement in statements:
                cur.execute(statement)
        conn.commit()
    finally:
        conn.close()


PEOPLE = (
    "CREATE TABLE public.people (id int PRIMARY KEY, email text NOT NULL UNIQUE, "
    "badge int UNIQUE DEFERRABLE INITIALLY IMMEDIATE, name text)"
)
PEOPLE_ROWS = "INSERT INTO public.people SELECT g, 'e' || g, g, 'p' || g FROM generate_series(1, 9) g"
# Histories valid at the source that a sink with the same constraints accepts only applied in the
# source's order (each a transaction of ``public.people``, from ``PEOPLE_ROWS``, one after the other).
CONSTRAINT_SCENARIOS: dict[str, list[str]] = {
    "swap through a temporary value": [
        "UPDATE public.people SET email = 'tmp' WHERE id = 1",
        "UPDATE public.people SET email = 'e1' WHERE id = 2",
        "UPDATE public.people SET email = 'e2' WHERE id = 1",
    ],
    "a chain a->b, b->c, c->a": [
        "UPDATE public.people SET email = 'tmp' WHERE id = 3",
        "UPDATE public.people SET email = 'e3' WHERE id = 5",
        "UPDATE public.people SET email = 'e5' WHERE id = 4",
        "UPDATE public.people SET email = 'e4' WHERE id = 3",
    ],
    "a value deleted under one key and inserted under another": [
        "DELETE FROM public.people WHERE id = 6",
        "INSERT INTO public.people VALUES (60, 'e6', 6, 'moved')",
    ],
    "primary keys change, unique values stay with their rows": ["UPDATE public.people SET id = id + 100"],
    "a deferrable constraint swapped in two statements, checked at commit": [
        "SET CONSTRAINTS ALL DEFERRED",
        "UPDATE public.people SET badge = 8 WHERE id = 107",
        "UPDATE public.people SET badge = 7 WHERE id = 108",
    ],
    "and back again, each in its own transaction": [],
}


# --- every built-in type PostgreSQL's logical replication carries, with its odd values ---------
TYPES = [
    ("b", "boolean", "true", "false"),
    ('"char"', '"char"', "'x'", "'\\377'"),
    ("i2", "smallint", "-32768", "32767"),
    ("i4", "integer", "-2147483648", "2147483647"),
    ("i8", "bigint", "-9223372036854775808", "9223372036854775807"),
    ("f4", "real", "'NaN'", "'-Infinity'"),
    ("f8", "double precision", "'Infinity'", "1.0000000000000002e-300"),
    ("f8b", "double precision", "0.1", "-1.7976931348623157e308"),
    ("num", "numeric", "'NaN'", "'-Infinity'"),
    ("num2", "numeric", "'Infinity'", "-123456789012345678901234567890.123456789012345678900"),
    ("nums", "numeric(12, 4)", "1.5", "-0.0001"),
    ("mon", "money", "12.34", "-92233720368547758.08"),
    ("t", "text", "E'tab\\there\\nnewline \\\\ back ''quote'' \"dq\"'", "'ünïcødé ✓ 😀 עברית e\u0301 \u200b'"),
    ("vc", "varchar(10)", "'  padded  '", "''"),
    ("ch", "char(5)", "'ab'", "'abcde'"),
    ("nm", "name", "'a name'", "repeat('n', 63)"),
    (
        "by",
        "bytea",
        "(SELECT string_agg(set_byte('\\x00'::bytea, 0, g), ''::bytea) FROM generate_series(0, 255) g)",
        "''::bytea",
    ),
    ("uu", "uuid", "'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'", "'00000000-0000-0000-0000-000000000000'"),
    ("d", "date", "'infinity'", "'-infinity'"),
    ("d2", "date", "'4713-01-01 BC'", "'5874897-12-31'"),
    ("ts", "timestamp", "'-infinity'", "'294276-12-31 23:59:59.999999'"),
    ("tz", "timestamptz", "'infinity'", "'1999-12-31 23:59:59.123456+05:30'"),
    ("tz2", "timestamptz", "'2000-01-01 00:00:00 BC'", "'2026-03-29 01:30:00 Europe/Berlin'"),
    ("tm", "time", "'24:00:00'", "'00:00:00.000001'"),
    ("ttz", "timetz", "'23:59:59.999999-15:59'", "'12:00+14'"),
    ("iv", "interval", "'-178000000 years'", "'1 mon -2 days 03:04:05.678901'"),
    ("iv2", "interval", "'infinity'", "'-1 days +02:03:00'"),
    ("js", "json", '\'{"b": 1,  "a": [1, 2.50, null], "b": 2}\'', "'\"just a string\"'"),
    ("jb", "jsonb", '\'{"n": 1.50, "deep": {"x": [true, null]}}\'', "'null'"),
    ("bt", "bit(8)", "B'10101010'", "B'00000000'"),
    ("vb", "varbit", "B'1'", "B''"),
    ("tsv", "tsvector", "'a fat:1A cat:2B,3 sat'", "''"),
    ("tsq", "tsquery", "'fat & (rat | cat) <-> !sat'", "'x:*'"),
    ("pt", "point", "'(1.5,-2.25)'", "'(NaN,Infinity)'"),
    ("ln", "line", "'{1,-1,0}'", "'{0,1,2.5}'"),
    ("ls", "lseg", "'[(0,0),(1,1)]'", "'[(-1e300,2),(3,4)]'"),
    ("bx", "box", "'(1,1),(0,0)'", "'(2,3),(2,3)'"),
    ("pa", "path", "'[(0,0),(1,1),(2,0)]'", "'((0,0),(1,1))'"),
    ("pg", "polygon", "'((0,0),(1,1),(1,0))'", "'((0,0))'"),
    ("ci", "circle", "'<(0,0),1.5>'", "'<(1e-300,2),0>'"),
    ("ip", "inet", "'192.168.0.1/24'", "'::ffff:1.2.3.4/128'"),
    ("cd", "cidr", "'10.0.0.0/8'", "'2001:db8::/32'"),
    ("mac", "macaddr", "'08:00:2b:01:02:03'", "'ff:ff:ff:ff:ff:ff'"),
    ("mac8", "macaddr8", "'08:00:2b:01:02:03:04:05'", "'00:00:00:ff:fe:00:00:00'"),
    ("lsn", "pg_lsn", "'16/B374D848'", "'FFFFFFFF/FFFFFFFF'"),
    ("o", "oid", "4294967295", "0"),
    ("i4r", "int4range", "'[1,10)'", "'empty'"),
    ("nr", "numrange", "'(,1.50]'", "'[-Infinity,Infinity)'"),
    ("tsr", "tsrange", "'[2026-01-01,infinity)'", "'(-infinity,2026-01-01 12:00]'"),
    ("tzr", "tstzrange", "'[2026-01-01 00:00+02,2026-01-02 00:00+02)'", "'(,)'"),
    ("dr", "daterange", "'[2026-01-31,2026-02-28]'", "'empty'"),
    ("mr", "int8multirange", "'{[1,3), [5,8)}'", "'{}'"),
    ("dmr", "datemultirange", "'{[2026-02-01,2026-03-01)}'", "'{(,2026-01-01)}'"),
    ("ai", "integer[]", "'{1,NULL,3}'", "'{}'"),
    ("a2", "integer[]", "'{{1,2},{3,4}}'", "'[0:1]={5,6}'"),
    ("at", "text[]", "ARRAY['a,b', 'c\"d', NULL, '', 'NULL', 'ü']", "'{}'"),
    ("atz", "timestamptz[]", "ARRAY['infinity', '2026-01-01 00:00:00.5+00']::timestamptz[]", "'{}'"),
    ("an", "numeric[]", "ARRAY['NaN', '1.10', '-Infinity']::numeric[]", "'{NULL}'"),
    ("ab", "bytea[]", "ARRAY['\\x00ff'::bytea, '']", "'{}'"),
    ("ajb", "jsonb[]", "ARRAY['{\"a\": 1}'::jsonb, 'null']", "'{}'"),
    ("e", "public.mood", "'happy'", "'sad'"),
    ("ae", "public.mood[]", "'{ok,NULL,happy}'", "'{}'"),
    ("cp", "public.pair", "ROW(1, 'x,\"y\"', 'ok')::public.pair", "ROW(NULL, NULL, NULL)::public.pair"),
    ("acp", "public.pair[]", "ARRAY[ROW(2, 'z', 'sad')::public.pair, NULL]", "'{}'"),
    ("dm", "public.positive", "1", "2147483647"),
    ("adm", "public.positive[]", "'{1,2}'", "'{}'"),
    ("big", "text", "repeat('large text ✓ ', 80000)", "repeat('y', 3000)"),  # TOASTed
    ("bigb", "bytea", "decode(repeat('00ff10', 350000), 'hex')", "decode(repeat('ab', 2500), 'hex')"),
]
TYPES_DDL = [
    "CREATE TYPE public.mood AS ENUM ('sad', 'ok', 'happy')",
    "CREATE TYPE public.pair AS (a int, b text, m public.mood)",
    "CREATE DOMAIN public.positive AS integer CHECK (VALUE > 0)",
]


def every_type_table(site, name: str) -> None:
    """A table with a column of every built-in type (``TYPES``; ``TYPES_DDL`` first on every site)."""
    site.query(
        f"CREATE TABLE public.{name} (id int PRIMARY KEY, "
        + ", ".join(f"{col} {kind}" for col, kind, _, _ in TYPES)
        + ")"
    )


def insert_every_type(site, name: str, first: int) -> None:
    """Rows ``first`` (all NULL), ``first + 1`` and ``first + 2`` (each column's two odd values)."""
    cols = ", ".join(col for col, _, _, _ in TYPES)
    site.query(f"INSERT INTO public.{name} (id) VALUES ({first})")
    for n, which in ((first + 1, 2), (first + 2, 3)):
        values = ", ".join(f"({t[which]})::{t[1]}" for t in TYPES)
        site.query(f"INSERT INTO public.{name} (id, {cols}) VALUES ({n}, {values})".replace("%", "%%"))


def type_differences(source, sink, name: str) -> list[str]:
    """Every (row, column) whose value differs: the sink's value read back on the source and
    compared with IS NOT DISTINCT FROM (types without equality, and every type besides, by text)."""
    differ = []
    for col, kind, _, _ in TYPES:
        here = dict(source.query(f"SELECT id, {col}::text FROM public.{name}"))
        there = dict(sink.query(f"SELECT id, {col}::text FROM public.{name}"))
        if here != there:
            differ += [
                f"{col} of row {k}: {str(here.get(k))[:80]!r} != {str(there.get(k))[:80]!r}"
                for k in set(here) | set(there)
                if here.get(k) != there.get(k)
            ]
            continue
        equality = source.query(
            "SELECT oprcode IS NOT NULL FROM (SELECT %s::regtype AS t) x LEFT JOIN pg_operator o "
            "ON o.oprname = '=' AND o.oprleft = x.t AND o.oprright = x.t",
            (kind,),
        )
        if equality and equality[0][0]:
            (bad,) = source.query(
                f"SELECT count(*) FROM public.{name} s JOIN unnest(%s::int[], %s::text[]) v(id, val) USING (id) "
                f"WHERE NOT (s.{col} IS NOT DISTINCT FROM v.val::{kind})",
                (list(there), list(there.values())),
            )[0]
            if bad:
                differ.append(f"{col}: {bad} rows differ")
    return differ
