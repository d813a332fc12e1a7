"""Federated tables carry what the writer wrote, whatever the table: column names like the words of
lr's own SQL never break the writer's statement, a valid source transaction always applies at the
sink (in the source's order), and every built-in type arrives exactly."""
from __future__ import annotations

from tests.support.session import apply, replicator
from tests.support.tables import create_accounts, federate, rows


def _sync(repl, cycles: int = 40) -> list:
    """Cycles until idle; every cycle's reports."""
    seen: list = []
    repl.run(max_cycles=cycles, until_idle=True, interval=0.05, on_cycle=seen.extend)
    return seen


def _errors(reports) -> list[str]:
    return [r.error for r in reports if r.error]


# Columns named like every identifier of the capture trigger (its variables, its aliases, its
# transition tables, the JSON keys it writes) and like SQL words, quoted mixed case and spaces.
HOSTILE_COLUMNS = ["n", "o", "k", "r", "c", "g", "s", "a", "nonkey", "keys", "key", "old", "new", "op", "row", "rows",
                   "data", "lr", "table_id", "client", "tid", "cid", "tags", "gen", "chunk", "gone", "lr_old",
                   "lr_new", "lr_o", "lr_n", "lr_key", "lr_row", "lr_seq", "lr_tags", "lr_keys", "lr_nonkey",
                   "lr_generated", "lr_table_id", "lr_client_id", "lr_gone", "lr_changed", "lr_k", "MixedCase",
                   "with space", "select", "from", "order", "user", "tg_op", "tg_argv", "message", "stream"]


def _hostile_table(site, name: str, key: list[str]) -> None:
    cols = ", ".join(f'"{c}" text' if c not in key else f'"{c}" int NOT NULL' for c in HOSTILE_COLUMNS)
    site.query(f"CREATE TABLE public.{name} ({cols}, PRIMARY KEY ({', '.join(chr(34) + k + chr(34) for k in key)}))")


def test_a_table_whose_columns_are_named_like_the_capture_triggers_words_is_captured_and_applied(lr_sites):
    source, *sinks = lr_sites
    topo = apply(lr_sites)
    _hostile_table(source, "hostile", ["n"])
    _hostile_table(source, "hostile2", ["nonkey", "select"])  # a composite key of hostile names
    source.query("INSERT INTO public.hostile (n, nonkey, \"with space\") SELECT g, 'v' || g, 's' FROM generate_series(1, 5) g")
    federate(source, "public.hostile")
    federate(source, "public.hostile2")
    repl = replicator(topo, lr_sites)
    _sync(repl)
    # every kind of statement, in the writer's transaction: none may fail
    source.query("INSERT INTO public.hostile (n, nonkey, op, \"MixedCase\", tags) "
                 "SELECT g, 'new' || g, 'u', 'M', '{1}' FROM generate_series(6, 1200) g")  # several entries
    source.query("UPDATE public.hostile SET nonkey = 'changed', \"row\" = 'r', data = 'd' WHERE n <= 600")
    source.query("UPDATE public.hostile SET n = n + 5000 WHERE n BETWEEN 10 AND 20")  # key changes
    source.query("DELETE FROM public.hostile WHERE n BETWEEN 30 AND 40")
    source.query("INSERT INTO public.hostile2 (nonkey, \"select\", n, k) SELECT g, g %% 3, 'x', 'y' "
                 "FROM generate_series(1, 30) g")
    source.query("UPDATE public.hostile2 SET \"select\" = \"select\" + 10 WHERE nonkey < 10")  # key changes
    source.query("UPDATE public.hostile2 SET lr = 'l', \"from\" = 'f' WHERE nonkey >= 10")
    source.query("DELETE FROM public.hostile2 WHERE nonkey = 29")
    assert _errors(_sync(repl)) == []
    for sink in sinks:
        assert rows(sink, "public.hostile") == rows(source, "public.hostile")
        assert rows(sink, "public.hostile2") == rows(source, "public.hostile2")
    assert len(rows(source, "public.hostile")) == 1200 - 11


def _both(sites, ddl: str) -> None:
    for site in sites:
        site.query(ddl)


def _in_one_transaction(site, *statements: str) -> None:
    conn = site.connect()
    try:
        with conn.cursor() as cur:
            for statement in statements:
                cur.execute(statement)
        conn.commit()
    finally:
        conn.close()


