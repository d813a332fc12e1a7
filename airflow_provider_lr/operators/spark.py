"""lr's Spark jobs as SparkSubmitOperators: the fan-out of one source's backlog
(``spark_jobs/lr_fanout.py``), the snapshot of a client's federated tables
(``spark_jobs/lr_table_snapshot.py``), a session's full-sync transfer
(``spark_jobs/lr_snapshot_transfer.py``) and the bulk apply of a sink's receive queues
(``spark_jobs/lr_apply_receive_queue.py``).

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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
from airflow.sdk.exceptions import AirflowException

from airflow_provider_lr.engine.db.conninfo import CONNECTIONS_FILE_ENV
from airflow_provider_lr.engine.errors import require_counts
from airflow_provider_lr.engine.store.topology import Topology
from airflow_provider_lr.hooks.site import LRSiteHook
from airflow_provider_lr.operators import telemetry
from airflow_provider_lr.operators.common import (
    APPLY_QUEUE_JOB,
    FANOUT_JOB,
    SNAPSHOT_TRANSFER_JOB,
    TABLE_SNAPSHOT_JOB,
    final_refusals,
    load_topology,
    refused_in_result,
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

    def __init__(
        self, *, job: str, topology_path: str | None = None, application: str | None = None, **kwargs: Any
    ) -> None:
        final_refusals(kwargs)  # a login without lr's grant, the sites on another topology: failed at once
        super().__init__(application=application or str(spark_jobs_dir() / job), **kwargs)
        self.topology_path = topology_path
        self.result: dict[str, Any] | None = None

    def _submit(
        self, context: Any, path: str, topo: Topology, sites: set[str], args: list[str]
    ) -> dict[str, Any] | None:
        """Run the job with ``args`` and the topology at ``path``, reaching ``sites``; its result."""
        with _result_file() as result_file:
            self.application_args = [*args, "--topology", path, "--result-file", result_file]
            conns_file = write_connections_file([topo.conn_id(s) for s in sites])
            self.env_vars = {**(self.env_vars or {}), CONNECTIONS_FILE_ENV: conns_file}
            self._hook = None  # build the hook with this run's arguments and environment
            try:
                super().execute(context)
            except AirflowException:  # spark-submit's exit code; the job's result says what failed, where
                self.result = _read_result(result_file)
                if self.result is None:  # it wrote none (killed, or failed to start): spark-submit's words
                    raise
                self._failed()
            finally:
                os.unlink(conns_file)
            self.result = _read_result(result_file)
        if self.result is not None and not self.result.get("ok"):
            self._failed()
        return self.result

    def _failed(self) -> NoReturn:
        """Fail the task with the job's own words (one ERROR line: the job, and each session's error).
        Before, the task said only spark-submit's ``Cannot execute: <command>. Error code is: 1``,
        what failed left in the job's output above it."""
        result = self.result or {}
        final = refused_in_result(self.log, f"Spark job {Path(self.application).name}", result)
        if final is not None:  # what no retry mends, by the job's kinds of its errors: failed for good
            raise final from None
        errors = result.get("errors") or {}
        why = result.get("error") or "; ".join(f"{where}: {error}" for where, error in sorted(errors.items()))
        said = f"Spark job {Path(self.application).name} failed: {why or result}"
        self.log.error("%s", said)
        raise AirflowException(said) from None


