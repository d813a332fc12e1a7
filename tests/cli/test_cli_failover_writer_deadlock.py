"""A planned switchover beside a writer of the old source that holds its federated table and then
transmits in the same transaction: the writer and the switchover's drain wait for each other."""

from __future__ import annotations

import threading

import psycopg2
import pytest

from airflow_provider_lr import cli
from airflow_provider_lr.client import RoutingQueueClient
from tests.cli.test_cli_sync import topology_file
from tests.support.session import App, sink_queue, wait_for
from tests.support.tables import create_accounts, federate

SYNC = ["--until-idle", "--cycles", "10", "--interval", "0.01"]
WAITING = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"


def test_a_switchover_deadlocked_with_an_old_source_writer_names_the_table_and_changes_nothing(
    lr_sites, tmp_path, monkeypatch, capsys
):
    """site-a's writer updated public.accounts (its transaction open); `lr failover --promote site-b`
    waits for the table to guard it; the writer then transmits, waiting for the switchover in turn.
    PostgreSQL breaks the deadlock by aborting one of them: when it is the switchover, it is refused
    as for a writer holding the table (named, with its pid; nothing done), the writer commits, and a
    second run switches over. Before, the switchover stopped "part-way" on a bare DeadlockDetected,
    told to run it again."""
    site_a, site_b, _ = lr_sites
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    monkeypatch.setenv("LR_HOME", str(tmp_path))
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    create_accounts(site_a, rows=3)
    federate(site_a)
    site_a.query("CREATE TABLE public.zz_notes (id int PRIMARY KEY, note text)")
    site_a.query("INSERT INTO public.zz_notes VALUES (1, 'n')")
    federate(site_a, "public.zz_notes")
    App(site_a).close()
    assert cli.main(["sync", "--topology", topo, *SYNC]) == 0
    writer = psycopg2.connect(site_a.dsn)
    client = RoutingQueueClient(writer, "policy")
    pid = writer.get_backend_pid()
    with writer.cursor() as cur:
        cur.execute("SET deadlock_timeout = '20s'")  # the switchover, waiting first, finds the deadlock
        cur.execute("UPDATE public.zz_notes SET note = 'w' WHERE id = 1")
    capsys.readouterr()
    result: list[int] = []
    switch = threading.Thread(
        target=lambda: result.append(cli.main(["failover", "--topology", topo, "--promote", "site-b"])), daemon=True
    )
    switch.start()
    wait_for(lambda: site_a.query(WAITING)[0][0] > 0, 30, "the switchover to wait for the writer's table")
    outcome = "committed"
    try:
        with writer.cursor() as cur:
            cur.execute("UPDATE public.accounts SET owner = 'w' WHERE id = 1")
        client.transmit_log_entry_message(b"w", ["site-b", "site-c"])
        writer.commit()
    except psycopg2.Error as exc:
        writer.rollback()
        outcome = str(exc).splitlines()[0]
    switch.join(60)
    err = capsys.readouterr().err
    assert result == [1], err
    assert (
        f"table public.zz_notes of client policy is held by open transaction(s) at site-a (pid {pid})" in err
        and "could not be refused (deadlock), nothing was changed on this site" in err
    ), err
    assert outcome == "committed", outcome  # the writer goes on once the switchover gave way
    assert site_b.query("SELECT count(*) FROM lr.failovers") == [(0,)]
    writer.close()

    assert cli.main(["failover", "--topology", topo, "--promote", "site-b", "--out", topo]) == 0
    assert b"w" in sink_queue(site_b, "policy")  # drained into site-b
    with pytest.raises(psycopg2.Error, match="replicated from site site-b since a failover"):
        site_a.query("UPDATE public.zz_notes SET note = 'x' WHERE id = 1")
