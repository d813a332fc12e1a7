"""What every lr task shares: which topology it works on, and how a site is reached.

XComs carry only small handles (a session or site as a dict of ids); state lives in the sites.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import psycopg2
import psycopg2.errors
import psycopg2.extensions

from airflow_provider_lr.engine.db.explained import refused_kind
from airflow_provider_lr.engine.db.timeouts import Timeouts, failure
from airflow_provider_lr.engine.db.topology_schema import ONE_LINE_PATTERN, form_pattern
from airflow_provider_lr.engine.errors import (
    ConfigurationError,
    LRError,
    TopologyMismatchError,
    one_line,
    without_statement,
)
from airflow_provider_lr.engine.site import topology
from airflow_provider_lr.engine.store import topology as topologies
from airflow_provider_lr.engine.store.topology import Topology
from airflow_provider_lr.engine.vocabulary import MAX_REASON_CHARS, SessionKey
from airflow_provider_lr.hooks.site import ConnectionMissing, LRSiteHook
from airflow_provider_lr.paths import spark_jobs_dir

FANOUT_JOB = "lr_fanout.py"  # the Spark jobs in spark_jobs/ the operators submit
TABLE_SNAPSHOT_JOB = "lr_table_snapshot.py"
SNAPSHOT_TRANSFER_JOB = "lr_snapshot_transfer.py"
APPLY_QUEUE_JOB = "lr_apply_receive_queue.py"
TOPOLOGY_VARIABLE = "lr_topology"  # Airflow Variable (or AIRFLOW_VAR_LR_TOPOLOGY) naming the topology file


def topology_path(explicit: str | None = None) -> str:
    """The topology file a task uses: an explicit path, else the Airflow Variable ``lr_topology``,
    else ``$LR_TOPOLOGY``, else the shipped ``include/topology.yaml``. Call it inside tasks only
    (a Variable lookup at DAG parse time costs every parse)."""
    if explicit:
        return str(explicit)
    from airflow.sdk import Variable

    try:
        value = Variable.get(TOPOLOGY_VARIABLE, default=None)
    except Exception:  # outside a task there is no Variable access: fall back to the environment
        value = None
    return str(value or topologies.default_path())


def parse_time_topology() -> Topology | None:
    """The topology seen when a DAG file is parsed ($LR_TOPOLOGY or the shipped file); None if it
    cannot be read (the DAG still parses; its tasks report the problem)."""
    try:
        return topologies.load(os.environ.get(topologies.TOPOLOGY_ENV) or None)
    except Exception:
        return None


def form_choice(values: list[str], pattern: re.Pattern[str], required: bool = False, **schema: Any) -> Any:
    """A form field picking one of ``values`` (a select box; a text field matching ``pattern``
    whole, without a topology). Optional (``required`` False): empty is ``null`` ("every one");
    ``values_display`` labels it with an empty string, or Airflow's form shows the word "null"."""
    from airflow.sdk import Param

    if required:
        constraint: dict[str, Any] = {"enum": values} if values else {"pattern": form_pattern(pattern)}
        return Param(type="string", **constraint, **schema)
    if values:
        return Param(None, type=["null", "string"], enum=[None, *values], values_display={"null": ""}, **schema)
    return Param(None, type=["null", "string"], pattern=form_pattern(pattern), **schema)


def reason_param(default: str, **schema: Any) -> Any:
    """The form's reason of a full sync or failover: what ``checked_reason`` accepts (one line of at
    most ``MAX_REASON_CHARS``), refused at trigger. The form refused only a NUL, so a newline or a
    tab started a run that failed in its first task."""
    from airflow.sdk import Param

    return Param(
        default,
        type="string",
        minLength=1,
        maxLength=MAX_REASON_CHARS,
        pattern=form_pattern(ONE_LINE_PATTERN),  # as ``checked_reason`` records it
        title="Reason",
        **schema,
    )


def load_topology(path: str | None = None) -> Topology:
    return topologies.load(topology_path(path))


def session_dict(topo: Topology, key: SessionKey) -> dict[str, str]:
    return {
        "session": str(key),
        "source": key.source,
        "sink": key.sink,
        "client": key.client,
        "source_conn_id": topo.conn_id(key.source),
        "sink_conn_id": topo.conn_id(key.sink),
    }


def session_dicts(
    topo: Topology, source: str | None = None, sink: str | None = None, client: str | None = None
) -> list[dict[str, str]]:
    return [session_dict(topo, k) for k in topo.sessions(source, sink, client)]


def connect_site(topo: Topology, site_id: str) -> psycopg2.extensions.connection:
    """A connection to a site of the topology through its Airflow connection (the caller closes it)."""
    return LRSiteHook(lr_conn_id=topo.conn_id(site_id)).connect_replication(site_id)


