"""What a session's movers are tuned by: ``SessionSettings`` (cycles, the tee, the Spark jobs, the
nearest copy), ``StreamSettings`` (the stream) and the measured thresholds behind their defaults.

One module, so a threshold, its topology setting and its default are read side by side; the
measurements behind each default are in docs/spark.md "Thresholds and how they were measured", and
the rules that compare them are ``session/catchup.py``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from airflow_provider_lr.engine.errors import ConfigurationError, require_counts
from airflow_provider_lr.engine.session.lease import DEFAULT_LEASE_SECONDS
from airflow_provider_lr.engine.source.full_sync import DEFAULT_DATA_TIMEOUT
from airflow_provider_lr.engine.source.log_reader import DEFAULT_MAX_BYTES, DEFAULT_MAX_ENTRIES

SNAPSHOT_CHUNK = 5_000  # snapshot messages per sink transaction during transfer
SNAPSHOT_CHUNK_BYTES = 8 << 20  # ... and their bytes (at least one message): memory bounded by bytes
MAX_BACKOFF_FACTOR = 16  # data timeout grows x2 per consecutive timeout, up to this factor
# The thresholds; topology settings of the same names override them (docs/spark.md "Thresholds").
TEE_MIN_BACKLOG = 50_000  # deliveries from which a catch-up is teed once in its own process
SPARK_MIN_BACKLOG = 800_000  # deliveries from which a catch-up goes through Spark where it can run
TABLE_SPARK_MIN_ROWS = 10_000_000  # a table snapshot this large (planner's estimate) is left to Spark
SNAPSHOT_SPARK_MIN_ENTRIES = 1_000_000  # a full-sync transfer this large is left to Spark
STAGED_MIN_TASKS = 4  # cores from which the Spark fan-out tees chunks at once (bulk/staged_tee.py)
PROBE_DELAY = 2.0  # seconds the first peer has to answer (nearest copy); each next one gets twice as long
# Replicator members (``session/membership``): a heartbeat this often; a member whose heartbeat is
# older than ``MEMBER_DEAD_AFTER`` is dead even with its lock held (a process that hangs). A member
# that exits (killed or not) is dead at once: its lock goes with its connection.
MEMBER_HEARTBEAT = 0.5
MEMBER_DEAD_AFTER = 5.0


class Configured(Protocol):
    """Where settings come from: a topology's ``settings:`` (``Topology.setting``)."""

    def setting(self, name: str, default: Any) -> Any: ...


