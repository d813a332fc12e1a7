"""The Spark fan-out of one source's backlog (``spark_jobs/lr_fanout.py``) as a SparkSubmitOperator.

The job resolves sites from ``$LR_CONNECTIONS_FILE`` (Airflow's connections-file format), so this
operator materializes the connections the job needs — the source and its sinks, resolved
through ``LRSiteHook`` from whatever backend Airflow uses — into a temporary 0600 file, passes its
path in the environment (never credentials on the command line or in logs) and removes it when
the job ends. The job writes its small summary (the ``LR_RESULT`` it prints) to a private file
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
from airflow_provider_lr.hooks.site import LRSiteHook
from airflow_provider_lr.operators import telemetry
from airflow_provider_lr.operators.common import load_topology, topology_path
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


class LRSparkFanOutOperator(SparkSubmitOperator):
    """Deliver one source's backlog to all its sinks with the Spark fan-out job.

    :param source: the source site id (templated)
    :param max_entries: cap on entries this run delivers (the job's ``--max-entries``)
    :param conn_id: the Spark connection (master from its host, e.g. ``local[2]`` or ``spark://host:7077``)
    Other SparkSubmitOperator arguments pass through. Client deploy mode only: the connections file
    and the result file live on the worker that submits.
    """

    template_fields: Sequence[str] = (*SparkSubmitOperator.template_fields, "source", "topology_path")

    def __init__(self, *, source: str, topology_path: str | None = None, max_entries: int | None = None,
                 application: str | None = None, name: str = "lr-fanout", **kwargs: Any) -> None:
        super().__init__(application=application or str(spark_jobs_dir() / "lr_fanout.py"), name=name, **kwargs)
        self.source, self.topology_path, self.max_entries = source, topology_path, max_entries
        self.result: dict[str, Any] | None = None

    def execute(self, context: Any) -> dict[str, Any] | None:
        path = topology_path(self.topology_path)
        topo = load_topology(path)
        sites = {self.source, *(k.sink for k in topo.sessions(source=self.source))}
        with _result_file() as result_file:
            args = ["--source", self.source, "--topology", path, "--result-file", result_file]
            if self.max_entries:
                args += ["--max-entries", str(int(self.max_entries))]
            self.application_args = args
            conns_file = write_connections_file([topo.conn_id(s) for s in sites])
            self.env_vars = {**(self.env_vars or {}), CONNECTIONS_FILE_ENV: conns_file}
            self._hook = None  # build the hook with this run's arguments and environment
            try:
                super().execute(context)
            finally:
                os.unlink(conns_file)
            self.result = _read_result(result_file)
        self.log.info("fan-out of %s: %s", self.source, self.result)
        for session, delivered in ((self.result or {}).get("deliveries") or {}).items():
            telemetry.session_step(session, delivered=delivered)
        for session in (self.result or {}).get("errors") or {}:
            telemetry.session_error(session)
        return self.result


def plan_fanout(site: dict[str, str], spark_conn_id: str, topology_file: str | None = None) -> dict[str, Any]:
    """How a source's backlog moves this run, as ``engine/bulk/catchup`` decides it (Spark when the
    job is installed and the connection defined): ``spark``, ``tee`` (the fan-out in the worker,
    ``LRFanOutOperator``) or ``in_process`` (the sessions' own log-entry steps). Small dict for XCom."""
    from airflow.sdk import BaseHook

    from airflow_provider_lr.engine.bulk import catchup
    from airflow_provider_lr.engine.session.runner import SessionSettings
    from airflow_provider_lr.engine.site import status
    from airflow_provider_lr.operators.common import site_connection

    def why_no_spark() -> str | None:
        if not (spark_jobs_dir() / "lr_fanout.py").exists():
            return f"the Spark job is not installed in {spark_jobs_dir()}"
        try:
            BaseHook.get_connection(spark_conn_id)
        except Exception:
            return f"no Spark connection {spark_conn_id!r}"
        return None

    settings = SessionSettings.from_topology(load_topology(topology_file))
    with site_connection(site["conn_id"], site["site"]) as conn:
        backlog = status.source_backlog(conn)
    choice = catchup.choose(backlog, settings, why_no_spark)
    return {"source": site["site"], "backlog": backlog, "threshold": settings.spark_min_backlog,
            "path": choice.path.value, "why": choice.why}
