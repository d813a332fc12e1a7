"""lr sites up/down/list: real PostgreSQL servers, one data directory each, written as Airflow connections."""
from __future__ import annotations

import json
from pathlib import Path

import psycopg2
import pytest

from airflow_provider_lr import cli
from airflow_provider_lr.embedded.sites import SiteManager
from airflow_provider_lr.engine.site import conninfo
from tests.conftest import FAST_SETTINGS


@pytest.fixture
def manager(tmp_path):
    m = SiteManager(tmp_path / "home", settings=FAST_SETTINGS)
    yield m
    m.down(mode="immediate", remove=True)


def test_sites_up_starts_separate_servers_and_writes_connections(manager):
    sites = manager.up(count=2)
    assert [s.site_id for s in sites] == ["site-a", "site-b"]
    assert len({s.port for s in sites}) == 2 and len({s.pgdata for s in sites}) == 2
    pids = set()
    for site in sites:
        conn = psycopg2.connect(site.dsn())
        with conn.cursor() as cur:
            cur.execute("SELECT current_setting('data_directory'), pg_backend_pid(), current_setting('wal_level')")
            data_dir, _, wal_level = cur.fetchone()
        conn.close()
        assert data_dir == site.pgdata and wal_level == "logical"
        pids.add(manager.postmaster_pid(site))
    assert len(pids) == 2

    conns = json.loads((manager.home / "connections.json").read_text())
    assert conns["lr_site_a"]["extra"] == {"site_id": "site-a", "region": "region-1"}
    assert conns["lr_site_b"]["port"] == sites[1].port
    env = (manager.home / "airflow.env").read_text()
    assert "AIRFLOW_CONN_LR_SITE_A=" in env
    # What was written resolves back to the same server, by connection id and by site id.
    loaded = conninfo.load_connections_file(manager.home / "connections.json")
    assert loaded["lr_site_b"].site_id == "site-b"
    assert loaded["lr_site_b"].dsn == sites[1].dsn()


def test_data_survives_down_and_up_and_down_really_stops(manager):
    (site,) = manager.up(site_ids=["east"])
    conn = psycopg2.connect(site.dsn())
    with conn.cursor() as cur:
        cur.execute("CREATE TABLE kept (x int); INSERT INTO kept VALUES (42)")
    conn.commit()
    conn.close()

    manager.down()
    assert not manager.is_running(site)
    with pytest.raises(psycopg2.OperationalError):
        psycopg2.connect(site.dsn(), connect_timeout=2)

    (again,) = manager.up()
    conn = psycopg2.connect(again.dsn())
    with conn.cursor() as cur:
        cur.execute("SELECT x FROM kept")
        assert cur.fetchall() == [(42,)]
    conn.close()


def test_down_remove_deletes_data(manager):
    sites = manager.up(count=1)
    manager.down(remove=True)
    assert manager.sites() == []
    assert not Path(sites[0].pgdata).exists()


def test_cli_sites_lifecycle_and_init(manager, capsys):
    home = str(manager.home)
    assert cli.main(["--home", home, "sites", "up", "--count", "2"]) == 0
    out = capsys.readouterr().out
    assert "site-a" in out and "lr_site_b" in out and "connections.json" in out

    assert cli.main(["--home", home, "init"]) == 0
    out = capsys.readouterr().out
    assert "site-a: lr schema upgraded 0 → " in out and "site-b: lr schema upgraded 0 → " in out
    assert cli.main(["--home", home, "init"]) == 0
    assert "up to date" in capsys.readouterr().out

    assert cli.main(["--home", home, "sites", "list"]) == 0
    assert capsys.readouterr().out.count("running") == 2
    assert cli.main(["--home", home, "sites", "down"]) == 0
    assert capsys.readouterr().out.strip() == "stopped: site-a, site-b"
    assert cli.main(["--home", home, "sites", "list"]) == 0
    assert capsys.readouterr().out.count("stopped") == 2


def test_cli_reports_unreachable_site_clearly(capsys, tmp_path):
    rc = cli.main(["--home", str(tmp_path), "init", "--site", "host=127.0.0.1 port=1 user=postgres", "--site-id", "x"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "cannot connect to site" in err and "port=1" in err
