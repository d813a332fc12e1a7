"""Public sink-side API (the README's "Consume"): consume what arrived for a client.

```python
from airflow_provider_lr.subscriber import RoutingQueueSubscriber
sub = RoutingQueueSubscriber(dsn, client_name="policy")
sub.poll(listener, max_messages=1000)      # one pass; returns how many entries were delivered
sub.run(listener, stop=threading.Event())  # follows new arrivals (LISTEN/NOTIFY) until stopped
```

The listener's callbacks run inside the subscriber's delivery transaction: ``sub.connection`` (or
``sub.cursor()``) during a callback is that transaction, so writes made through it commit
together with the delete of the delivered entries (exactly once) or roll back with it. The
connection is in autocommit mode and the subscriber sends BEGIN and COMMIT itself: its ``commit()``
and ``rollback()`` do nothing in a callback; to undo, raise or return False. See docs/subscriber.md.
"""

from __future__ import annotations

import threading

import psycopg2
import psycopg2.extensions

from airflow_provider_lr.engine.db.conninfo import ConnInfo, resolve
from airflow_provider_lr.engine.db.timeouts import Purpose
from airflow_provider_lr.engine.errors import ConfigurationError, MalformedEntryError, shown
from airflow_provider_lr.engine.sink import receive, wakeup
from airflow_provider_lr.engine.sink.delivery_transaction import delivery_connection, require_consumer
from airflow_provider_lr.engine.sink.receive import DeliveryContext, DeliveryStats, Listener
from airflow_provider_lr.engine.sink.relay import Relay, Subscription
from airflow_provider_lr.engine.sink.wakeup import Demand, FollowOptions

__all__ = [
    "DeliveryStats",
    "Listener",
    "MalformedEntryError",
    "Relay",
    "RoutingQueueSubscriber",
    "Subscription",
    "open_relay",
]


def _conninfo(target: str | ConnInfo) -> ConnInfo:
    return target if isinstance(target, ConnInfo) else resolve(target)


class RoutingQueueSubscriber(DeliveryContext):
    """A client's consumer of its receive queues ``LRQ_Recv_<client>_<source>`` on one sink site.

    ``dsn``: a libpq DSN/URI, an Airflow connection id or an lr site id (see engine.conninfo), or a
    ConnInfo. ``sources``: only these sources (default: every source, discovered as they appear).
    A callback gets at most ``batch_size`` entries, read from at most ``batch_bytes`` of the queue
    (at least one entry): memory is bounded by bytes whatever the size of the entries.
    """

    def __init__(
        self,
        dsn: str | ConnInfo,
        client_name: str = "policy",
        sources: list[str] | None = None,
        batch_size: int = FollowOptions.batch_size,
        poll_interval: float = FollowOptions.poll_interval,
        retry_interval: float = FollowOptions.retry_interval,
        batch_bytes: int = FollowOptions.batch_bytes,
    ) -> None:
        self.demand = Demand.of(client_name, sources)
        FollowOptions(batch_size, poll_interval, retry_interval, batch_bytes)  # refused here, not at the first poll
        self.info = _conninfo(dsn)
        self.batch_size, self.poll_interval, self.retry_interval = batch_size, poll_interval, retry_interval
        self.batch_bytes = batch_bytes
        self.stats = DeliveryStats()  # totals of every poll and finished run
        self.run_stats: DeliveryStats | None = None
        self._conn: psycopg2.extensions.connection | None = None  # poll()'s connection, kept open
        self._own: wakeup.OwnWakeups | None = None  # run()'s delivery connection, which listens

    @property
    def client_name(self) -> str:
        return self.demand.client

    def sources(self) -> list[str]:
        """Sources whose receive queue for this client is registered on the sink (discovery)."""
        return [
            s for s in receive.discover(self._poll_conn(), self.client_name) if self.demand.wants(self.client_name, s)
        ]

    def poll(self, listener: Listener, max_messages: int | None = None, max_bytes: int | None = None) -> int:
        """One pass over every queue (new sources included): delivers in order until each queue is
        empty, a callback fails, or ``max_messages`` entries (``max_bytes`` bytes of payloads) were
        handed over. Returns how many entries were delivered (acknowledged and deleted, full-sync
        markers included); failures are in ``self.stats`` and ``last_report``."""
        receive.require_listener(listener)  # up front, not when an entry of a missing kind comes
        conn = self._poll_conn()
        self._set_delivering(conn)
        try:
            report = receive.ReceiveQueueReader(conn, self.batch_size, self.batch_bytes).deliver(
                listener, self.client_name, self.demand.narrow(None), max_messages=max_messages, max_bytes=max_bytes
            )
        except (psycopg2.OperationalError, psycopg2.InterfaceError):
            self._close_poll_conn()  # reopened by the next poll
            raise
        finally:
            self._set_delivering(None)
        self.last_report = report
        self.stats.add(report)
        return report.delivered

    def run(self, listener: Listener, stop: threading.Event | None = None) -> DeliveryStats:
        """Deliver until ``stop`` is set: woken by NOTIFY ``lr_recv`` from the replicator's apply,
        with a full pass (discovery included) every ``poll_interval`` as a fallback. Returns the
        run's stats when stopped; stops within about 0.1 s plus any callback in progress."""
        if stop is not None and not all(callable(getattr(stop, name, None)) for name in ("is_set", "wait")):
            raise ConfigurationError(f"stop must be a threading.Event (set it to stop the run), not {shown(stop)}")
        stop = stop or threading.Event()
        stats = self.run_stats = DeliveryStats()  # live while it runs; added to ``stats`` at the end
        options = FollowOptions(self.batch_size, self.poll_interval, self.retry_interval, self.batch_bytes)
        own = self._own = wakeup.OwnWakeups(self._connect, self._set_delivering, lambda: self.demand, stop)
        try:
            wakeup.follow(own, listener, lambda: self.demand, own, stop, stats, options)
        finally:
            self.stats.add(stats)
        return stats

    @property
    def listening(self) -> bool:
        """``run`` holds its delivery connection, which hears the sink's wake-ups (LISTEN ``lr_recv``)."""
        conn = self._own.conn if self._own is not None else None
        return conn is not None and not conn.closed

    def _poll_conn(self) -> psycopg2.extensions.connection:
        if self._conn is None or self._conn.closed:
            self._conn = delivery_connection(self._connect())
        return self._conn

    def _connect(self) -> psycopg2.extensions.connection:
        """A delivery connection: the listener's statements run in its transactions, so it gets the
        network bounds only (keepalives, connect and TCP timeouts), never lr's session timeouts."""
        conn = self.info.connect(Purpose.APPLICATION)
        try:
            require_consumer(conn, self.client_name)  # a role shown none of its queues polled nothing, silently
        except BaseException:
            conn.close()
            raise
        return conn

    def _close_poll_conn(self) -> None:
        if self._conn is not None and not self._conn.closed:
            self._conn.close()
        self._conn = None

    def close(self) -> None:
        self._close_poll_conn()

    def __enter__(self) -> RoutingQueueSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_relay(dsn: str | ConnInfo, **options: object) -> Relay:
    """A relay for many subscriptions in one process sharing one LISTEN connection (see Relay)."""
    info = _conninfo(dsn)
    return Relay(lambda: info.connect(Purpose.APPLICATION), **options)  # type: ignore[arg-type]
