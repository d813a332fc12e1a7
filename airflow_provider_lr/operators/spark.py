"""lr's Spark jobs as SparkSubmitOperators: the fan-out of one source's backlog
(``spark_jobs/lr_fanout.py``) and the snapshot of a client's federated tables
(``spark_jobs/lr_table_snapshot.py``).

The jobs resolve sites from ``$LR_CONNECTIONS_FILE`` (Airflow's connections-file format), so these
operators materialize the connections the job needs — the source and its sinks, resolved
through ``LRSiteHook`` from whatever backend Airflow uses — into a temporary 0600 file, pass its
path in the environment (never credentials on the command line or in logs) and remove it when
the job ends. A job writes its small summary (the ``LR_RESULT`` it prints) to a private file
named by ``--result-file``; that summary is the task's XCom.
"""
from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator

from airflow_provider_lr.engine.site.conninfo import CONNECTIONS_FILE_ENV
from airflow_provider_lr.engine.site.topology import Topology
from airflow_provider_lr.hooks.site import LRSiteHook
from airflow_provider_lr.operators import telemetry
from airflow_provider_lr.operators.common import (
    FANOUT_JOB,
    TABLE_SNAPSHOT_JOB,
    load_topology,
    spark_unavailable,
    topology_path,
)
from airflow_provider_lr.paths import spark_jobs_dir


def write_connections_file(conn_ids: Sequence[str], directory: str | None = None) -> str:
    """The named Airflow connections in a new 0600 JSON file (``{conn_id: {conn_type, host, ...}}``);
    the caller removes it."""
    conns = {cid: LRSiteHook(lr_conn_id=cid).connection_dict() for cid in sorted(set(conn_ids))}
    fd, path = tempfile.mkstemp(prefix="lr-connections-", suffix=".json", dir=directory)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump(conns, handle)
    except BaseException:
        os.unlink(path)
        raise
    return path


@contextmanager
def _result_file() -> Iterator[str]:
    """A new empty 0600 file for the job to write its result to (``--result-file``), removed after."""
    fd, path = tempfile.mkstemp(prefix="lr-result-", suffix=".json")
    os.close(fd)
    try:
        yield path
    finally:
        os.unlink(path)


def _read_result(path: str) -> dict[str, Any] | None:
    """The job's result (None if it wrote none)."""
    with open(path) as handle:
        text = handle.read()
    return json.loads(text) if text.strip() else None


