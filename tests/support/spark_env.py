"""Spark for tests: a real standalone cluster on loopback, and a small ``local[2]`` session.

lr must run on a real ``spark://`` master (docs/spark.md), where executors are separate JVMs launched by
a worker and Python partitions run in the executors' own Python workers. ``local[2]`` hides that
(one JVM), so ``standalone_cluster`` starts an actual Master and Worker from the ``pyspark`` wheel
(``$SPARK_HOME/bin/spark-class``), with ports picked free, logs in a temp directory, and both
processes killed by process group afterwards (the worker's executors and their Python workers live
in the worker's group, so nothing is left behind).

The machine has two cores: one worker with one core and 1 GiB, daemons with 256 MiB heaps.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pyspark
import pytest
from pyspark import SparkContext
from pyspark.sql import SparkSession

SPARK_HOME = Path(pyspark.__file__).resolve().parent
REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 90.0
# The tests' JVMs (drivers, daemons, executors) live seconds to minutes on small data: the C1
# compiler alone starts them on about 40 % less CPU than tiered C1 + C2, on two shared cores.
# (tests/conftest.py sets it for every driver, Airflow's spark-submit tasks included.)
QUICK_JIT = "-XX:TieredStopAtLevel=1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spark_env() -> dict[str, str]:
    """Environment for Spark daemons and drivers: loopback only, the venv's Python everywhere."""
    env = dict(os.environ)
    env.update(
        SPARK_HOME=str(SPARK_HOME),
        SPARK_LOCAL_IP="127.0.0.1",
        PYSPARK_PYTHON=sys.executable,
        PYSPARK_DRIVER_PYTHON=sys.executable,
        SPARK_DAEMON_MEMORY="256m",
        SPARK_DAEMON_JAVA_OPTS=QUICK_JIT,
        # The master's REST submission server binds a fixed port (6066): off, so clusters can coexist.
        SPARK_MASTER_OPTS="-Dspark.master.rest.enabled=false",
    )
    return env


@dataclass
class StandaloneCluster:
    """A running Master + Worker pair; ``url`` is the ``spark://`` master URL."""

    url: str
    webui_url: str
    log_dir: Path
    master: subprocess.Popen
    worker: subprocess.Popen | None = None  # the first worker
    workers: list[subprocess.Popen] = field(default_factory=list)  # every worker

    def status(self) -> dict:
        """The master's JSON status page (workers, cores, apps)."""
        with urllib.request.urlopen(self.webui_url + "/json/", timeout=2) as resp:
            return json.loads(resp.read())

    def logs(self, tail: int = 40) -> str:
        """Last lines of each daemon log, for failure messages."""
        parts = []
        for path in sorted(self.log_dir.glob("*.log")):
            lines = path.read_text(errors="replace").splitlines()[-tail:]
            parts.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(parts)


def _spawn(cls: str, args: list[str], log: Path, env: dict[str, str], cwd: Path) -> subprocess.Popen:
    # start_new_session: the daemon leads its own process group, so one killpg stops it and
    # everything it launched (executors, their Python workers).
    with open(log, "wb") as out:
        return subprocess.Popen(
            [str(SPARK_HOME / "bin" / "spark-class"), cls, *args],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )


