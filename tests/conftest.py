"""Shared fixtures: real embedded PostgreSQL sites, started once per test session.

Three servers (``site-a``, ``site-b``, ``site-c``: separate data directories and ports) run for the
whole session; every test that asks for ``sites`` gets a fresh database on each server, dropped
afterwards, so tests are isolated without paying a server start each (nor, mostly, the copy: the next
test's databases are made in the background while the current test runs). A test that asks for
``lr_sites`` (directly or through another fixture) gets a copy of a template database migrated
once per session, so it does not pay the migrations either.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

# Airflow reads its configuration at import: point it at a throwaway home before any test imports it.
os.environ.setdefault("AIRFLOW_HOME", tempfile.mkdtemp(prefix="lr-airflow-home-"))
os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
os.environ.setdefault("AIRFLOW__CORE__UNIT_TEST_MODE", "True")
# Every Spark driver a test starts (the local sessions, spark-submit from a test or an Airflow task)
# compiles with C1 only: short-lived JVMs start on much less CPU (tests/support/spark_env.py QUICK_JIT).
os.environ.setdefault("SPARK_SUBMIT_OPTS", "-XX:TieredStopAtLevel=1")

import psycopg2  # noqa: E402
import pytest  # noqa: E402

from airflow_provider_lr.embedded.sites import EmbeddedSite, SiteManager  # noqa: E402
from airflow_provider_lr.engine.db import schema
from airflow_provider_lr.engine.db.conninfo import ConnInfo  # noqa: E402
from tests.support.airflow_env import airflow_db, dagbag  # noqa: E402, F401 (fixtures)

T = TypeVar("T")

SITE_COUNT = 3
LR_TEMPLATE = "lrtest_template"  # on each server: the lr schema migrated, no site id
# Tests trade durability for speed; the bench runs with PostgreSQL's defaults.
FAST_SETTINGS = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}
_db_counter = itertools.count(1)


@dataclass
class TestSite:
    """One site as a test sees it: a server plus the test's own database on it."""

    __test__ = False  # not a test class
    server: EmbeddedSite
    dbname: str

    @property
    def site_id(self) -> str:
        return self.server.site_id

    @property
    def region(self) -> str:
        return self.server.region

    @property
    def conninfo(self) -> ConnInfo:
        return self.server.conninfo(self.dbname)

    @property
    def dsn(self) -> str:
        return self.conninfo.dsn

    def connect(self) -> psycopg2.extensions.connection:
        return psycopg2.connect(self.dsn)

    def query(self, sql: str, params: tuple = ()) -> list[tuple]:
        conn = self.connect()
        try:
            with conn.cursor() as cur:
                cur.execute(sql, params)
                rows = cur.fetchall() if cur.description else []
            conn.commit()
            return rows
        finally:
            conn.close()


@pytest.fixture(scope="session")
def site_manager(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SiteManager]:
    manager = SiteManager(tmp_path_factory.mktemp("lr-home"), settings=FAST_SETTINGS)
    manager.up(count=SITE_COUNT)
    yield manager
    manager.down(mode="immediate", remove=True)


def _admin(server: EmbeddedSite) -> psycopg2.extensions.connection:
    conn = psycopg2.connect(server.dsn())
    conn.autocommit = True
    return conn


@pytest.fixture(scope="session")
def lr_template(site_manager: SiteManager) -> str:
    """On each server, a database with the lr schema migrated (no site identity yet), once per
    session: a test's lr databases are copies of it (``CREATE DATABASE ... TEMPLATE``), so each
    test pays a copy, not the migrations."""
    for server in site_manager.sites():
        conn = _admin(server)
        with conn.cursor() as cur:
            cur.execute(f'DROP DATABASE IF EXISTS "{LR_TEMPLATE}" WITH (FORCE)')
            cur.execute(f'CREATE DATABASE "{LR_TEMPLATE}"')
        conn.close()
        conn = psycopg2.connect(server.dsn(LR_TEMPLATE))
        schema.migrate(conn)
        conn.close()
    return LR_TEMPLATE


def create_database(server: EmbeddedSite, name: str, template: str | None = None, encoding: str | None = None) -> None:
    """``encoding``: a database of that encoding (made from template0, C collation), lr not installed."""
    conn = _admin(server)
    with conn.cursor() as cur:
        if encoding:
            template = "template0"
        made = f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else "")
        cur.execute(made + (f" ENCODING '{encoding}' LC_COLLATE 'C' LC_CTYPE 'C'" if encoding else ""))
    conn.close()


def drop_database(server: EmbeddedSite, name: str) -> None:
    conn = _admin(server)
    with conn.cursor() as cur:
        cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    conn.close()


def on_each(work: Callable[[T], object], items: list[T]) -> None:
    """``work`` on every item at once (each server copies or drops its database in its own process)."""
    with ThreadPoolExecutor(len(items) or 1) as pool:
        list(pool.map(work, items))


def _init_site(site: TestSite) -> None:
    # committed durably: made ahead, the database may see its server stopped "immediate" by the
    # test running meanwhile, which loses the last asynchronous commits (FAST_SETTINGS)
    conn = psycopg2.connect(site.dsn, options="-c synchronous_commit=on")
    schema.init_site(conn, site.site_id, site.region)
    conn.close()