def check_topology(topo: Topology, log: logging.Logger | Any, step: str, sites: Any = None) -> None:
    """Fail the task (``FinalRefusal``: one ERROR line, no retry) when a reachable site of ``sites``
    (default: all) runs another topology than the file the task read: a stale file, named, rather
    than a failure elsewhere. A site whose Airflow connection is not defined here is refused first,
    named: the check skipped it as unreachable, and the task failed later on Airflow's bare
    ``The conn_id ... isn't defined``, under a traceback, after its retries."""
    for site in sorted(topo.sites if sites is None else sites):
        try:
            LRSiteHook(lr_conn_id=topo.conn_id(site)).connection_dict()
        except ConnectionMissing as exc:
            raise refuse(log, step, f"site {site}: {exc}") from None
    try:
        topology.check_sites(topo, lambda site: connect_site(topo, site), sites)
    except TopologyMismatchError as exc:
        raise refuse(log, step, one_line(exc)) from None


def site_dict(topo: Topology, site_id: str) -> dict[str, str]:
    spec = topo.site(site_id)
    return {"site": site_id, "conn_id": topo.conn_id(site_id), "region": spec.region}


def site_dicts(topo: Topology, role: str | None = None) -> list[dict[str, str]]:
    """Sites of the topology: all of them, or only the sources or sinks of some session."""
    sessions = topo.sessions()
    wanted = {None: set(topo.sites), "source": {k.source for k in sessions}, "sink": {k.sink for k in sessions}}[role]
    return [site_dict(topo, s) for s in sorted(wanted)]


def session_key(topo: Topology, session: dict[str, Any]) -> SessionKey:
    """The session a task was handed, checked against the topology it runs with."""
    try:
        key = SessionKey(session["source"], session["sink"], session["client"])
    except (KeyError, TypeError):
        raise ConfigurationError(f"a session is a dict with source, sink and client, not {session!r}") from None
    if key not in topo.sessions():
        raise ConfigurationError(
            f"session {key} is not in the topology (its sessions: {[str(k) for k in topo.sessions()]})"
        )
    return key


def site_conn_id(site_id: str, sessions: list[dict[str, Any]]) -> str:
    """The Airflow connection of a site a task did not expect (the one a switchover asked a full
    sync of instead): as ``sessions`` (session dicts) name it, else the topology, else its id."""
    known = {s[end]: s[f"{end}_conn_id"] for s in sessions for end in ("source", "sink") if f"{end}_conn_id" in s}
    if site_id in known:
        return str(known[site_id])
    try:
        return load_topology().conn_id(site_id)
    except Exception:  # no topology here, or one without that site: the site's id names it
        return site_id


def site_connector(sessions: list[dict[str, Any]]) -> Callable[[str], psycopg2.extensions.connection]:
    """Connections to any site by id (``site_conn_id``), for the engine to follow a moved request."""
    return lambda site_id: LRSiteHook(lr_conn_id=site_conn_id(site_id, sessions)).connect_replication(site_id)


@contextlib.contextmanager
def site_connection(
    conn_id_: str, site_id: str, timeouts: Timeouts | None = None
) -> Iterator[psycopg2.extensions.connection]:
    """An open connection to a site through its Airflow connection (bounded by ``timeouts``, the
    topology's, else the defaults), closed afterwards."""
    conn = LRSiteHook(lr_conn_id=conn_id_, timeouts=timeouts).connect_replication(site_id)
    try:
        yield conn
    finally:
        conn.close()


def spark_unavailable(spark_conn_id: str, job: str) -> str | None:
    """Why this worker cannot run the Spark job ``job`` (a file of ``spark_jobs/``) through the
    Spark connection ``spark_conn_id``; None when it can."""
    from airflow.sdk import BaseHook

    if not (spark_jobs_dir() / job).exists():
        return f"the Spark job is not installed in {spark_jobs_dir()}"
    try:
        BaseHook.get_connection(spark_conn_id)
    except Exception:
        return f"no Spark connection {spark_conn_id!r}"
    return None


class TaskRefused(SystemExit):
    """Ends a task whose step lr refused, after the one line that says why (``refusals_said``).
    Airflow logs a ``SystemExit`` as ``Task exited`` without a traceback; every other exception
    with one, the engine's frames and all, the reason at its bottom. The task fails (and is retried
    only as its ``retries`` say: a failover's re-run finishes or refuses again, changing nothing)."""

    def __init__(self, said: str = "") -> None:
        super().__init__(1)
        self.said = said  # the line the task's log shows (what the task's caller may read)

    def __str__(self) -> str:
        return self.said