def _stop(proc: subprocess.Popen | None, grace_s: float = 10.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _wait_for(cluster: StandaloneCluster, ready, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        for proc in (cluster.master, *cluster.workers):
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(
                    f"Spark daemon exited ({proc.returncode}) while waiting for {what}\n{cluster.logs()}"
                )
        try:
            if ready(cluster.status()):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
            pass  # web UI not up yet
        if time.monotonic() > deadline:
            raise TimeoutError(f"Spark standalone: no {what} after {timeout_s:.0f} s\n{cluster.logs()}")
        time.sleep(0.25)


@contextmanager
def standalone_cluster(
    tmp_path: Path, cores: int = 1, memory: str = "1g", workers: int = 1, hosts: bool = False
) -> Iterator[StandaloneCluster]:
    """Start a Spark standalone Master and ``workers`` Workers of ``cores`` each on 127.0.0.1; yield
    once every worker registered. ``hosts``: worker n listens on 127.0.0.(n + 1), a host of its own
    (Spark never runs a speculative copy of a task on a host where it already ran)."""
    log_dir = Path(tmp_path) / "spark-standalone"
    work_dir = log_dir / "work"
    work_dir.mkdir(parents=True, exist_ok=True)
    env = spark_env()
    port, webui_port = _free_port(), _free_port()
    master = _spawn(
        "org.apache.spark.deploy.master.Master",
        ["--host", "127.0.0.1", "--port", str(port), "--webui-port", str(webui_port)],
        log_dir / "master.log",
        env,
        log_dir,
    )
    cluster = StandaloneCluster(f"spark://127.0.0.1:{port}", f"http://127.0.0.1:{webui_port}", log_dir, master)
    try:
        _wait_for(cluster, lambda s: s.get("status") == "ALIVE", "ALIVE master", START_TIMEOUT_S)
        for n in range(workers):
            host = f"127.0.0.{n + 1}" if hosts else "127.0.0.1"
            cluster.workers.append(
                _spawn(
                    "org.apache.spark.deploy.worker.Worker",
                    [
                        cluster.url,
                        "--host",
                        host,
                        "--cores",
                        str(cores),
                        "--memory",
                        memory,
                        "--webui-port",
                        str(_free_port()),
                        "--work-dir",
                        str(work_dir / f"worker-{n}"),
                    ],
                    log_dir / f"worker-{n}.log",
                    {**env, "SPARK_LOCAL_IP": host},
                    log_dir,
                )
            )
        cluster.worker = cluster.workers[0]
        _wait_for(
            cluster, lambda s: s.get("aliveworkers", 0) >= workers, f"{workers} registered worker(s)", START_TIMEOUT_S
        )
        yield cluster
    finally:
        for worker in cluster.workers:
            _stop(worker)
        _stop(cluster.master)


def _session(master: str, app_name: str, conf: dict[str, str]) -> SparkSession:
    """getOrCreate, but never hand back a running context attached to a different master."""
    os.environ.update(SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    active = SparkContext._active_spark_context
    if active is not None and active.master != master:
        active.stop()
    builder = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.pyspark.python", sys.executable)
        .config("spark.pyspark.driver.python", sys.executable)
        .config("spark.driver.memory", "1g")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.default.parallelism", "2")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
    )
    for key, value in conf.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("WARN")
    return session


def local_spark_session(app_name: str = "lr-tests", master: str = "local[2]", **conf: str) -> SparkSession:
    """A ``local[2]`` session with small memory and no UI (the 2-core machine's whole budget);
    ``master="local[2,4]"`` lets a failed task be retried (local mode's default is no retry)."""
    return _session(master, app_name, conf)


def cluster_spark_session(master_url: str, app_name: str = "lr-tests-cluster", **conf: str) -> SparkSession:
    """A session on a standalone master: one 1-core executor of 512 MiB that fits the test worker.

    Executors get the repository on ``PYTHONPATH`` so functions pickled by reference from test or
    job modules import there too (the package itself is installed in the same venv).
    """
    defaults = {
        "spark.cores.max": "1",
        "spark.executor.cores": "1",
        "spark.executor.memory": "512m",
        "spark.executor.extraJavaOptions": QUICK_JIT,
        "spark.executorEnv.PYTHONPATH": str(REPO_ROOT),
        "spark.executorEnv.PYSPARK_PYTHON": sys.executable,
    }
    return _session(master_url, app_name, {**defaults, **conf})


@pytest.fixture(scope="session")
def spark_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandaloneCluster]:
    """A standalone Master + Worker for the whole test session (tests/spark/conftest.py shares it)."""
    with standalone_cluster(tmp_path_factory.mktemp("spark")) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def two_host_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandaloneCluster]:
    """A standalone Master and two Workers of 1 core and 1 GiB, each on a host of its own
    (``hosts``), for the whole test session: the modules that spread work over two executors share
    its start (tests/spark/conftest.py)."""
    with standalone_cluster(
        tmp_path_factory.mktemp("spark-2h"), cores=1, memory="1g", workers=2, hosts=True
    ) as cluster:
        yield cluster


# --- lr scenarios for the Spark jobs ------------------------------------------------------------
def write_connections_file(path: Path, lr_sites, password: str | None = None) -> Path:
    """An Airflow-format connections file naming each test site by its site id (what the jobs read
    through ``$LR_CONNECTIONS_FILE``); ``password`` is added to every connection."""
    conns = {}
    for site in lr_sites:
        conn = site.server.airflow_conn(site.dbname)
        if password is not None:
            conn["password"] = password
        conns[site.site_id] = conn
    path.write_text(json.dumps(conns))
    path.chmod(0o600)
    return path


def in_log_entry_sync(lr_sites, clients=("policy",), sinks=("site-b", "site-c"), settings: dict | None = None):
    """Topology site-a -> sinks for ``clients``, every session through an (empty) full sync, so
    each is in log-entry sync with an empty backlog. Returns the topology."""
    from tests.support.session import apply, empty_provider, replicator

    topo = apply(lr_sites, [{"source": "site-a", "sinks": list(sinks), "clients": list(clients)}], settings=settings)
    repl = replicator(topo, lr_sites, providers={c: empty_provider for c in clients})
    try:
        reports = repl.run(max_cycles=5, until_idle=True, interval=0.01)
        assert all(not r.error and r.state == "IN_LOG_ENTRY_SYNC" for r in reports), reports
    finally:
        repl.close()
    return topo