@dataclass
class SessionSettings:
    max_entries: int = DEFAULT_MAX_ENTRIES
    max_bytes: int = DEFAULT_MAX_BYTES
    max_batches: int = 100  # log-entry batches per cycle (fairness between sessions)
    lease_seconds: float = DEFAULT_LEASE_SECONDS
    data_timeout: float = DEFAULT_DATA_TIMEOUT
    barrier_timeout: float = 5.0
    tee_min_backlog: int = TEE_MIN_BACKLOG  # 0: never tee, session cycles only
    spark_min_backlog: int = SPARK_MIN_BACKLOG  # where Spark can run (the DAG); lr sync runs none
    table_spark_min_rows: int = TABLE_SPARK_MIN_ROWS  # a table snapshot this large goes to Spark (the DAG)
    snapshot_spark_min_entries: int = (
        SNAPSHOT_SPARK_MIN_ENTRIES  # a full-sync transfer this large goes to Spark (the DAGs)
    )
    fanout_tasks: int = 0  # chunks the Spark fan-out tees at once (1: in order; 0: by the cluster's cores)
    nearest_copy: bool = True  # a client of tables only may be seeded from a peer sink in its region
    peer_probe_delay: float = PROBE_DELAY  # seconds the first peer has to answer (x2 each next)
    member_heartbeat: float = MEMBER_HEARTBEAT  # seconds between a replicator member's heartbeats
    member_dead_after: float = MEMBER_DEAD_AFTER  # a member's heartbeat this old: dead

    def __post_init__(self) -> None:  # a batch of 0 would make every cycle a silent no-op
        require_counts(max_entries=self.max_entries, max_bytes=self.max_bytes, max_batches=self.max_batches)
        if self.member_dead_after <= self.member_heartbeat:  # every member would look dead between beats
            raise ConfigurationError(
                f"member_dead_after_s ({self.member_dead_after}) must be longer than member_heartbeat_s "
                f"({self.member_heartbeat})"
            )

    @classmethod
    def from_topology(cls, topology: Configured, **overrides: object) -> SessionSettings:
        """The settings a topology asks for (``settings:`` in its YAML), with explicit overrides."""
        values: dict[str, object] = {
            "data_timeout": topology.setting("full_sync_data_timeout_s", DEFAULT_DATA_TIMEOUT),
            "lease_seconds": topology.setting("lease_seconds", DEFAULT_LEASE_SECONDS),
            "tee_min_backlog": topology.setting("tee_min_backlog", TEE_MIN_BACKLOG),
            "spark_min_backlog": topology.setting("spark_min_backlog", SPARK_MIN_BACKLOG),
            "table_spark_min_rows": topology.setting("table_spark_min_rows", TABLE_SPARK_MIN_ROWS),
            "snapshot_spark_min_entries": topology.setting("snapshot_spark_min_entries", SNAPSHOT_SPARK_MIN_ENTRIES),
            "fanout_tasks": topology.setting("fanout_tasks", 0),
            "nearest_copy": topology.setting("nearest_copy", True),
            "peer_probe_delay": topology.setting("peer_probe_delay_s", PROBE_DELAY),
            "member_heartbeat": topology.setting("member_heartbeat_s", MEMBER_HEARTBEAT),
            "member_dead_after": topology.setting("member_dead_after_s", MEMBER_DEAD_AFTER),
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


BUSY_RATE_PER_CORE = 1000.0  # ``StreamSettings.busy_rate``'s default, per core


@dataclass
class StreamSettings:
    """How a stream waits and how often it looks around (seconds)."""

    # With nothing to read a stream sleeps until a commit wakes it (``stream_read``), at most
    # ``sleep_max`` at a time (joins, leaves and a stop are seen within it). When it cannot sleep
    # (a writer is committing, or another stream of the source sleeps) it looks again after a
    # pause of ``poll_min``, doubling up to ``poll_max`` while nothing comes.
    sleep_max: float = 0.05
    poll_min: float = 0.0002
    poll_max: float = 0.01
    ack_interval: float = 0.2  # acknowledged position recorded on the source at most this often
    check_interval: float = 1.0  # lease renewed, topology and full-sync requests checked
    gap_timeout: float = 0.05  # a missing position this old is resolved with the commit barrier
    # Under load (the sessions' deliveries arrive at ``busy_rate`` per second or more over the last
    # 0.1 s: ``RateWindow``), wait before reading again: the last round's time times the square of
    # the load (rate / busy_rate), at most ``linger``. A read and a sink transaction cost about the
    # same for one entry as for dozens: at the busy rate the stream spends half its time in rounds,
    # at twice it a fifth, and at a machine's limit it waits ``linger``, so batches grow with the
    # load and the writers keep the CPU; below it every commit is read at once (docs/streaming.md).
    # The rate where a machine is that busy grows with its cores: 1,000 deliveries/s per core (2,000
    # on 2 cores, where it was measured; with more, a modest rate is not made to wait for cores it has).
    busy_rate: float = field(default_factory=lambda: BUSY_RATE_PER_CORE * cores())
    linger: float = 0.02
    # After a round that delivered, the stream reads again at once (the read says what a probe
    # would) while deliveries arrive at ``reread_rate`` per second or more; below it it probes: the
    # probe, one round trip like the read, sleeps at once when nothing was drawn, where the read
    # found nothing and the probe followed (at 100 commits/s, a third of the source's round trips).
    reread_rate: float = 1000.0
    # A session whose cycle fails (a site down, a lock or statement timeout) is retried after
    # ``retry_min``, doubling with each failure in a row up to ``retry_max``; a stream that fails is
    # renegotiated at once.
    retry_min: float = 1.0
    retry_max: float = 30.0
    # ... and up to this when the failing cycles made nobody wait (refused at once: a server
    # restarting, a lock timeout), so a site back from a restart is retried within it
    retry_max_quick: float = 5.0
    # A stream's call to a sink that takes longer than this is cut (the sink stopped, or its link
    # half-open) and that sink's sessions are handed back to the cycles, whose calls have the
    # topology's longer bounds: the stream writes the source's other sinks in the same rounds, so
    # without it one silent sink would hold them all for its whole call deadline (statement
    # timeout + link check: 145 s by default). A stream's sink calls are small (a batch, a handshake,
    # a WAL position): a slow one only moves its session to the cycles for a while.
    sink_deadline: float = 10.0
    # A round waits this long for its sinks' writes; one not done by then stays in flight while the
    # stream carries the other sinks' sessions on, its own sessions out of the rounds until it ends:
    # one slow or silent sink holds the others this long once, not ``sink_deadline``. With all of a
    # stream's sessions on one sink site nothing is held: its round waits for the write.
    sink_patience: float = 0.2
    # A stop waits this long, in all, for the source streams to end (each records its last ack and
    # releases its leases). A stream whose source stopped answering (a frozen server) is left
    # behind after it: nothing is lost (each sink holds its position), its leases are taken by the
    # next replicator as a dead member's (docs/operations.md "Hung calls").
    stop_within: float = 5.0


class RateWindow:
    """Entries per second over the last whole window (``seconds``): a burst of commits inside a
    window does not make a stream at a modest rate linger, a sustained rate does."""

    def __init__(self, seconds: float = 0.1) -> None:
        self.seconds, self.rate = seconds, 0.0
        self._start, self._count = time.monotonic(), 0

    def add(self, entries: int) -> float:
        """Count ``entries`` read now; the rate of the last whole window."""
        self._count += entries
        now = time.monotonic()
        if now - self._start >= self.seconds:
            self.rate = self._count / (now - self._start)
            self._start, self._count = now, 0
        return self.rate
