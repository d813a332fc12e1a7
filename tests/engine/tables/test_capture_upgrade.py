"""A source upgraded (``lr init``) from V0047 to the latest schema while applications write a
federated table opened there: the capture function is replaced under the writers (V0049: the
composites and the new keys); every change is carried whole, and the table opened before keeps
working (its triggers have three arguments)."""

from __future__ import annotations

import random
import threading

import psycopg2

from tests.engine.site.test_older_schema import install, lr_init
from tests.support.session import apply, replicator
from tests.support.tables import rows, sync


def _open_as_v0047(site) -> None:
    """``lr tables open public.items`` as lr did at V0047: client, table id and column types."""
    site.query(
        "INSERT INTO lr.registry (stream_name, kind, is_federated, client_name, table_id, key_columns, stream_tags) "
        "VALUES ('public.items', 'table', true, 'policy', nextval('lr.table_id_seq'), ARRAY['id'], "
        "ARRAY['lrq_table_policy'])"
    )
    ((tid, types),) = site.query(
        "SELECT table_id, lr.capture_column_types('public.items'::regclass) FROM lr.registry "
        "WHERE stream_name = 'public.items'"
    )
    for op, ref in (
        ("insert", "REFERENCING NEW TABLE AS lr_new"),
        ("update", "REFERENCING OLD TABLE AS lr_old NEW TABLE AS lr_new"),
        ("delete", "REFERENCING OLD TABLE AS lr_old"),
        ("truncate", ""),
    ):
        site.query(
            f"CREATE TRIGGER lr_capture_{op} AFTER {op.upper()} ON public.items {ref} FOR EACH STATEMENT "
            "EXECUTE FUNCTION lr.capture_table_changes(%s, %s, %s)",
            ("policy", str(tid), types),
        )


def _write(site, seed: int, stop: threading.Event, errors: list) -> None:
    rng = random.Random(seed)
    conn = psycopg2.connect(site.dsn)
    try:
        with conn.cursor() as cur:
            while not stop.is_set():
                k = rng.randrange(1, 60)
                op = rng.randrange(4)
                if op == 0:
                    cur.execute(
                        "INSERT INTO public.items VALUES (%s, ROW(%s, 'x')::public.pair, 'i') ON CONFLICT DO NOTHING",
                        (k + seed * 1000, k),
                    )
                elif op == 1:
                    cur.execute("UPDATE public.items SET note = note || 'u' WHERE id %% 7 = %s", (k % 7,))
                elif op == 2:  # a key change
                    cur.execute(
                        "UPDATE public.items SET id = id + 100000 WHERE id = (SELECT min(id) FROM public.items "
                        "WHERE id %% 5 = %s AND id < 100000)",
                        (k % 5,),
                    )
                else:
                    cur.execute("DELETE FROM public.items WHERE id = %s", (k + seed * 1000,))
                conn.commit()
    except Exception as exc:  # reported by the test
        errors.append(exc)
    finally:
        conn.close()


def test_a_table_opened_at_v0047_is_carried_whole_while_its_source_is_upgraded_under_its_writers(sites):
    source, sink = sites[0], sites[1]
    install([source, sink], {"site-a": 47})
    topo = apply([source, sink], [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}])
    for site in (source, sink):
        site.query(
            "CREATE TYPE public.pair AS (a int, b text); CREATE TABLE public.items (id int PRIMARY KEY, p public.pair, note text)"
        )
    source.query("INSERT INTO public.items SELECT g, ROW(g, 'x')::public.pair, 'n' FROM generate_series(1, 50) g")
    _open_as_v0047(source)
    repl = replicator(topo, [source, sink], providers={"policy": lambda ctx: None})
    sync(repl)
    assert rows(sink, "public.items") == rows(source, "public.items")
    stop, errors = threading.Event(), []
    writers = [threading.Thread(target=_write, args=(source, n, stop, errors)) for n in (1, 2, 3)]
    for w in writers:
        w.start()
    try:
        lr_init(source)  # the capture function replaced under the writers
        sync(repl, cycles=3)
    finally:
        stop.set()
        for w in writers:
            w.join(30)
    assert errors == []
    assert source.query("SELECT max(version) FROM lr.schema_migrations") >= [(49,)]
    reports = sync(repl)
    repl.close()
    assert not [r.error for r in reports if r.error], reports
    assert rows(sink, "public.items") == rows(source, "public.items")
    moves = source.query(  # the old keys' entries, with new keys ("to") or without
        "SELECT convert_from(message, 'UTF8')::jsonb ? 'to', count(*) FROM lr.log_entries "
        "WHERE stream = 3 AND convert_from(message, 'UTF8')::jsonb ->> 'op' = 'd' GROUP BY 1 ORDER BY 1"
    )
    assert dict(moves).get(True, 0) > 0, moves  # the upgraded capture's key changes, with their new keys
