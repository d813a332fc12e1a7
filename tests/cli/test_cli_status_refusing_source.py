"""A source that refuses writes while reads go on (here `default_transaction_read_only`, set on the
running server; a standby refuses them the same way): every session of `lr sync` fails at its first
write there (its lease, its ack), and that failure cannot be recorded where `lr status` read it (the
session's `last_error` is a row of that source). Found by chaos17: `lr status` said healthy, exit 0,
for as long as the source refused, while no session of it took a step. It now says the site refuses
writes (degraded, exit 1), and healthy again once the source takes writes and the sessions caught up."""

from __future__ import annotations

import time

import pytest

from airflow_provider_lr import cli
from tests.cli.test_cli_sync_members import lr_sync, stop, streaming, topology_file
from tests.cli.test_cli_sync_pairs import RefusedWriters
from tests.support.session import wait_for


def read_only(site, on: bool) -> None:
    """The whole server refuses writes (``on``) or takes them again, its open sessions included."""
    conn = site.connect()
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(
            "ALTER SYSTEM SET default_transaction_read_only = on"
            if on
            else "ALTER SYSTEM RESET default_transaction_read_only"
        )
        cur.execute("SELECT pg_catalog.pg_reload_conf()")
    conn.close()


def status(topo: str, capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = cli.main(["status", "--topology", topo])
    return code, capsys.readouterr().out


@pytest.mark.slow
def test_lr_status_is_degraded_while_the_source_refuses_writes_and_healthy_once_it_takes_them(
    lr_sites, tmp_path, monkeypatch, capsys
):
    source, *_ = lr_sites
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    proc = lr_sync(topo, tmp_path / "sync.log")
    try:
        wait_for(lambda: streaming(source) == 6, 60, "every session streaming")
        with RefusedWriters(source):
            time.sleep(0.5)
            read_only(source, True)
            time.sleep(0.5)
        wait_for(lambda: "ReadOnlySqlTransaction" in (tmp_path / "sync.log").read_text(), 30, "the sessions failing")
        code, out = status(topo, capsys)
        assert code == 1, out
        assert "site-a: refuses writes: default_transaction_read_only is on" in out, out
        read_only(source, False)
        wait_for(lambda: status(topo, capsys)[0] == 0, 30, "lr status healthy again")
        assert "refuses writes" not in status(topo, capsys)[1]
    finally:
        read_only(source, False)
        stop(proc)
