"""What drawing a commit position costs a writer's transaction on the server, alone.

``transmit_bench.py`` measures whole transactions from clients (their round trips, the driver, the
fsync of each commit). This takes all of that away to see the commit-position trigger itself: a
procedure loops ``INSERT`` into an application table, ``INSERT`` of a log row, ``COMMIT``, on the
server (no round trip), ``synchronous_commit = off`` (no fsync wait), in ``--writers`` backends at
once, into a copy of ``lr.log_entries`` with, in turn:

* ``none``       no trigger: storing the entry alone (``transmit_bench``'s ``insert_only``);
* ``empty``      a deferred constraint trigger that does nothing: the cost of firing one at commit;
* ``lr``         lr's trigger (``lr.assign_commit_position``: the position drawn, the barrier's
                 shared lock, the ``lr.log_commits`` row, the wake-up key tried);
* ``no_row``     lr's trigger without the ``lr.log_commits`` row (the position drawn, not stored).

Variants alternate within each round (``--rounds``); medians of µs per transaction, wall-clock ×
``min(writers, cores)``: the CPU a transaction takes while every backend is busy.

Run: .venv/bin/python bench/commit_position_cost.py [--transactions 3000] [--writers 1,8] [--rounds 3]
Writes bench/results/commit_position_cost.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psycopg2  # noqa: E402

from airflow_provider_lr.embedded.sites import SiteManager  # noqa: E402
from airflow_provider_lr.engine.db import schema  # noqa: E402

BENCH = Path(__file__).resolve().parent
_LR_BODY = """
    IF current_setting('lr.commit_position_assigned', true) IS DISTINCT FROM 'on' THEN
        PERFORM set_config('lr.commit_position_assigned', 'on', true);
        PERFORM pg_advisory_xact_lock_shared(1819410434);
        {store}
        IF NOT pg_try_advisory_xact_lock_shared(1819410435) THEN PERFORM pg_notify('lr_commit', ''); END IF;
    END IF;"""
_DEFINER = "LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp"
TRIGGERS: dict[str, str | None] = {
    "none": None,
    "empty": "lr.bench_empty",
    "lr": "lr.assign_commit_position",
    "no_row": "lr.bench_no_row",
}
FUNCTIONS = {
    "lr.bench_empty": f"{_DEFINER} AS $$ BEGIN RETURN NULL; END $$",
    "lr.bench_no_row": f"{_DEFINER} AS $$ BEGIN"
    + _LR_BODY.format(store="PERFORM nextval('lr.commit_position_seq'), pg_current_xact_id();")
    + " RETURN NULL; END $$",
}


def measure(dsn: str, trigger: str | None, writers: int, transactions: int) -> float:
    """µs of CPU per transaction (wall × busy backends ÷ transactions) with ``trigger`` on the log copy."""
    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute("DROP TABLE IF EXISTS bench_log; TRUNCATE bench_app")
        cur.execute("CREATE TABLE bench_log (LIKE lr.log_entries INCLUDING DEFAULTS INCLUDING INDEXES)")
        if trigger is not None:
            cur.execute(
                "CREATE CONSTRAINT TRIGGER bench_position AFTER INSERT ON bench_log DEFERRABLE INITIALLY DEFERRED "
                f"FOR EACH ROW EXECUTE FUNCTION {trigger}()"
            )
    conns = [psycopg2.connect(dsn) for _ in range(writers)]
    for conn in conns:
        conn.autocommit = True
        conn.cursor().execute("SET synchronous_commit = off")
        conn.cursor().execute("CALL bench_loop(100)")  # warm (a CALL that commits is a statement of its own)
    threads = [threading.Thread(target=c.cursor().execute, args=(f"CALL bench_loop({transactions})",)) for c in conns]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    for conn in conns:
        conn.close()
    return wall * min(writers, os.cpu_count() or 1) / (writers * transactions) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transactions", type=int, default=3000, help="per writer and variant")
    parser.add_argument("--writers", default="1,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=BENCH / "results" / "commit_position_cost.json")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="commit-position-"))
    manager = SiteManager(home)
    (site,) = manager.up(site_ids=["site-a"])
    try:
        dsn = site.dsn()
        with psycopg2.connect(dsn) as conn:
            schema.init_site(conn, "site-a")
        with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
            cur.execute("CREATE TABLE bench_app (id bigserial PRIMARY KEY, v int)")
            for name, body in FUNCTIONS.items():
                cur.execute(f"CREATE FUNCTION {name}() RETURNS trigger {body}")
            cur.execute(
                "CREATE PROCEDURE bench_loop(n int) LANGUAGE plpgsql AS $$ BEGIN FOR i IN 1..n LOOP "
                "INSERT INTO bench_app (v) VALUES (i); "
                "INSERT INTO bench_log (stream, tag_ids, client_id, message) VALUES (1, '{1,2,3}', 1, '\\x00112233'); "
                "COMMIT; END LOOP; END $$"
            )
        result: dict[str, dict[str, float]] = {}
        for writers in [int(w) for w in args.writers.split(",")]:
            seen: dict[str, list[float]] = {name: [] for name in TRIGGERS}
            for _ in range(args.rounds):
                for name, trigger in TRIGGERS.items():
                    seen[name].append(measure(dsn, trigger, writers, args.transactions))
            result[str(writers)] = {name: round(statistics.median(v), 1) for name, v in seen.items()}
            row = result[str(writers)]
            print(
                f"{writers} writer(s): µs CPU per transaction  "
                + "  ".join(f"{name} {us}" for name, us in row.items())
                + f"   lr's trigger: +{row['lr'] - row['none']:.1f} µs (firing one: +{row['empty'] - row['none']:.1f}, "
                f"the log_commits row: +{row['lr'] - row['no_row']:.1f})",
                flush=True,
            )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "us_per_tx": result}, indent=1)
        )
        print(f"wrote {args.out}")
    finally:
        manager.down(remove=True)


if __name__ == "__main__":
    main()
