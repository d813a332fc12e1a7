"""Delivery of transmitted entries, derived from positions (Qpid HA's delivery states; DistributedLog's regions).

A transmit's **ticket** names its transaction; at commit the transaction gets its commit position
P. Per destination the transaction's entries named, the entry is

* **new**: committed here, its sink does not hold it yet;
* **sent**: the sink's receive queue holds it (its processed position passed P) but the source has
  not recorded the acknowledgement yet (only known when the sink was read);
* **safe**: the source recorded the sink's acknowledgement of a position >= P (the sink
  acknowledges after its durable commit);
* **delayed** / **delayed-sent**: not safe yet, and a producer waits on it (a *guard*).

Nothing is written per transmit: the states come from the session's acknowledged position, the
sink's processed position and the guards, which exist only while somebody waits. A destination
that an entry did not name is never counted, for delivery or for regions.

A destination is **ready** when everything committed for it before its first guarded position is
safe (without a guard: everything committed for it), counted live when asked. Regions: an entry
is stored in the source's region (committed there) and in the region of every sink it named that
acknowledged it.
"""

from __future__ import annotations

import enum
import math
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import psycopg2.extensions

from airflow_provider_lr.engine.errors import ConfigurationError, DeliveryTimeout, TransmitError, require_site_ids
from airflow_provider_lr.engine.source.commit_barrier import LAST_DRAWN_POSITION_SQL
from airflow_provider_lr.engine.source.delivery_trimmed import acknowledged_before_trim
from airflow_provider_lr.engine.source.moved import unreplicated
from airflow_provider_lr.engine.store import source_sessions
from airflow_provider_lr.engine.store.topology import applied_durability
from airflow_provider_lr.engine.vocabulary import STREAM_LOG_ENTRIES, STREAM_TABLE_CHANGES

GUARD_GRACE_S = 60.0  # a guard outlives its wait's timeout by this much (a waiter that died)
EVERY_NAMED_SINK = 1_000_000  # durable_position's min_regions for "acknowledged by every sink it named"
T = TypeVar("T")  # what ``poll``'s check returns


class DeliveryState(str, enum.Enum):
    NEW = "new"
    SENT = "sent"
    DELAYED = "delayed"
    DELAYED_SENT = "delayed-sent"
    SAFE = "safe"


@dataclass(frozen=True)
class Ticket:
    """What a transmit returns: its transaction, and the destinations its entries named. Wait on
    it after commit (``RoutingQueueClient.wait_until_safe``)."""

    source: str
    client: str
    tx: int
    destinations: tuple[str, ...]

    def __str__(self) -> str:
        return f"transaction {self.tx} of {self.client!r} at {self.source!r}"


@dataclass(frozen=True)
class DurabilityRule:
    """The topology's ``durability`` (DistributedLog's region-aware rule): an entry is durable once ``ack_quorum`` sites
    (the source counts: it is committed there) hold it, in at least ``min_regions_for_durability``
    distinct regions. ``write_quorum`` is how many sites each entry is meant to reach."""

    min_regions_for_durability: int = 1
    ack_quorum: int = 1
    write_quorum: int | None = None


@dataclass
class Delivery:
    """One ticket's delivery, as read at one moment."""

    position: int
    source_region: str
    states: dict[str, DeliveryState]  # per destination the entry named
    regions: dict[str, str]  # sink -> region, for those destinations
    acked: dict[str, int] = field(default_factory=dict)

    @property
    def safe_on(self) -> list[str]:
        return sorted(d for d, s in self.states.items() if s is DeliveryState.SAFE)

    @property
    def stored_regions(self) -> list[str]:
        """The distinct regions holding the entry: the source's and its safe destinations'."""
        return sorted({self.source_region, *(self.regions[d] for d in self.safe_on)})

    def pending(self, destinations: Sequence[str]) -> list[str]:
        return sorted(d for d in destinations if self.states.get(d) is not DeliveryState.SAFE)

    def as_dict(self) -> dict:
        return {
            "position": self.position,
            "states": {d: s.value for d, s in sorted(self.states.items())},
            "safe_on": self.safe_on,
            "regions": self.stored_regions,
        }


