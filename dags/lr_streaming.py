"""lr_streaming: the streaming replicator under Airflow (milliseconds from commit to the sinks),
one long-running task per shard.

``shards`` cuts the topology's sessions (of one ``source``, when the form names one) into shards:
one per source, and a source with more than ``sessions_per_shard`` sessions (when set) into
groups of that many at most. ``stream`` (``LRStreamOperator``) is mapped over them: one task
instance per shard, listed by its name (``site-a``, or ``site-a 2/3`` for a split source), each
running ``lr sync``'s streaming mode for its shard's sessions only. A Celery or Kubernetes
executor spreads them over its workers; the sessions' leases keep the shards (and any ``lr sync``
beside them) off each other's sessions.

Each stream task streams for ``run_for_seconds`` and ends; the run ends when every shard's task
has, and the ``@continuous`` schedule starts the next run at once (the shards computed again: a
topology change is picked up), so replication never stops for longer than a task start, and
every run is fresh and restartable (the sinks' own positions make the seams exact).

A shard whose every session failed the whole run fails, alone (the run shows red, the other
shards delivered) and is not retried: the next run streams it again. A shard that crashed (a lost
worker, an error of the task itself) is retried alone (3 tries, 10 s apart) for what is left of
the run's ``run_for``, so that every shard of a run ends at about the same time.

It holds one worker slot per shard all the time. Use it *instead of* scheduled ``lr_replication``
runs when lag matters (both at once are safe, the leases keep them apart, but ``lr_replication``
would then mostly find its sessions leased). ``lr_replication`` stays for batch users: it holds
no slot between runs, and its lag is its schedule interval. Paused when created: unpause it to
stream.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from airflow.sdk import Param, dag, get_current_context, task

from airflow_provider_lr.engine.db.topology_schema import SITE_ID_PATTERN
from airflow_provider_lr.operators.common import form_choice, parse_time_topology, refusals_final
from airflow_provider_lr.operators.stream import MAX_RUN_FOR, SHARD_LABEL, LRStreamOperator

_topology = parse_time_topology()
SOURCES = sorted({k.source for k in _topology.sessions()}) if _topology else []


@dag(
    dag_id="lr_streaming",
    schedule="@continuous",
    start_date=datetime(2026, 1, 1, tzinfo=timezone.utc),
    catchup=False,
    max_active_runs=1,
    is_paused_upon_creation=True,
    render_template_as_native_obj=True,
    tags=["lr", "replication", "streaming"],
    doc_md=__doc__,
    default_args={"retries": 3, "retry_delay": timedelta(seconds=10)},
    params={
        "run_for_seconds": Param(
            600,
            type="integer",
            minimum=1,
            maximum=MAX_RUN_FOR,
            title="Run for (seconds)",
            description="How long one run streams before it ends and the next run starts",
        ),
        "source": form_choice(
            SOURCES,
            SITE_ID_PATTERN,
            title="Source",
            description="Only this source's sessions (empty: every session of the topology)",
        ),
        "sessions_per_shard": Param(
            None,
            type=["null", "integer"],
            minimum=1,
            title="Sessions per shard",
            description="Split a source with more sessions than this into shards of at most this "
            "many, one stream task each (empty: one shard per source)",
        ),
        "report_every_seconds": Param(
            30,
            type="integer",
            minimum=0,
            title="Progress line every (seconds)",
            description="A line in the task log with entries/s and the lag of the "
            "session most behind, this often (0: none)",
        ),
    },
)
def lr_streaming() -> None:
    @task(retry_policy=refusals_final())  # a choice the topology refuses: one ERROR line, no retry
    def shards() -> list[dict]:
        """The shards of this run, from the topology the run uses; each one's sessions in the log."""
        from airflow_provider_lr.engine.errors import ConfigurationError, one_line
        from airflow_provider_lr.operators.common import load_topology, refuse
        from airflow_provider_lr.operators.stream import shard_sessions, stream_shards

        params = get_current_context()["params"]
        topo = load_topology()
        try:
            found = stream_shards(topo, params.get("source") or None, params.get("sessions_per_shard"))
        except ConfigurationError as exc:
            raise refuse(get_current_context()["ti"].task.log, "lr streaming shards", one_line(exc)) from None
        for shard in found:
            keys = shard_sessions(topo, shard["source"], shard["sessions"])
            print(f"shard {shard['shard']}: {len(keys)} sessions: {', '.join(map(str, keys))}")
        return found

    LRStreamOperator.partial(
        task_id="stream",
        run_for="{{ params.run_for_seconds }}",
        report_every="{{ params.report_every_seconds }}",
        map_index_template=SHARD_LABEL,
    ).expand_kwargs(shards())


lr_streaming()
