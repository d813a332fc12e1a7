"""When a sink's consumers look at their receive queues: wake-ups, demands and the follow loop.

``receive`` decides *how* a queue is delivered (one run per transaction, exactly once); this module
decides *when*. The replicator's apply sends ``pg_notify('lr_recv', '<client>/<source>')`` in the
transaction that makes entries visible; the ``Tap`` (a ``NotifyChannel`` on that channel) turns it
into (client, source) wake-ups, a ``Demand`` says which of them a consumer wants, and ``follow``
delivers until stopped: on each wake-up, after a failure's retry interval, and with a full pass
(discovery included) every poll interval, since a notification sent while nobody listened is lost.

``RoutingQueueSubscriber.run`` listens on its own delivery connection (``OwnWakeups``); the relay
shares one tap among its subscriptions (``relay.Subscription`` is its own ``Wakeups``).
"""

from __future__ import annotations

import logging
import select
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import psycopg2
import psycopg2.extensions

from airflow_provider_lr.engine.db.topology_schema import valid_client_name
from airflow_provider_lr.engine.errors import (
    ConfigurationError,
    SchemaError,
    SiteUnreachableError,
    one_line,
    require_counts,
    require_site_ids,
    shown,
)
from airflow_provider_lr.engine.notify import NotifyChannel
from airflow_provider_lr.engine.sink.delivery_transaction import delivery_connection, require_consumer
from airflow_provider_lr.engine.sink.receive import (
    DEFAULT_BATCH,
    DEFAULT_BATCH_BYTES,
    DeliveryStats,
    Listener,
    ReceiveQueueReader,
    require_listener,
)
from airflow_provider_lr.engine.vocabulary import NOTIFY_CHANNEL, parse_wakeup

log = logging.getLogger(__name__)

DEFAULT_POLL_INTERVAL = 2.0  # full pass (discovery included) when no notification arrives
DEFAULT_RETRY_INTERVAL = 0.5  # a queue whose delivery failed is tried again after this
PASS_RUNS = 8  # a follow loop looks at its stop event at least every this many full batches
# A consumer may start before `lr init` reached its sink (an application deployed first): a follow
# loop waits this long for the site's lr schema, looking every poll interval, then gives up with
# the error (a wrong database in the DSN never gets one, and must not be waited on silently).
SCHEMA_WAIT = 60.0

ALL = None  # a wake-up that asks for a full pass (discovery included)


class Tap(NotifyChannel):
    """The sink's LISTEN on ``lr_recv``: its notifications as the receive queues they name."""

    def __init__(self, connect: Callable[[], psycopg2.extensions.connection]) -> None:
        super().__init__(connect, NOTIFY_CHANNEL)

    def queues(self, timeout: float) -> list[tuple[str, str]] | None:
        """Notified (client, source) pairs within ``timeout`` seconds, deduplicated; [] on timeout
        or interrupt; ``ALL`` when the tap was just (re)opened or lost."""
        payloads = self.wait(timeout)
        if payloads is None:
            return ALL
        return [parse_wakeup(p) for p in payloads]


class Connections(Protocol):
    """How a follow loop opens and closes its delivery connection (``Connector``, ``OwnWakeups``)."""

    def open(self) -> psycopg2.extensions.connection: ...

    def close(self, conn: psycopg2.extensions.connection | None) -> None: ...


class Wakeups(Protocol):
    """Where a follow loop learns that queues have news: sources of its client, or ``ALL``."""

    def wait(self, timeout: float) -> set[str] | None: ...


@dataclass(frozen=True)
class Demand:
    """What a consumer wants: one client's queues, from every source (``sources=None``: the
    discovered ones, new ones included) or from the named sources only."""

    client: str
    sources: frozenset[str] | None = None

    @classmethod
    def of(cls, client: object, sources: Iterable[str] | None = None) -> Demand:
        """A consumer's demand as the public API takes it, refused when it could not mean what was
        meant (a single site id given as ``sources`` would be read as its letters: nothing delivered)."""
        if not isinstance(client, str) or not client:
            raise ConfigurationError(f"client_name is required: the client whose queues to consume, not {client!r}")
        if not valid_client_name(client):  # it delivered nothing, silently, for ever
            raise ConfigurationError(
                f"client_name {shown(client)} cannot be a client: a topology's client names are letters, digits, '_' "
                "and '-' (at most 63 characters), so none of its queues could ever be found"
            )
        return cls(client, None if sources is None else frozenset(require_site_ids("sources", sources)))

    def wants(self, client: str, source: str) -> bool:
        return client == self.client and (self.sources is None or source in self.sources)

    def narrow(self, sources: Iterable[str] | None) -> Iterable[str] | None:
        """The sources to look at for a wake-up (``None``: a full pass)."""
        if sources is None:
            return None if self.sources is None else sorted(self.sources)
        return sorted(s for s in sources if self.sources is None or s in self.sources)


