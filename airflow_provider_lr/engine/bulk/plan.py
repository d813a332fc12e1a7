"""What one fan-out run moves and what comes back (``bulk/fanout.py`` has the run): the plan the
driver makes and ships to wherever the chunks are teed, and the small results they return.
Picklable, so a Spark task can carry them; DSNs travel inside the plan and are never shown."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

import psycopg2.extensions

from airflow_provider_lr.engine.db.conninfo import connect_dsn
from airflow_provider_lr.engine.db.timeouts import DEFAULT, BoundedConnection, Purpose, Timeouts
from airflow_provider_lr.engine.session.handshake import Position
from airflow_provider_lr.engine.vocabulary import SessionKey

MAX_DEMANDS = 63  # one bit per demand in the source-side bigint mask (``bulk/router.py``)


@dataclass(frozen=True)
class Demand:
    """One session in log-entry sync: what its sink still needs."""

    source: str
    sink: str
    client: str
    client_id: int
    tag_id: int
    position: Position  # the session's handshake: sink position, base, split, lease epoch

    @property
    def session(self) -> str:
        return str(SessionKey(self.source, self.sink, self.client))


@dataclass(frozen=True)
class PositionRange:
    """One partition: commit positions ``(lo, hi]`` holding about ``entries`` log entries."""

    index: int
    lo: int
    hi: int
    entries: int


@dataclass(frozen=True)
class FanoutPlan:
    """What one fan-out run moves. Picklable; DSNs are shipped inside it to the partitions and
    never shown (``repr``/``describe`` leave them out)."""

    plan_id: str
    source: str
    lo: int
    end: int
    barrier: int
    demands: tuple[Demand, ...]
    ranges: tuple[PositionRange, ...]
    source_dsn: str = field(repr=False)
    sink_dsns: Mapping[str, str] = field(repr=False)
    skipped: Mapping[str, str] = field(default_factory=dict)  # not the fan-out's to do now (lease held, snapshot)
    # sessions whose handshake failed (a grant missing, a schema too old, a refusal, a site down):
    # not delivered, so the run is not ok (before, they were "skipped" and a task that delivered
    # nothing succeeded)
    errors: Mapping[str, str] = field(default_factory=dict)
    blocked_by: tuple[str, ...] = ()
    faults: str | None = field(default=None, repr=False)  # $LR_FAULT of the driver (tests)
    staged: bool = False  # chunks teed at once, staged and published in order (``bulk/staged_tee.py``)
    # the topology's bounds, for the tee's connections (a DSN carries the server's and the socket's,
    # not the heartbeat's: a call on a stopped site is cut once the heartbeat finds it lost)
    timeouts: Timeouts = field(default=DEFAULT, repr=False)

    @property
    def entries(self) -> int:
        return sum(r.entries for r in self.ranges)

    def connect(self, site: str) -> psycopg2.extensions.connection:
        """A bulk connection to the plan's source or one of its sinks, with the topology's bounds,
        named by its site (a call cut there says which site stopped answering)."""
        conn = connect_dsn(
            self.source_dsn if site == self.source else self.sink_dsns[site], Purpose.BULK, self.timeouts
        )
        if isinstance(conn, BoundedConnection):
            conn.site = site
        return conn

    def describe(self) -> str:
        sessions = ", ".join(f"{d.session}@{d.position.after}" for d in self.demands) or "none"
        return (
            f"plan {self.plan_id[:8]} of {self.source}: positions ({self.lo}, {self.end}] "
            f"barrier {self.barrier}, {self.entries} entries in {len(self.ranges)} partitions"
            f"{' (staged, teed at once)' if self.staged else ''}; "
            f"sessions {sessions}"
        )


@dataclass
class ChunkResult:
    """What one chunk did (small: it is all a Spark task returns to the driver)."""

    index: int
    lo: int
    hi: int
    read: int = 0  # log entries read from the source
    delivered: dict[str, int] = field(default_factory=dict)  # session -> entries made visible (0: already done)
    staged: dict[str, int] = field(default_factory=dict)  # session -> entries staged (``bulk/staged_tee.py``)
    positions: dict[str, int] = field(default_factory=dict)  # session -> sink's last processed after it
    errors: dict[str, str] = field(default_factory=dict)  # session -> why it was refused
    seconds: float = 0.0
    peak_rss_kb: int = 0  # of the process that ran it (an executor's Python worker)
    jvm_peak_kb: int = 0  # of the executor JVM it ran under (set by the Spark job)
    pid: int = 0
    attempt: int = 0  # the task attempt that returned it (> 0: a retry or speculative copy)


@dataclass
class FanoutResult:
    """What a whole run did, summed up by the driver (the Spark job's ``LR_RESULT``, a task's XCom)."""

    plan_id: str
    source: str
    lo: int
    end: int
    deliveries: dict[str, int] = field(default_factory=dict)  # session -> entries made visible
    positions: dict[str, int] = field(default_factory=dict)  # session -> sink's last processed
    errors: dict[str, str] = field(default_factory=dict)
    # session -> the kind of its error no retry mends (``db/explained.refused_kind``), for an adapter's rule
    refused: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    blocked_by: list[str] = field(default_factory=list)  # what held the commit barrier back
    partitions: int = 0  # chunks
    paused: bool = False  # stopped between chunks (a stop, the replicator's turn): the rest is the next run's
    retried: int = 0  # chunks whose result came from a task retry or a speculative copy
    entries_read: int = 0
    seconds: dict[str, float] = field(default_factory=dict)  # plan, tee, finish
    peak_rss_kb: dict[str, int] = field(default_factory=dict)  # driver, executors

    @property
    def ok(self) -> bool:
        return not self.errors

    def as_dict(self) -> dict:
        return {**asdict(self), "total_deliveries": sum(self.deliveries.values()), "ok": self.ok}