def _make_databases(servers: list[EmbeddedSite], template: str | None) -> list[TestSite]:
    """A fresh database on each server (a copy of ``template``), its site id recorded when it is
    a copy of ``lr_template`` (what ``lr_sites`` asks for)."""
    name = f"lrtest_{os.getpid()}_{next(_db_counter)}"
    on_each(lambda server: create_database(server, name, template), servers)
    made = [TestSite(server, name) for server in servers]
    if template is not None:
        on_each(_init_site, made)
    return made


def _drop_databases(site_manager: SiteManager, made: list[TestSite]) -> None:
    # a fault test may have left a server down: the session teardown removes it
    on_each(
        lambda site: drop_database(site.server, site.dbname), [s for s in made if site_manager.is_running(s.server)]
    )


class NextDatabases:
    """The next tests' databases, made in the background while the current test runs, and the last
    test's dropped meanwhile: a test then pays no ``CREATE DATABASE`` nor ``DROP DATABASE`` (about
    0.2-1 s for the three servers), only a look-up. Up to ``AHEAD`` sets are made ahead per kind
    (empty, or a copy of ``lr_template``: a test's kind is usually its neighbour's), so a run of
    short tests after a long one finds sets made while the long one ran instead of each waiting
    for the next. A set made before a server restarted on another port, or whose making failed
    (a test stopped a server meanwhile), is not used: the test makes its own, as before."""

    AHEAD = 3

    def __init__(self, site_manager: SiteManager) -> None:
        self.site_manager = site_manager
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="lr-next-databases")
        self.ahead: dict[str | None, deque[Future[list[TestSite]]]] = {}

    def take(self, template: str | None, ahead: bool = True) -> list[TestSite]:
        """Databases of the ``template`` kind for a test; with ``ahead``, that kind's sets made ahead
        are topped up in the background (without: none is being made while this test runs)."""
        servers = self.site_manager.sites()
        pending = self.ahead.setdefault(template, deque())
        made = None
        while made is None and pending:
            made = self._ready(pending.popleft(), servers)
        if not ahead:
            self.worker.submit(lambda: None).result()  # what was asked before is done: nothing runs meanwhile
        if made is None:
            made = _make_databases(servers, template)
        if ahead:
            while len(pending) < self.AHEAD:
                pending.append(self.worker.submit(_make_databases, servers, template))
        return made

    def _ready(self, pending: Future[list[TestSite]] | None, servers: list[EmbeddedSite]) -> list[TestSite] | None:
        if pending is None:
            return None
        try:
            made = pending.result()
        except Exception:  # noqa: BLE001 - a server stopped meanwhile: the test makes its own
            return None
        if [(s.server.site_id, s.server.port) for s in made] != [(s.site_id, s.port) for s in servers] or not all(
            self.site_manager.is_running(server) for server in servers
        ):
            _drop_databases(self.site_manager, made)
            return None
        return made

    def drop(self, made: list[TestSite]) -> None:
        """Drop a test's databases in the background (the next test need not wait for it)."""
        self.worker.submit(_drop_databases, self.site_manager, made)

    def close(self) -> None:
        self.worker.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="session")
def next_databases(site_manager: SiteManager) -> Iterator[NextDatabases]:
    ahead = NextDatabases(site_manager)
    yield ahead
    ahead.close()  # before the servers stop (the sets made ahead go with them)


@pytest.fixture
def sites(
    request: pytest.FixtureRequest, site_manager: SiteManager, next_databases: NextDatabases
) -> Iterator[list[TestSite]]:
    """A fresh, empty database on each of the three servers (a copy of ``lr_template`` with the site
    ids recorded when the test uses ``lr_sites``), made while the previous test ran and dropped
    while the next one runs. A test marked ``quiet_servers`` has nothing made or dropped in the
    background while it runs."""
    template = request.getfixturevalue("lr_template") if "lr_sites" in request.fixturenames else None
    created = next_databases.take(template, ahead=request.node.get_closest_marker("quiet_servers") is None)
    yield created
    next_databases.drop(created)


@pytest.fixture
def lr_sites(sites: list[TestSite]) -> list[TestSite]:
    """The three test databases with the lr schema installed (already migrated: copies of
    ``lr_template``) and their site ids recorded (``sites`` records them, knowing this fixture is
    asked for)."""
    return sites


@pytest.fixture
def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    """Airflow's DAG importer sets a Python handler for SIGSEGV and never puts back the one it
    replaced (pytest's faulthandler): a crash of this process after a test parsed DAGs then spun
    or died without a word. Re-armed here, a crash prints every thread's traceback."""
    import faulthandler
    import signal

    from _pytest.faulthandler import fault_handler_stderr_fd_key

    if callable(signal.getsignal(signal.SIGSEGV)) and fault_handler_stderr_fd_key in item.config.stash:
        signal.signal(signal.SIGSEGV, signal.SIG_DFL)
        faulthandler.disable()
        faulthandler.enable(file=item.config.stash[fault_handler_stderr_fd_key], all_threads=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop what Spark tests left running while logging still works (py4j logs when collected)."""
    import sys

    if "pyspark" not in sys.modules:
        return
    from pyspark import SparkContext

    if SparkContext._active_spark_context is not None:
        SparkContext._active_spark_context.stop()
    if SparkContext._gateway is not None:
        SparkContext._gateway.shutdown()
        SparkContext._gateway = None