class LRSparkFanOutOperator(_LRSparkJobOperator):
    """Deliver one source's backlog to all its sinks with the Spark fan-out job.

    :param source: the source site id (templated)
    :param max_entries: cap on entries this run delivers (the job's ``--max-entries``)
    :param tasks: chunks teed at once (the job's ``--tasks``; 1: in order in one task; default: the
        topology's ``fanout_tasks``, else ``catchup.fanout_tasks`` of the cluster's cores)
    :param conn_id: the Spark connection (master from its host, e.g. ``local[2]`` or ``spark://host:7077``)
    Other SparkSubmitOperator arguments pass through.
    """

    template_fields: Sequence[str] = (*SparkSubmitOperator.template_fields, "source", "topology_path")

    def __init__(
        self,
        *,
        source: str,
        max_entries: int | None = None,
        tasks: int | None = None,
        name: str = "lr-fanout",
        **kwargs: Any,
    ) -> None:
        require_counts(max_entries=max_entries, tasks=tasks)
        super().__init__(job=FANOUT_JOB, name=name, **kwargs)
        self.source, self.max_entries, self.tasks = source, max_entries, tasks

    # SparkSubmitOperator declares ``execute -> None``, but a returned value is Airflow's XCom (BaseOperator's
    # ``execute -> Any``): this task's XCom is the job's summary.
    def execute(self, context: Any) -> dict[str, Any] | None:  # type: ignore[override]
        path = topology_path(self.topology_path)
        topo = load_topology(path)
        args = ["--source", self.source]
        if self.max_entries is not None:
            args += ["--max-entries", str(int(self.max_entries))]
        if self.tasks is not None:
            args += ["--tasks", str(int(self.tasks))]
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
    parallel tasks, every sink written once per range (``engine/bulk/parallel_tables``).

    :param source: the source site id (templated)
    :param client: the client whose tables are snapshotted (templated)
    :param parts: key ranges per table (the job's ``--parts``; default: by the table's size)
    :param conn_id: the Spark connection. Other SparkSubmitOperator arguments pass through.
    Returns the job's result: the sessions written, those left out and why, each table's state.
    """

    template_fields: Sequence[str] = (*SparkSubmitOperator.template_fields, "source", "client", "topology_path")

    def __init__(
        self, *, source: str, client: str, parts: int | None = None, name: str = "lr-table-snapshot", **kwargs: Any
    ) -> None:
        require_counts(parts=parts)
        super().__init__(job=TABLE_SNAPSHOT_JOB, name=name, **kwargs)
        self.source, self.client, self.parts = source, client, parts

    # SparkSubmitOperator declares ``execute -> None``, but a returned value is Airflow's XCom (BaseOperator's
    # ``execute -> Any``): this task's XCom is the job's summary.
    def execute(self, context: Any) -> dict[str, Any] | None:  # type: ignore[override]
        path = topology_path(self.topology_path)
        topo = load_topology(path)
        args = ["--source", self.source, "--client", self.client]
        if self.parts is not None:
            args += ["--parts", str(int(self.parts))]
        sinks = {k.sink for k in topo.sessions(source=self.source) if k.client == self.client}
        self._submit(context, path, topo, {self.source, *sinks}, args)
        self.log.info("table snapshot of %s/%s: %s", self.source, self.client, self.result)
        return self.result


class LRSparkSnapshotTransferOperator(_LRSparkJobOperator):
    """Move one session's supplied full-sync data to its sink and apply it with the Spark job
    ``spark_jobs/lr_snapshot_transfer.py``: entry-id ranges staged on the sink by parallel tasks,
    then one server-side move into the receive queue (``engine/bulk/snapshot_transfer``). A rerun
    after any failure resumes; nothing is written twice.

    :param source, sink, client: the session (templated)
    :param request_id: the supplied full-sync request (templated; default: the session's open one)
    :param partitions: entry-id ranges (the job's ``--partitions``; default: Spark's parallelism)
    :param conn_id: the Spark connection. Other SparkSubmitOperator arguments pass through.
    Returns the job's result: entries staged and moved, whether applied, seconds per phase.
    """

    template_fields: Sequence[str] = (
        *SparkSubmitOperator.template_fields,
        "source",
        "sink",
        "client",
        "request_id",
        "topology_path",
    )

    def __init__(
        self,
        *,
        source: str,
        sink: str,
        client: str,
        request_id: str | None = None,
        partitions: int | None = None,
        name: str = "lr-snapshot-transfer",
        **kwargs: Any,
    ) -> None:
        require_counts(partitions=partitions)
        super().__init__(job=SNAPSHOT_TRANSFER_JOB, name=name, **kwargs)
        self.source, self.sink, self.client = source, sink, client
        self.request_id, self.partitions = request_id, partitions

    # SparkSubmitOperator declares ``execute -> None``, but a returned value is Airflow's XCom (BaseOperator's
    # ``execute -> Any``): this task's XCom is the job's summary.
    def execute(self, context: Any) -> dict[str, Any] | None:  # type: ignore[override]
        path = topology_path(self.topology_path)
        topo = load_topology(path)
        args = ["--source", self.source, "--sink", self.sink, "--client", self.client]
        if self.request_id:
            args += ["--request-id", self.request_id]
        if self.partitions is not None:
            args += ["--partitions", str(int(self.partitions))]
        self._submit(context, path, topo, {self.source, self.sink}, args)
        self.log.info("full-sync transfer of %s->%s/%s: %s", self.source, self.sink, self.client, self.result)
        telemetry.session_step(
            {"source": self.source, "sink": self.sink, "client": self.client},
            snapshot_messages=(self.result or {}).get("transferred", 0),
        )
        return self.result


class LRSparkApplyReceiveQueueOperator(_LRSparkJobOperator):
    """Apply a sink's receive queues of one client with your function, in bulk, on Spark
    (``spark_jobs/lr_apply_receive_queue.py``): one task per source queue, each run of entries in
    source order in one sink transaction with the delete of what it applied (exactly once; the
    subscriber's per-queue lock keeps a subscriber and the job from interleaving one queue).

    :param sink: the sink site id (templated)
    :param client: the client whose queues are applied (templated)
    :param function: ``package.module:function`` taking an ``ApplyBatch`` (importable on the executors)
    :param batch: entries per run (the job's ``--batch``)
    :param conn_id: the Spark connection. Other SparkSubmitOperator arguments pass through.
    Returns the job's result: entries applied per source.
    """

    template_fields: Sequence[str] = (
        *SparkSubmitOperator.template_fields,
        "sink",
        "client",
        "function",
        "topology_path",
    )

    def __init__(
        self,
        *,
        sink: str,
        client: str,
        function: str,
        batch: int | None = None,
        name: str = "lr-apply-receive-queue",
        **kwargs: Any,
    ) -> None:
        require_counts(batch=batch)
        super().__init__(job=APPLY_QUEUE_JOB, name=name, **kwargs)
        self.sink, self.client, self.function, self.batch = sink, client, function, batch

    # SparkSubmitOperator declares ``execute -> None``, but a returned value is Airflow's XCom (BaseOperator's
    # ``execute -> Any``): this task's XCom is the job's summary.
    def execute(self, context: Any) -> dict[str, Any] | None:  # type: ignore[override]
        path = topology_path(self.topology_path)
        topo = load_topology(path)
        args = ["--sink", self.sink, "--client", self.client, "--function", self.function]
        if self.batch is not None:
            args += ["--batch", str(int(self.batch))]
        self._submit(context, path, topo, {self.sink}, args)
        self.log.info("bulk apply of %s's %s queues: %s", self.sink, self.client, self.result)
        return self.result


def transfers_left_to_spark(ti: Any, sessions: list[dict[str, Any]] | None, step_task_id: str) -> list[dict[str, str]]:
    """The sessions whose step ``step_task_id`` (mapped one index per session, in ``sessions``'
    order) left its full-sync transfer to Spark (``transfer_for_spark`` in its report), as
    ``expand_kwargs`` input for ``LRSparkSnapshotTransferOperator``:
    ``[{"source", "sink", "client", "request_id"}]``."""
    found = []
    for index, session in enumerate(sessions or []):  # None: the task that listed them failed
        report = ti.xcom_pull(task_ids=step_task_id, map_indexes=index)
        if report and report.get("transfer_for_spark"):
            found.append(
                {
                    "source": session["source"],
                    "sink": session["sink"],
                    "client": session["client"],
                    "request_id": report["transfer_for_spark"],
                }
            )
    return found


def tables_left_to_spark(ti: Any, sessions: list[dict[str, Any]] | None, step_task_id: str) -> list[dict[str, str]]:
    """The (source, client) pairs to run ``LRSparkTableSnapshotOperator`` for: those of the sessions
    whose step ``step_task_id`` (mapped one index per session, in ``sessions``' order) left a large
    table snapshot to Spark (``tables_for_spark`` in its report; the engine decides what is large).
    One job per pair covers all its sinks. As ``expand_kwargs`` input: ``[{"source", "client"}]``."""
    pairs = set()
    for index, session in enumerate(sessions or []):  # None: the task that listed them failed
        report = ti.xcom_pull(task_ids=step_task_id, map_indexes=index)
        if report and report.get("tables_for_spark"):
            pairs.add((session["source"], session["client"]))
    return [{"source": source, "client": client} for source, client in sorted(pairs)]


def plan_fanout(site: dict[str, str], spark_conn_id: str, topology_file: str | None = None) -> dict[str, Any]:
    """How a source's backlog moves this run, as ``engine/session/catchup`` decides it (Spark when the
    job is installed and the connection defined): ``spark``, ``tee`` (the fan-out in the worker,
    ``LRFanOutOperator``) or ``in_process`` (the sessions' own log-entry steps). Small dict for XCom."""
    from airflow_provider_lr.engine.session import catchup
    from airflow_provider_lr.engine.session.settings import SessionSettings
    from airflow_provider_lr.engine.source.backlog import source_backlog
    from airflow_provider_lr.operators.common import site_connection

    settings = SessionSettings.from_topology(load_topology(topology_file))
    with site_connection(site["conn_id"], site["site"]) as conn:
        backlog = source_backlog(conn)
    choice = catchup.choose(backlog, settings, lambda: spark_unavailable(spark_conn_id, FANOUT_JOB))
    return {
        "source": site["site"],
        "backlog": backlog,
        "threshold": settings.spark_min_backlog,
        "path": choice.path.value,
        "why": choice.why,
    }