def transmit_backlog(
    source, entries: int, sinks=("site-b", "site-c"), clients=("policy",), per_txn: int = 500, seed: int = 5
) -> None:
    """``entries`` log entries on the source, each to a random non-empty subset of ``sinks`` and a
    random client, ``per_txn`` to a transaction; payloads ``<client>:<n>``."""
    import random

    from airflow_provider_lr.client import LRMessageWithDestinations, RoutingQueueClient

    rng = random.Random(seed)
    conn = source.connect()
    try:
        senders = {c: RoutingQueueClient(conn, c) for c in clients}
        for start in range(0, entries, per_txn):
            batch: dict[str, list] = {c: [] for c in clients}
            for n in range(start, min(start + per_txn, entries)):
                client = rng.choice(clients)
                dests = [s for s in sinks if rng.random() < 0.5] or [rng.choice(sinks)]
                batch[client].append(LRMessageWithDestinations(f"{client}:{n}".encode(), dests))
            for client, messages in batch.items():
                senders[client].transmit_log_entry_messages(messages)
            conn.commit()
    finally:
        conn.close()


def expected_queue(source, sink_id: str, client: str) -> list[bytes]:
    """The payloads the sink must hold for ``client``, in source order."""
    return [payload for _, payload in expected_entries(source, sink_id, client)]


def expected_entries(source, sink_id: str, client: str) -> list[tuple[int, bytes]]:
    """(commit position, payload) of what the sink must hold for ``client``, in source order."""
    from airflow_provider_lr.proto import lr_pb2

    rows = source.query(
        "SELECT c.position, e.message FROM lr.log_commits c JOIN lr.log_entries e ON e.tx = c.tx "
        "JOIN lr.remote_sites r ON r.site_id = %s JOIN lr.clients k ON k.client_id = e.client_id "
        "WHERE e.stream = 1 AND e.tag_ids @> ARRAY[r.tag_id] AND k.client_name = %s ORDER BY c.position, e.entry_id",
        (sink_id, client),
    )
    return [(p, lr_pb2.RoutingTableEntryMsg.FromString(bytes(m)).opaque_payload) for p, m in rows]


def record_applied(batch) -> None:
    """An apply function for ``lr_apply_receive_queue``: appends each payload to ``applied``
    (created on demand) through the delivery transaction; refuses payloads ending in ``:poison``."""
    with batch.conn.cursor() as cur:
        cur.execute("CREATE TABLE IF NOT EXISTS applied (n serial PRIMARY KEY, source text, kind text, payload text)")
        for payload in batch.payloads or [b""]:
            if payload.endswith(b":poison"):
                raise ValueError(f"cannot apply {payload!r}")
            cur.execute(
                "INSERT INTO applied (source, kind, payload) VALUES (%s, %s, %s)",
                (batch.source, batch.kind, payload.decode()),
            )


@pytest.fixture(scope="module")
def local_spark() -> Iterator[SparkSession]:
    """One local[2] session per test module (import this fixture to use it)."""
    session = local_spark_session("lr-spark-jobs-tests")
    yield session
    session.stop()


@pytest.fixture
def lr_connections(lr_sites, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``$LR_CONNECTIONS_FILE`` naming each test site by its site id (import this fixture to use it)."""
    path = write_connections_file(tmp_path / "connections.json", lr_sites)
    monkeypatch.setenv("LR_CONNECTIONS_FILE", str(path))
    return path


@contextmanager
def prefixes_only(lr_sites, expected: dict, clients) -> Iterator[list]:
    """While the block runs, a reader checks that every sink's visible queue of each client is a
    prefix of ``expected[(sink id, client)]`` (the source order); yields the violations found."""
    import threading

    from tests.support.session import sink_queue

    stop, violations, samples = threading.Event(), [], [0]

    def watch() -> None:
        while not stop.is_set():
            for sink in lr_sites[1:]:
                for client in clients:
                    seen = sink_queue(sink, client)
                    if seen != expected[(sink.site_id, client)][: len(seen)]:
                        violations.append((sink.site_id, client, len(seen)))
            samples[0] += 1

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        yield violations
    finally:
        while samples[0] < 2 and watcher.is_alive():  # a block quicker than two looks still gets them
            time.sleep(0.01)
        stop.set()
        watcher.join()
    assert samples[0] > 1
