"""Helpers for federated-table scenarios: a table at a source, writers that change it in every
way (inserts, updates, key changes, deletes, TRUNCATE), and the rows a site holds."""
from __future__ import annotations

import random
import threading

import psycopg2

from airflow_provider_lr.engine.site import status
from airflow_provider_lr.engine.tables import registry

ACCOUNTS = "CREATE TABLE IF NOT EXISTS public.accounts (id bigint PRIMARY KEY, owner text NOT NULL, " \
           "balance numeric(12, 2) NOT NULL DEFAULT 0, tags text[], note jsonb, updated_at timestamptz)"


def create_accounts(site, rows: int = 0, start: int = 0) -> None:
    site.query(ACCOUNTS)
    if rows:
        site.query(
            "INSERT INTO public.accounts SELECT g, 'owner' || g, g * 1.5, ARRAY['t' || (g %% 3)], "
            "jsonb_build_object('n', g), '2026-01-01'::timestamptz + g * interval '1 second' "
            "FROM generate_series(%s, %s) g", (start + 1, start + rows))


def federate(site, table: str = "public.accounts", client: str = "policy", federated: bool = True):
    conn = site.connect()
    try:
        return registry.open_table(conn, table, client, federated)
    finally:
        conn.close()


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

    def __enter__(self) -> "TableWriter":
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
            cur.execute("INSERT INTO public.accounts (id, owner, balance, tags, note, updated_at) "
                        "VALUES (%s, %s, %s, %s, %s, now()) ON CONFLICT (id) DO UPDATE SET balance = EXCLUDED.balance",
                        (k, f"o{k}", rng.randrange(10_000) / 100, [f"x{k % 5}"], '{"w": 1}'))
        elif op < 0.6:
            cur.execute("UPDATE public.accounts SET balance = balance + 1, note = jsonb_build_object('u', %s) "
                        "WHERE id BETWEEN %s AND %s", (k, k, k + rng.randrange(3)))
        elif op < 0.72:  # a key change (and a collision is refused by the source: fine)
            cur.execute("UPDATE public.accounts SET id = id + %s WHERE id = %s "
                        "AND NOT EXISTS (SELECT 1 FROM public.accounts WHERE id = %s)", (n, k, k + n))
        elif op < 0.9:
            cur.execute("DELETE FROM public.accounts WHERE id = %s", (k,))
        elif op < 0.99 or not self.truncate:
            cur.execute("INSERT INTO public.accounts (id, owner) SELECT g, 'bulk' FROM generate_series(%s, %s) g "
                        "ON CONFLICT DO NOTHING", (k, k + 20))
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