class _LRSparkJobOperator(SparkSubmitOperator):
    """spark-submit of one lr job: the sites it needs in a private connections file (in the
    environment, never in argv), ``--topology`` and ``--result-file`` added to its arguments, and
    the result the job wrote as the return value. Client deploy mode only: the connections file
    and the result file live on the worker that submits."""

    def __init__(self, *, job: str, topology_path: str | None = None, application: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(application=application or str(spark_jobs_dir() / job), **kwargs)
        self.topology_path = topology_path
        self.result: dict[str, Any] | None = None

    def _submit(self, context: Any, path: str, topo: Topology, sites: set[str],
                args: list[str]) -> dict[str, Any] | None:
        """Run the job with ``args`` and the topology at ``path``, reaching ``sites``; its result."""
        with _result_file() as result_file:
            self.application_args = [*args, "--topology", path, "--result-file", result_file]
            conns_file = write_connections_file([topo.conn_id(s) for s in sites])
            self.env_vars = {**(self.env_vars or {}), CONNECTIONS_FILE_ENV: conns_file}
            self._hook = None  # build the hook with this run's arguments and environment
            try:
                super().execute(context)
            finally:
                os.unlink(conns_file)
            self.result = _read_result(result_file)
        return self.result


class LRSparkFanOutOperator(_LRSparkJobOperator):
    """Deliver one source's backlog to all its sinks with the Spark fan-out job.

    :param source: the source site id (templated)
    :param max_entries: cap on entries this run delivers (the job's ``--max-entries``)
    :param conn_id: the Spark connection (master from its host, e.g. ``local[2]`` or ``spark://host:7077``)
    Other SparkSubmitOperator arguments pass through.
    """

    template_fields: Sequence[str] = (*SparkSubmitOperator.template_fields, "source", "topology_path")

    def __init__(self, *, source: str, max_entries: int | None = None, name: str = "lr-fanout",
                 **kwargs: Any) -> None:
        super().__init__(job=FANOUT_JOB, name=name, **kwargs)
        self.source, self.max_entries = source, max_entries

    def execute(self, context: Any) -> dict[str, Any] | None:
        path = topology_path(self.topology_path)
        topo = load_topology(path)
        args = ["--source", self.source]
        if self.max_entries:
            args += ["--max-entries", str(int(self.max_entries))]
        self._submit(context, path, topo, {self.source, *(k.sink for k in topo.sessions(source=self.source))}, args)
        self.log.info("fan-out of %s: %s", self.source, self.result)
        for session, delivered in ((self.result or {}).get("deliveries") or {}).items():
            telemetry.session_step(session, delivered=delivered)
        for session in (self.result or {}).get("errors") or {}:
            telemetry.session_error(session)
        return self.result


class LRSparkTableSnapshotOperator(_LRSparkJobOperator):
    """Snapshot one client's federated tables from a source to the sinks that lack them with the
    Spark job ``spark_jobs/lr_table_snapshot.py``: one exported snapshot, key ranges read by
    parallel tasks, every sink written once per range (``engine/tables/parallel``).

    :param source: the source site id (templated)
    :param client: the client whose tables are snapshotted (templated)
    :param parts: key ranges per table (the job's ``--parts``; default: by the table's size)
    :param conn_id: the Spark connection. Other SparkSubmitOperator arguments pass through.
    Returns the job's result: the sessions written, those left out and why, each table's state.
    """

    template_fields: Sequence[str] = (*SparkSubmitOperator.template_fields, "source", "client", "topology_path")

    def __init__(self, *, source: str, client: str, parts: int | None = None, name: str = "lr-table-snapshot",
                 **kwargs: Any) -> None:
        super().__init__(job=TABLE_SNAPSHOT_JOB, name=name, **kwargs)
        self.source, self.client, self.parts = source, client, parts

    def execute(self, context: Any) -> dict[str, Any] | None:
        path = topology_path(self.topology_path)
        topo = load_topology(path)
        args = ["--source", self.source, "--client", self.client]
        if self.parts:
            args += ["--parts", str(int(self.parts))]
        sinks = {k.sink for k in topo.sessions(source=self.source) if k.client == self.client}
        self._submit(context, path, topo, {self.source, *sinks}, args)
        self.log.info("table snapshot of %s/%s: %s", self.source, self.client, self.result)
        return self.result


def tables_left_to_spark(ti: Any, sessions: list[dict[str, Any]], step_task_id: str) -> list[dict[str, str]]:
    """The (source, client) pairs to run ``LRSparkTableSnapshotOperator`` for: those of the sessions
    whose step ``step_task_id`` (mapped one index per session, in ``sessions``' order) left a large
    table snapshot to Spark (``tables_for_spark`` in its report; the engine decides what is large).
    One job per pair covers all its sinks. As ``expand_kwargs`` input: ``[{"source", "client"}]``."""
    pairs = set()
    for index, session in enumerate(sessions):
        report = ti.xcom_pull(task_ids=step_task_id, map_indexes=index)
        if report and report.get("tables_for_spark"):
            pairs.add((session["source"], session["client"]))
    return [{"source": source, "client": client} for source, client in sorted(pairs)]


def plan_fanout(site: dict[str, str], spark_conn_id: str, topology_file: str | None = None) -> dict[str, Any]:
    """How a source's backlog moves this run, as ``engine/bulk/catchup`` decides it (Spark when the
    job is installed and the connection defined): ``spark``, ``tee`` (the fan-out in the worker,
    ``LRFanOutOperator``) or ``in_process`` (the sessions' own log-entry steps). Small dict for XCom."""
    from airflow_provider_lr.engine.bulk import catchup
    from airflow_provider_lr.engine.session.runner import SessionSettings
    from airflow_provider_lr.engine.site import status
    from airflow_provider_lr.operators.common import site_connection

    settings = SessionSettings.from_topology(load_topology(topology_file))
    with site_connection(site["conn_id"], site["site"]) as conn:
        backlog = status.source_backlog(conn)
    choice = catchup.choose(backlog, settings, lambda: spark_unavailable(spark_conn_id, FANOUT_JOB))
    return {"source": site["site"], "backlog": backlog, "threshold": settings.spark_min_backlog,
            "path": choice.path.value, "why": choice.why}