@dataclass(frozen=True)
class FollowOptions:
    """How a follow loop delivers (``ReceiveQueueReader``'s bounds) and how often it looks again:
    one set for the subscriber, the relay and each of its subscriptions."""

    batch_size: int = DEFAULT_BATCH
    poll_interval: float = DEFAULT_POLL_INTERVAL
    retry_interval: float = DEFAULT_RETRY_INTERVAL
    batch_bytes: int = DEFAULT_BATCH_BYTES

    def __post_init__(self) -> None:
        # a batch of nothing would deliver nothing, a pause of nothing would spin a core
        require_counts(batch_size=self.batch_size, batch_bytes=self.batch_bytes)
        for name in ("poll_interval", "retry_interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigurationError(f"{name} must be a number of seconds above 0, not {value!r}")


@dataclass(frozen=True)
class Connector:
    """How a follow loop opens its delivery connection to the sink, and who hears which connection
    it delivers on (None: none now), so that a delivery in progress can be cancelled from outside."""

    connect: Callable[[], psycopg2.extensions.connection]
    on_conn: Callable[[psycopg2.extensions.connection | None], None] | None = None

    def open(self) -> psycopg2.extensions.connection:
        conn = delivery_connection(self.connect())
        if self.on_conn:
            self.on_conn(conn)
        return conn

    def close(self, conn: psycopg2.extensions.connection | None) -> None:
        """Forget and close a delivery connection."""
        if self.on_conn:
            self.on_conn(None)
        if conn is not None and not conn.closed:
            try:
                conn.close()
            except psycopg2.Error:
                pass


def follow(
    connector: Connections,
    listener: Listener,
    demand: Callable[[], Demand],
    wakeups: Wakeups,
    stop: threading.Event,
    stats: DeliveryStats,
    options: FollowOptions = FollowOptions(),
) -> None:
    """Deliver until ``stop``: a full pass first and every ``poll_interval`` (discovery: sources that
    appear are found without a restart), a pass over the woken queues on each wake-up, and queues
    whose delivery failed again after ``retry_interval`` (not before: a failing listener is not
    hammered). A lost sink connection is reopened; nothing is lost, undelivered rows stay queued.
    A pass hands over at most ``PASS_RUNS`` batches' worth of entries and of bytes before ``stop``
    is looked at again. A sink without lr's schema (or with one too old) is waited for, every
    ``poll_interval``, up to ``SCHEMA_WAIT``; then its ``SchemaError`` ends the loop. A role that
    row-level security shows none of the client's queues ends it at once (``ConfigurationError``
    naming the grant to give: it delivered nothing, for ever, without a word), at the first pass
    and whenever the demand's client changes."""
    require_listener(listener)  # a pass that raised it would be retried forever
    conn: psycopg2.extensions.connection | None = None
    todo: set[str] | None = None  # None: a full pass is due
    retry: set[str] = set()
    next_full = next_retry = 0.0
    schema_missing_since: float | None = None
    lost: str | None = None  # why the sink connection is lost, as last logged (said again only when it changes)
    consumer: str | None = None  # the client whose queues the role was found to read (``require_consumer``)
    try:
        while not stop.is_set():
            now = time.monotonic()
            if now >= next_full:
                todo, next_full = None, now + options.poll_interval
            waiting: set[str] = set()
            if retry and now >= next_retry:
                if todo is not None:
                    todo |= retry
                retry = set()
            else:
                waiting = retry
            want = demand()
            sources = want.narrow(todo)
            todo = set()
            if sources is None or sources:
                try:
                    if conn is None or conn.closed:
                        conn = connector.open()
                        schema_missing_since = None
                    if want.client != consumer:  # a role shown none of its queues: said, not polled for ever
                        require_consumer(conn, want.client)
                        consumer = want.client
                    report = ReceiveQueueReader(conn, options.batch_size, options.batch_bytes).deliver(
                        listener,
                        want.client,
                        sources,
                        max_messages=PASS_RUNS * options.batch_size,
                        skip=waiting,
                        max_bytes=PASS_RUNS * options.batch_bytes,
                    )
                except (psycopg2.OperationalError, psycopg2.InterfaceError, SiteUnreachableError) as exc:
                    stats.failures += 1
                    stats.note_error(f"sink connection lost: {one_line(exc)}")
                    if one_line(exc) != lost:  # every retry_interval it was said again: a subscription short of a
                        # connection slot (many subscriptions on one sink) logged twice a second until one freed
                        lost = one_line(exc)
                        log.warning(
                            "receive-queue delivery: sink connection lost (%s); reconnecting every %gs (said again "
                            "when the reason changes)",
                            lost,
                            options.retry_interval,
                        )
                    connector.close(conn)
                    conn = None
                    next_full = time.monotonic() + options.retry_interval
                    stop.wait(options.retry_interval)
                    continue
                except SchemaError as exc:
                    now = time.monotonic()
                    if schema_missing_since is None:
                        schema_missing_since = now
                        log.warning("receive-queue delivery: %s; waiting up to %.0f s for it", exc, SCHEMA_WAIT)
                    elif now - schema_missing_since >= SCHEMA_WAIT:
                        raise SchemaError(f"{exc} (waited {now - schema_missing_since:.0f} s for it)") from None
                    stats.failures += 1
                    stats.note_error(str(exc))
                    conn = None
                    stop.wait(options.poll_interval)
                    next_full = 0.0
                    continue
                stats.add(report)
                if lost is not None:
                    log.warning("receive-queue delivery: sink connection back, delivering again")
                    lost = None
                if report.failed:
                    if not retry:
                        next_retry = time.monotonic() + options.retry_interval
                    retry |= report.failed
                if report.unfinished:
                    todo = set(report.unfinished)
                    continue  # more is waiting now: no sleep
            deadline = min(next_full, next_retry) if retry else next_full
            woken = wakeups.wait(max(0.0, deadline - time.monotonic()))
            if woken is ALL:
                next_full = 0.0
            else:
                todo |= set(woken) - retry
    finally:
        connector.close(conn)


class OwnWakeups:
    """A consumer that listens on its own delivery connection (``RoutingQueueSubscriber.run``): the
    ``Connector`` of its follow loop, whose connection LISTENs on ``lr_recv`` as it opens, and its
    ``Wakeups``. A wake-up then crosses one process fewer than through a separate tap (the sink's
    backend that sends it, the delivering backend, the consumer: no listening backend of its own
    besides), and the consumer holds one connection. Notifications sent while the connection is
    busy with a delivery wait for its transaction's end and arrive with the next statement's answer
    or on the socket; after every (re)open the first wait asks for a full pass, since what was sent
    while nobody listened is not heard."""

    SLICE = 0.1  # how often the stop event is looked at while waiting

    def __init__(
        self,
        connect: Callable[[], psycopg2.extensions.connection],
        on_conn: Callable[[psycopg2.extensions.connection | None], None] | None,
        demand: Callable[[], Demand],
        stop: threading.Event,
    ) -> None:
        self.connector = Connector(connect, on_conn)
        self.demand, self.stop = demand, stop
        self.conn: psycopg2.extensions.connection | None = None
        self.fresh = False  # (re)opened: what was sent before its LISTEN was not heard

    def open(self) -> psycopg2.extensions.connection:
        conn = self.connector.open()
        with conn.cursor() as cur:  # autocommit: listening from here on
            cur.execute(f"LISTEN {NOTIFY_CHANNEL}")
        self.conn, self.fresh = conn, True
        return conn

    def close(self, conn: psycopg2.extensions.connection | None) -> None:
        if self.conn is conn:
            self.conn = None
        self.connector.close(conn)

    def wait(self, timeout: float) -> set[str] | None:
        """Sources of the demand's client notified within ``timeout`` seconds; ``ALL`` after a
        (re)open, when the connection was lost (the next pass reopens it), and at ``timeout`` when
        there is none."""
        if self.fresh:
            self.fresh = False
            return ALL
        end = time.monotonic() + timeout
        while not self.stop.is_set():
            conn = self.conn
            if conn is None:  # nothing to hear on (no queue wanted yet): the full pass when due
                if self.stop.wait(max(0.0, min(self.SLICE, end - time.monotonic()))) or time.monotonic() < end:
                    continue
                return ALL
            if conn.closed:
                return ALL  # lost: the next pass reopens it
            if not conn.notifies:  # none came with the last answers: wait on the socket
                try:
                    ready, _, _ = select.select([conn], [], [], max(0.0, min(self.SLICE, end - time.monotonic())))
                    if ready:
                        conn.poll()
                except (OSError, ValueError, psycopg2.Error):
                    return ALL  # lost: the next pass reopens it
            notes = [parse_wakeup(note.payload) for note in conn.notifies]
            conn.notifies.clear()
            want = self.demand()
            sources = {s for c, s in notes if want.wants(c, s)}
            if sources or time.monotonic() >= end:
                return sources
        return set()