@dataclass(frozen=True)
class WaitFor:
    """What a wait asks for: every one of ``destinations`` safe, at least ``min_regions`` distinct
    regions holding it, and at least ``ack_quorum`` sites (the source included)."""

    destinations: tuple[str, ...] = ()
    min_regions: int = 0
    ack_quorum: int = 0

    def met(self, delivery: Delivery) -> bool:
        return (
            not delivery.pending(self.destinations)
            and len(delivery.stored_regions) >= self.min_regions
            and 1 + len(delivery.safe_on) >= self.ack_quorum
        )

    def describe(self) -> str:
        parts = [f"safe on {list(self.destinations)}"] if self.destinations else []
        if self.min_regions:
            parts.append(f"stored in >= {self.min_regions} regions")
        if self.ack_quorum > 1:
            parts.append(f"held by >= {self.ack_quorum} sites")
        return " and ".join(parts) or "nothing"


def durability_rule(conn: psycopg2.extensions.connection) -> DurabilityRule | None:
    """The ``durability`` of the topology applied to this site, or None without one."""
    rule = applied_durability(conn)
    return DurabilityRule(**rule) if rule else None


def check_targets(destinations: Iterable[str], min_regions: int | None = None) -> list[str]:
    """``destinations`` as a list, read once (a generator's second read is empty: a wait for nothing);
    refused, targets a producer's wait could not mean: one site id as a bare string (read letter by
    letter), a ``min_regions`` that is not a whole number >= 0."""
    named = require_site_ids("destinations", destinations)
    if min_regions is not None and (
        isinstance(min_regions, bool) or not isinstance(min_regions, int) or min_regions < 0
    ):
        raise ConfigurationError(f"min_regions must be a whole number >= 0, not {min_regions!r}")
    return named