def test_transactions_valid_at_the_source_apply_at_a_sink_with_the_same_constraints(lr_sites):
    source, *sinks = lr_sites
    topo = apply(lr_sites)
    _both(lr_sites, "CREATE TABLE public.people (id int PRIMARY KEY, email text NOT NULL UNIQUE, "
                    "badge int UNIQUE DEFERRABLE INITIALLY IMMEDIATE, name text)")
    source.query("INSERT INTO public.people SELECT g, 'e' || g, g, 'p' || g FROM generate_series(1, 9) g")
    federate(source, "public.people")
    repl = replicator(topo, lr_sites)
    _sync(repl)
    scenarios = {
        "swap through a temporary value": [
            "UPDATE public.people SET email = 'tmp' WHERE id = 1",
            "UPDATE public.people SET email = 'e1' WHERE id = 2",
            "UPDATE public.people SET email = 'e2' WHERE id = 1"],
        "a chain a->b, b->c, c->a": [
            "UPDATE public.people SET email = 'tmp' WHERE id = 3",
            "UPDATE public.people SET email = 'e3' WHERE id = 5",
            "UPDATE public.people SET email = 'e5' WHERE id = 4",
            "UPDATE public.people SET email = 'e4' WHERE id = 3"],
        "a value deleted under one key and inserted under another": [
            "DELETE FROM public.people WHERE id = 6",
            "INSERT INTO public.people VALUES (60, 'e6', 6, 'moved')"],
        "primary keys change, unique values stay with their rows": [
            "UPDATE public.people SET id = id + 100"],
        "a deferrable constraint swapped in two statements, checked at commit": [
            "SET CONSTRAINTS ALL DEFERRED",
            "UPDATE public.people SET badge = 8 WHERE id = 107",
            "UPDATE public.people SET badge = 7 WHERE id = 108"],
        "and back again, each in its own transaction": [],
    }
    for what, statements in scenarios.items():
        if statements:
            _in_one_transaction(source, *statements)
        assert _errors(_sync(repl)) == [], what
        for sink in sinks:
            assert rows(sink, "public.people") == rows(source, "public.people"), what
    # the same history again from the start, all of it in one batch (one sink transaction)
    _in_one_transaction(source, "DELETE FROM public.people",
                        "INSERT INTO public.people SELECT g, 'e' || g, g, 'p' || g FROM generate_series(1, 9) g")
    for statements in scenarios.values():
        if statements:
            _in_one_transaction(source, *statements)
    assert _errors(_sync(repl)) == []
    for sink in sinks:
        assert rows(sink, "public.people") == rows(source, "public.people")


def test_changes_of_two_tables_apply_in_the_source_order_across_tables(lr_sites):
    source, *sinks = lr_sites
    topo = apply(lr_sites)
    _both(lr_sites, "CREATE TABLE public.parents (id int PRIMARY KEY, name text)")
    _both(lr_sites, "CREATE TABLE public.children (id int PRIMARY KEY, parent int NOT NULL REFERENCES public.parents)")
    federate(source, "public.parents")
    federate(source, "public.children")
    repl = replicator(topo, lr_sites)
    _sync(repl)
    _in_one_transaction(source, "INSERT INTO public.parents VALUES (1, 'a'), (2, 'b')",
                        "INSERT INTO public.children VALUES (10, 1), (20, 2)")
    _sync(repl)
    _in_one_transaction(source, "DELETE FROM public.children WHERE parent = 1", "DELETE FROM public.parents WHERE id = 1",
                        "INSERT INTO public.parents VALUES (3, 'c')", "UPDATE public.children SET parent = 3")
    assert _errors(_sync(repl)) == []
    for sink in sinks:
        assert rows(sink, "public.parents") == rows(source, "public.parents")
        assert rows(sink, "public.children") == rows(source, "public.children")


def _status(site) -> str:
    from airflow_provider_lr.engine.site import status

    conn = site.connect()
    try:
        return status.render(status.site_status(conn))
    finally:
        conn.close()


def test_a_batch_the_sink_refuses_shows_in_status_and_applies_by_itself_once_the_sink_is_fixed(lr_sites):
    source, sink, other = lr_sites
    topo = apply(lr_sites)
    create_accounts(source, rows=20)
    federate(source)
    repl = replicator(topo, lr_sites)
    _sync(repl)
    sink.query("ALTER TABLE public.accounts ADD CONSTRAINT small CHECK (balance < 1000)")  # the source has none
    source.query("UPDATE public.accounts SET balance = 5000, owner = 'rich' WHERE id = 3")
    source.query("INSERT INTO public.accounts (id, owner) VALUES (100, 'after')")
    errors = _errors(_sync(repl, cycles=3))
    assert errors and all("site-a->site-b/policy" in e for e in errors)
    assert any('the sink refused table public.accounts: new row for relation "accounts" violates check '
               'constraint "small"' in e for e in errors)
    shown = [line for line in _status(source).splitlines() if "the sink refused" in line]
    assert len(shown) == 1 and "fix it there" in shown[0]  # one line, naming the fix
    assert sink.query("SELECT owner FROM public.accounts WHERE id IN (3, 100) ORDER BY id") == [("owner3",)]
    assert rows(other) == rows(source)  # the other sink is not held back
    sink.query("ALTER TABLE public.accounts DROP CONSTRAINT small")
    assert _errors(_sync(repl)) == []
    assert rows(sink) == rows(source)
    assert "the sink refused" not in _status(source)