class FinalRefusal(TaskRefused):
    """A refusal no retry can mend (a topology file the sites do not run, a refused negotiation, a
    shard's settings): the task fails at once, as ``AirflowFailException`` made it (which Airflow
    logs under a traceback), by ``refusals_final``, the retry policy of the tasks that raise it."""


def refuse(log: logging.Logger | Any, step: str, why: str) -> FinalRefusal:
    """The one ERROR line of a final refusal; raise what it returns."""
    said = f"{step} refused: {why}"
    log.error("%s", said)
    return FinalRefusal(said)


def refusals_final() -> Any:
    """The retry policy of lr's tasks that refuse for good (``FinalRefusal``): failed, not retried."""
    from airflow.sdk.definitions.retry_policy import ExceptionRetryPolicy, RetryAction, RetryRule

    return ExceptionRetryPolicy(
        rules=[RetryRule(exception=FinalRefusal, action=RetryAction.FAIL, reason="refused: a retry changes nothing")]
    )


def final_refusals(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with ``refusals_final`` as their retry policy unless one is given. Not ``setdefault``:
    ``.partial()`` passes ``retry_policy=None`` to a mapped task's operator, so a mapped shard or
    session step (lr_streaming's ``stream``) retried a refusal as often as its ``retries`` said."""
    if kwargs.get("retry_policy") is None:
        kwargs["retry_policy"] = refusals_final()
    return kwargs


def refused_for_good(log: logging.Logger | Any, step: str, exc: BaseException, where: str = "") -> FinalRefusal | None:
    """The failures no retry mends, as a ``FinalRefusal`` (its ERROR line said) to raise; None for
    any other: an Airflow connection not defined, a login without lr's grant (psycopg2's
    ``InsufficientPrivilege``: ``failure`` names the role and the grant to give; or the schema's
    version unreadable for it), the sites on another topology than the file in hand (the engine's
    ``refused_kind``). The one rule of lr's sensors and operators (``finals_refused``; the fan-out
    asks it of each session its plan could not take up; a Spark job's result carries the kinds,
    ``refused_in_result``); ``where`` (``"source site-a: "``) prefixes the reason."""
    if isinstance(exc, ConnectionMissing):  # waiting or retrying would not define it
        return refuse(log, step, f"{where}{one_line(exc)}")
    kind = refused_kind(exc)
    if kind is None:
        return None
    said = without_statement(failure(exc)) if isinstance(exc, psycopg2.Error) else one_line(exc)
    return refuse(log, step, f"{where}{said}")


def refused_in_result(log: logging.Logger | Any, step: str, result: dict[str, Any]) -> FinalRefusal | None:
    """``refused_for_good`` of a Spark job's result, which carries its errors as words and their
    kinds (``error_kind``: the job's own error's; ``refused``: each session's): a ``FinalRefusal``
    naming them when any is one no retry mends; None otherwise. Before, ``LRSparkFanOutOperator`` retried a
    login without lr's grant as if transient: the job's errors were strings, not exceptions."""
    if result.get("error_kind"):
        return refuse(log, step, without_statement(str(result.get("error") or result["error_kind"])))
    errors = result.get("errors") or {}
    refused = sorted((result.get("refused") or {}).items())
    if not refused:
        return None
    return refuse(log, step, "; ".join(f"session {s}: {without_statement(str(errors.get(s, k)))}" for s, k in refused))


@contextlib.contextmanager
def finals_refused(log: logging.Logger | Any, step: str, where: str = "") -> Iterator[None]:
    """The failures no retry mends (``refused_for_good``) refused for good (``FinalRefusal``, under
    ``refusals_final``); any other passes. Before, an operator's step failing on a privilege was
    retried as if transient, each retry the same."""
    try:
        yield
    except Exception as exc:
        final = refused_for_good(log, step, exc, where)
        if final is None:
            raise
        raise final from None


@contextlib.contextmanager
def refusals_said(log: logging.Logger | Any, step: str) -> Iterator[None]:
    """lr's refusals of ``step`` (its own errors, and a site's: a lock an application holds) as one
    ERROR line in the task's log, as ``lr`` prints them, then the task fails without a traceback;
    those no retry mends (``finals_refused``) for good. Before, the ``lr_failover`` task logged a
    refusal (a site without a consistent copy, a table the new source lacks, an unreachable sink)
    under a traceback through the engine."""
    try:
        with finals_refused(log, step):  # a ``FinalRefusal`` (a SystemExit) passes the clauses below
            yield
    except LRError as exc:
        said = f"{step} refused: {one_line(exc)}"
        log.error("%s", said)
        raise TaskRefused(said) from None
    except psycopg2.Error as exc:
        said = f"{step} refused: {without_statement(failure(exc))}"
        log.error("%s", said)
        raise TaskRefused(said) from None