def check_timeout(timeout: float) -> None:
    """Refuse a wait's timeout that is not a finite number of seconds >= 0: every wait is bounded."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout < math.inf:
        raise ConfigurationError(f"timeout must be a finite number of seconds, at least 0, not {timeout!r}")


def wait_for(
    addressed: dict[str, str],
    source_region: str,
    destinations: Sequence[str] = (),
    min_regions: int | None = None,
    rule: DurabilityRule | None = None,
) -> WaitFor:
    """Validate what a caller waits for against the sinks the entry named (``addressed``: sink ->
    region). Refused with ``ConfigurationError``: a destination the entry was not sent to, and a
    ``min_regions`` (or the topology's rule, the default when nothing is named) that the named
    sinks could never reach. Nothing named and no rule: every named destination."""
    destinations = check_targets(destinations, min_regions)
    unknown = sorted(set(destinations) - set(addressed))
    if unknown:
        raise ConfigurationError(
            f"the entry was not sent to {unknown}: it named {sorted(addressed)}; "
            "a sink it did not name can never acknowledge it"
        )
    regions = {source_region, *addressed.values()}
    if destinations or min_regions:
        target = WaitFor(tuple(sorted(destinations)), min_regions or 0)
    elif rule is not None:
        target = WaitFor((), rule.min_regions_for_durability, rule.ack_quorum)
        if rule.ack_quorum > 1 + len(addressed):
            raise ConfigurationError(
                f"the topology's ack_quorum {rule.ack_quorum} can never be met: the entry is held by the source and "
                f"the {len(addressed)} sink(s) it named {sorted(addressed)}; name more destinations or wait for "
                "named ones (destinations=...)"
            )
    else:
        target = WaitFor(tuple(sorted(addressed)))
    if target.min_regions > len(regions):
        raise ConfigurationError(
            f"min_regions={target.min_regions} can never be met: the source's region and those of the sinks the entry "
            f"named {sorted(addressed)} are only {len(regions)}: {sorted(regions)}; name destinations in more regions "
            "or lower min_regions"
        )
    return target


# --- reading states ---------------------------------------------------------------------------
def commit_position(conn: psycopg2.extensions.connection, tx: int | str) -> int | None:
    """The commit position of a transaction; None until it has committed with log entries (or if
    it rolled back, or was trimmed)."""
    with conn.cursor() as cur:
        cur.execute("SELECT lr.commit_position_of(%s::pg_catalog.text::pg_catalog.xid8)", (str(tx),))
        row = cur.fetchone()
    conn.commit()
    return row[0] if row and row[0] is not None else None


def addressed_sinks(
    conn: psycopg2.extensions.connection, client: str, position: int, destinations: Sequence[str] | None = None
) -> tuple[dict[str, str], str]:
    """(sink -> region for the sinks the entries at ``position`` named — ``destinations`` when the
    caller knows them from the ticket —, the source's region)."""
    with conn.cursor() as cur:
        cur.execute("SELECT region FROM lr.site_info")
        source_region = cur.fetchone()[0]
        if destinations is None:
            cur.execute(
                "SELECT DISTINCT r.site_id, r.region FROM lr.log_commits c JOIN lr.log_entries e ON e.tx = c.tx "
                "JOIN lr.clients k ON k.client_id = e.client_id AND k.client_name = %s "
                "JOIN lr.remote_sites r ON r.tag_id = ANY (e.tag_ids) "
                "WHERE c.position = %s AND e.stream IN (%s, %s)",
                (client, position, STREAM_LOG_ENTRIES, STREAM_TABLE_CHANGES),
            )
        else:
            cur.execute("SELECT site_id, region FROM lr.remote_sites WHERE site_id = ANY (%s)", (list(destinations),))
        found = dict(cur.fetchall())
    conn.commit()
    return found, source_region


def read_delivery(
    conn: psycopg2.extensions.connection,
    client: str,
    position: int,
    addressed: dict[str, str],
    source_region: str,
    sink_positions: dict[str, int] | None = None,
) -> Delivery:
    """The states of the entry at ``position`` on each sink it named. ``sink_positions`` (sink ->
    its processed position, read from the sinks) tells *sent* from *new*; without it an entry not
    yet acknowledged is *new* (or *delayed*)."""
    with conn.cursor() as cur:
        acked = source_sessions.acked_positions(cur, client)
        cur.execute(
            "SELECT DISTINCT unnest(destinations) FROM lr.delivery_guards "
            "WHERE client_name = %s AND position <= %s AND expires_at > now()",
            (client, position),
        )
        guarded = {d for (d,) in cur.fetchall()}
        # a table opened while a stream ran is read past until its snapshot: the sink's ack does not
        # cover its change until its session notes holding the table (docs/delivery.md)
        unsettled = source_sessions.tables_unsettled(cur, client, position)
    conn.commit()
    states = {}
    for sink in addressed:
        if acked.get(sink, -1) >= position and sink not in unsettled:
            states[sink] = DeliveryState.SAFE
            continue
        sent = sink_positions is not None and sink_positions.get(sink, -1) >= position
        if sink in guarded:
            states[sink] = DeliveryState.DELAYED_SENT if sent else DeliveryState.DELAYED
        else:
            states[sink] = DeliveryState.SENT if sent else DeliveryState.NEW
    return Delivery(position, source_region, states, dict(addressed), {s: acked.get(s, -1) for s in addressed})


def resolve(conn: psycopg2.extensions.connection, ticket: Ticket) -> int:
    """The ticket's commit position; ``TransmitError`` while its transaction has not committed."""
    if not isinstance(ticket, Ticket):  # (None: a transmit of no message)
        raise ConfigurationError(f"not a {type(ticket).__name__}: give the Ticket a transmit returned")
    if conn.get_transaction_status() != psycopg2.extensions.TRANSACTION_STATUS_IDLE:
        raise TransmitError(f"{ticket}: commit the transaction before waiting on its ticket (lr never commits for you)")
    position = commit_position(conn, ticket.tx)
    if position is None:
        raise TransmitError(
            f"{ticket} has no commit position: it rolled back, has not committed, or its entries were trimmed"
        )
    _refuse_unreplicated(conn, ticket.client, position)
    return position


def _refuse_unreplicated(conn: psycopg2.extensions.connection, client: str, position: int) -> None:
    """``TransmitError`` for an entry a failover left behind at its old source: a session the site
    has now (after a fail-back) has positions past it, yet never carried it; and for any entry of a
    client this site has no session of (a switchover moved it away): nothing here can acknowledge
    it, so a wait would only time out, naming sinks that may well hold it."""
    note = unreplicated(conn, client, position)
    if note is not None:
        raise TransmitError(f"the entries of client {client!r} at commit position {position} were {note}")
    with conn.cursor() as cur:
        tracked = source_sessions.acked_positions(cur, client)
    conn.commit()
    if not tracked:
        raise TransmitError(
            f"client {client!r} has no session from this site any more (the topology applied here, e.g. after a "
            f"failover or switchover, replicates it from elsewhere): its entry at commit position {position} is "
            "not tracked here; `lr status` at its sinks says what they hold"
        )


def ticket_delivery(
    conn: psycopg2.extensions.connection, ticket: Ticket, sink_positions: dict[str, int] | None = None
) -> Delivery:
    """The states of a committed ticket's entries on each destination it named."""
    position = resolve(conn, ticket)
    addressed, region = addressed_sinks(conn, ticket.client, position, ticket.destinations)
    return read_delivery(conn, ticket.client, position, addressed, region, sink_positions)


def delivered(
    conn: psycopg2.extensions.connection,
    client: str,
    position: int,
    destinations: Sequence[str] = (),
    min_regions: int | None = None,
) -> Delivery | None:
    """The entry at commit ``position`` once it is safe where asked (``wait_for``'s rule, the
    sinks it named read from the log), else None: one check of a wait that polls (the Airflow
    sensor and its trigger)."""
    _refuse_unreplicated(conn, client, position)
    addressed, region = addressed_sinks(conn, client, position)
    if not addressed:
        wanted, rule = check_targets(destinations, min_regions), durability_rule(conn)
        trimmed = acknowledged_before_trim(conn, client, position, wanted, bool(min_regions or rule))
        if trimmed is not None:  # a safe trim removed it once every sink had acknowledged it
            regions, acked = trimmed
            found = Delivery(position, region, dict.fromkeys(acked, DeliveryState.SAFE), regions, acked)
            return found if wait_for(regions, region, wanted, min_regions, rule).met(found) else None
        raise ConfigurationError(
            f"no log entry of client {client!r} at commit position {position} "
            "(not committed yet, another client's, or trimmed)"
        )
    target = wait_for(addressed, region, destinations, min_regions, durability_rule(conn))
    found = read_delivery(conn, client, position, addressed, region)
    return found if target.met(found) else None


def shortfall(
    conn: psycopg2.extensions.connection,
    client: str,
    position: int,
    destinations: Sequence[str] = (),
    min_regions: int | None = None,
) -> tuple[str, list[str]]:
    """What the entry at ``position`` still lacks of ``delivered``'s target, as ``wait_until_safe``
    says it at its timeout, and the sinks that have not acknowledged it: what a wait that gives up
    (the Airflow trigger) says, and whose sessions it asks about."""
    addressed, region = addressed_sinks(conn, client, position)
    target = wait_for(addressed, region, destinations, min_regions, durability_rule(conn))
    missing, lacks = _lacking(read_delivery(conn, client, position, addressed, region), target, addressed)
    return f"position {position} not {target.describe()}: {lacks}", missing


def _lacking(found: Delivery, target: WaitFor, addressed: dict[str, str]) -> tuple[list[str], str]:
    """The sinks ``target`` waits on that lack ``found``, and what a wait that gives up says of it."""
    missing = found.pending(target.destinations or sorted(addressed))
    safe, stored = found.safe_on or "none", found.stored_regions
    return missing, f"not acknowledged by {missing or 'none'}, safe on {safe}, stored in regions {stored}"


# --- guards and the synchronous wait ----------------------------------------------------------
def add_guard(
    conn: psycopg2.extensions.connection, client: str, position: int, destinations: Sequence[str], seconds: float
) -> str:
    """Record that a producer waits on ``position`` for ``destinations`` (committed at once)."""
    guard = str(uuid.uuid4())
    with conn.cursor() as cur:
        cur.execute(
            "INSERT INTO lr.delivery_guards (guard_id, client_name, position, destinations, expires_at) "
            "VALUES (%s, %s, %s, %s, now() + make_interval(secs => %s))",
            (guard, client, position, sorted(destinations), seconds + GUARD_GRACE_S),
        )
    conn.commit()
    return guard


def remove_guard(conn: psycopg2.extensions.connection, guard: str) -> None:
    try:
        if conn.closed:
            return
        conn.rollback()
        with conn.cursor() as cur:
            cur.execute("DELETE FROM lr.delivery_guards WHERE guard_id = %s", (guard,))
        conn.commit()
    except psycopg2.Error:
        pass  # the source went away: the guard expires by itself


def poll(check: Callable[[], T], timeout: float, first: float = 0.005, longest: float = 0.25) -> T:
    """Call ``check()`` until it returns something truthy or ``timeout`` passes; the last result."""
    deadline = time.monotonic() + timeout
    pause = first
    while True:
        result = check()
        if result or time.monotonic() >= deadline:
            return result
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(pause * 2, longest)


def wait_until_safe(
    conn: psycopg2.extensions.connection,
    ticket: Ticket,
    destinations: Sequence[str] = (),
    min_regions: int | None = None,
    timeout: float = 30.0,
) -> Delivery:
    """Return once the ticket's entries are safe where asked (see ``wait_for``), or raise
    ``DeliveryTimeout`` naming the destinations that have not acknowledged. Guards the entry
    meanwhile (its state is *delayed*). ``conn``: the producer's connection, after its commit."""
    check_timeout(timeout)  # the targets are checked by ``wait_for``, before the guard
    position = resolve(conn, ticket)
    addressed, region = addressed_sinks(conn, ticket.client, position, ticket.destinations)
    target = wait_for(addressed, region, destinations, min_regions, durability_rule(conn))
    guard = add_guard(conn, ticket.client, position, target.destinations or sorted(addressed), timeout)
    try:
        last: list[Delivery] = []

        def check() -> bool:
            last[:] = [read_delivery(conn, ticket.client, position, addressed, region)]
            return target.met(last[0])

        if poll(check, timeout):
            return last[0]
        missing, lacks = _lacking(last[0], target, addressed)
        raise DeliveryTimeout(
            f"{ticket} (position {position}) not {target.describe()} after {timeout:g}s: {lacks}",
            position=position,
            missing=missing,
            regions=last[0].stored_regions,
        )
    finally:
        remove_guard(conn, guard)


# --- durability per source ------------------------------------------------------------------------
_ENTRIES_NAMING_SINKS = """
    FROM lr.log_commits c
    JOIN lr.log_entries e ON e.tx = c.tx AND e.stream IN (%(log)s, %(tables)s)
    JOIN s ON s.tag_id = ANY (e.tag_ids) AND s.client_id = e.client_id
"""
_SESSIONS_CTE = source_sessions.ACKED_SINKS_CTE


def durable_position(conn: psycopg2.extensions.connection, min_regions: int) -> int:
    """The highest position P such that every log entry up to P is durable: stored in at least
    ``min_regions`` distinct regions (the source's, and those of the sinks it named that
    acknowledged it), or, when the sinks it named span fewer, acknowledged by every one of them.

    Entries below the lowest acknowledged position are acknowledged by every sink they named;
    above the highest, by none (only the source's region holds them): so only the range between
    is looked at, and past it the first entry that names a sink ends the durable prefix. A session
    a retention trim left behind never acknowledged what was trimmed past it: the prefix ends at its
    acknowledged position (the trimmed entries cannot be read to tell whether they named it)."""
    args = {"log": STREAM_LOG_ENTRIES, "tables": STREAM_TABLE_CHANGES, "min": min_regions}
    with conn.cursor() as cur:
        cur.execute(LAST_DRAWN_POSITION_SQL)
        drawn = cur.fetchone()[0]
        cur.execute("SELECT region FROM lr.site_info")
        args["home"] = cur.fetchone()[0]
        args["lo"], args["hi"] = source_sessions.acked_range(cur)
        if min_regions <= 1:
            conn.commit()
            return drawn  # the source's region holds every committed entry
        cur.execute(
            _SESSIONS_CTE
            + """
            SELECT min(position) FROM (
                SELECT c.position
                """
            + _ENTRIES_NAMING_SINKS
            + """
                WHERE c.position > greatest(%(lo)s, 0) AND c.position <= %(hi)s
                GROUP BY c.position, e.entry_id
                HAVING NOT bool_and(s.acked >= c.position)
                   AND count(DISTINCT s.region) FILTER (WHERE s.acked >= c.position)
                       + CASE WHEN bool_or(s.acked >= c.position AND s.region = %(home)s) THEN 0 ELSE 1 END
                       < %(min)s) short
            """,
            args,
        )
        first_short = cur.fetchone()[0]
        if first_short is None:
            cur.execute(
                _SESSIONS_CTE
                + "SELECT min(c.position)"
                + _ENTRIES_NAMING_SINKS
                + "WHERE c.position > greatest(%(hi)s, 0)",
                args,
            )
            first_short = cur.fetchone()[0]
        behind = source_sessions.lowest_ack_behind_trim(cur)
    conn.commit()
    durable = drawn if first_short is None else first_short - 1
    return durable if behind is None else min(durable, behind)
