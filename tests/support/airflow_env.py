"""Airflow for tests: the metadata DB in the session's temp AIRFLOW_HOME, the repo's DAGs, and the
test sites exposed as Airflow connections (``AIRFLOW_CONN_LR_SITE_*``) with a topology file."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from airflow_provider_lr.engine.store import topology
from airflow_provider_lr.engine.store.topology import Topology
from tests.support.session import apply_to, topology_doc

DAGS_DIR = Path(__file__).resolve().parents[2] / "dags"
PROVIDER = "tests.support.session:table_provider"


@pytest.fixture(scope="session")
def airflow_db() -> Iterator[None]:
    """A fresh Airflow metadata DB (SQLite in the temp AIRFLOW_HOME conftest set), once per session,
    with the repo's ``dags/`` as the DAG bundle (``dag.test`` syncs the bundle and runs only DAGs
    found in it). tests/conftest.py imports it and ``dagbag``, so every module shares them (a
    session fixture imported into a test module is that module's own: made again per module)."""
    from airflow import settings
    from airflow.utils import db

    before = settings.DAGS_FOLDER  # read once at import; the dags-folder bundle uses it
    settings.DAGS_FOLDER = str(DAGS_DIR)
    db.resetdb()
    yield
    settings.DAGS_FOLDER = before


@pytest.fixture(scope="session")
def dagbag(airflow_db: None) -> Any:
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(DAGS_DIR))


def conn_id(site_id: str) -> str:
    return "lr_site_" + site_id.split("-")[-1]


@dataclass
class AirflowSites:
    """Test sites as Airflow sees them: connections in the environment and a topology file."""

    sites: list  # tests.conftest.TestSite
    topology_path: Path
    topology: Topology

    def site(self, site_id: str):
        return next(s for s in self.sites if s.site_id == site_id)

    def env(self, site) -> tuple[str, str]:
        return f"AIRFLOW_CONN_{conn_id(site.site_id).upper()}", json.dumps(site.server.airflow_conn(site.dbname))


def write_topology(
    path: Path,
    sites: list,
    settings: dict | None = None,
    provider: str | None = PROVIDER,
    regions: dict[str, str] | None = None,
) -> Topology:
    """site-a (the first site) replicates client ``policy`` to the others."""
    doc = topology_doc(
        sites,
        providers={"policy": provider} if provider else None,
        conn_ids=conn_id,
        regions=regions,
        settings={"full_sync_data_timeout_s": 30, **(settings or {})},
    )
    path.write_text(yaml.safe_dump(doc))
    return topology.from_document(doc)


@pytest.fixture
def airflow_sites(lr_sites, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[AirflowSites]:
    """site-a replicates client ``policy`` to site-b and site-c (full-sync provider: the test
    app's table); the topology is applied to every site and reachable through ``$LR_TOPOLOGY``."""
    path = tmp_path / "topology.yaml"
    topo = write_topology(path, lr_sites)
    monkeypatch.setenv(topology.TOPOLOGY_ENV, str(path))
    found = AirflowSites(lr_sites, path, topo)
    for site in lr_sites:
        monkeypatch.setenv(*found.env(site))
    apply_to(lr_sites, topo)
    yield found


def reconfigure(found: AirflowSites, **options: Any) -> Topology:
    """Rewrite and re-apply the topology (``write_topology`` options) on every site."""
    found.topology = write_topology(found.topology_path, found.sites, **options)
    apply_to(found.sites, found.topology)
    return found.topology


def run_dag(dagbag: Any, dag_id: str, conf: dict | None = None) -> Any:
    """One real run of a DAG in this process (``dag.test``: the real execution API, triggers inline)."""
    return dagbag.dags[dag_id].test(run_conf=conf)


def states(dag_run: Any) -> dict[tuple[str, int], str]:
    """(task id, map index) -> final state of every task instance of the run."""
    return {(ti.task_id, ti.map_index): str(ti.state) for ti in dag_run.get_task_instances()}


def xcom(dag_run: Any, task_id: str, map_index: int = -1) -> Any:
    ti = next(t for t in dag_run.get_task_instances() if t.task_id == task_id and t.map_index == map_index)
    return ti.xcom_pull(task_ids=task_id, map_indexes=map_index)


class Received(list[str]):
    """The metric lines received (``name:value|type``); ``settled()`` returns once every line sent
    before it is in: a marker sent last to the same socket is read after them."""

    MARKER = "lr.test.settled:1|c"

    def __init__(self, address: tuple[str, int]) -> None:
        super().__init__()
        self.address = address

    def settled(self, timeout: float = 30.0) -> None:
        import socket
        import time

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as marker:
            marker.sendto(self.MARKER.encode(), self.address)
        deadline = time.monotonic() + timeout
        while self.MARKER not in self:
            assert time.monotonic() < deadline, f"the StatsD lines sent did not arrive within {timeout} s"
            time.sleep(0.01)
        self.remove(self.MARKER)


@pytest.fixture
def statsd_packets(monkeypatch: pytest.MonkeyPatch) -> Iterator[Received]:
    """Airflow's metrics switched to StatsD on a loopback UDP port for this test; yields the list
    the received metric lines are appended to (``name:value|type``): read it after ``settled()``
    (a fixed sleep raced the receiving thread)."""
    import socket
    import threading

    from airflow.sdk.observability import stats
    from airflow.sdk.observability.metrics import stats_utils

    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(0.2)
    monkeypatch.setenv("AIRFLOW__METRICS__STATSD_ON", "True")
    monkeypatch.setenv("AIRFLOW__METRICS__STATSD_HOST", "127.0.0.1")
    monkeypatch.setenv("AIRFLOW__METRICS__STATSD_PORT", str(sock.getsockname()[1]))
    monkeypatch.setenv("AIRFLOW__METRICS__STATSD_PREFIX", "airflow")
    # what the task runner does at start (dag.test runs tasks in this process, without it)
    stats.initialize(factory=stats_utils.get_stats_factory(), export_legacy_names=True)
    received = Received(sock.getsockname())
    stop = threading.Event()

    def receive() -> None:
        while not stop.is_set():
            try:
                data = sock.recv(65536)
            except OSError:
                continue
            received.extend(line for line in data.decode().splitlines() if line)

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    yield received
    stop.set()
    thread.join()
    sock.close()
    from airflow.sdk._shared.observability.metrics.base_stats_logger import NoStatsLogger

    stats.initialize(factory=NoStatsLogger, export_legacy_names=True)


def metric(packets: list[str], name: str) -> list[float]:
    """The values a metric was sent with (``airflow.`` prefix left out of ``name``)."""
    return [float(p.split(":", 1)[1].split("|", 1)[0]) for p in packets if p.split(":", 1)[0] == f"airflow.{name}"]
