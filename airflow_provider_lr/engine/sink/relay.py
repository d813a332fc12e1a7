"""The relay (after Synnax's distribution-layer relay) for receive-queue consumers in one process.

Many subscriptions to one sink, each with its own demand (a client, optionally some sources) and
listener, share ONE LISTEN connection:

* the *tap* (``wakeup.Tap``) is open only while some subscription exists; its thread is the only
  reader of notifications;
* the *delta*: each notification ("<client>/<source>", deduplicated per read) is multiplied to the
  subscriptions whose demand wants it, as one pending wake-up per queue: a flag in the
  subscription's set, never a blocking send, so a slow subscription cannot hold the tap or the
  others back, and a burst of commits on one queue costs it one extra pass at most;
* each subscription delivers on its own thread and its own sink connection (the follow loop of
  ``wakeup.follow``), so a listener that takes its time delays only itself.

Subscriptions join, change demands (``update``) and leave (``close``) at any time. No lock is held
while joining a thread, calling a listener or touching the database; ``close`` joins with a
timeout and a subscription may close itself (or the relay) from inside its own callback.

No thread dies silently. A sink that is down or restarting is retried by every thread (the tap
reopens its LISTEN, each follow loop its connection). What cannot heal ends its owner with the
error, logged on one line: a subscription whose connection is refused (a wrong password, an unknown
database: ``ConfigurationError``) or whose loop failed ends with it in ``Subscription.error``;
the tap's own failure ends the whole relay (``Relay.error``, every subscription ended with it,
``subscribe`` refused). ``Relay.join`` and ``Subscription.join`` return when that happens and
raise the error.
"""

from __future__ import annotations

import enum
import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable

import psycopg2
import psycopg2.extensions

from airflow_provider_lr.engine.errors import LRError, one_line
from airflow_provider_lr.engine.sink.receive import DeliveryContext, DeliveryStats, Listener, require_listener
from airflow_provider_lr.engine.sink.wakeup import ALL, Connector, Demand, FollowOptions, Tap, follow

log = logging.getLogger(__name__)

Connect = Callable[[], psycopg2.extensions.connection]
_ids = itertools.count(1)


class _Unset(enum.Enum):
    """``update``'s default for ``sources``: leave them as they are (``None`` means every source)."""

    UNSET = enum.auto()


_UNSET = _Unset.UNSET


class Subscription(DeliveryContext):
    """One consumer in a relay: a listener, a demand, a delivery thread and connection."""

    def __init__(
        self, relay: Relay, listener: Listener, demand: Demand, connect: Connect, options: FollowOptions
    ) -> None:
        self.id = next(_ids)
        self.relay = relay
        self.listener = listener
        self._demand = demand
        self._connect = connect
        self._options = options
        self.stats = DeliveryStats()
        self.wakeups = 0  # wake-ups received from the relay (coalesced per queue)
        self.error: BaseException | None = None  # what ended the delivery thread, if not close()
        self._lock = threading.Lock()
        self._pending: set[str] = set()
        self._full = False
        self._event = threading.Event()
        self._stop = threading.Event()
        self._ended = threading.Event()  # the delivery thread has returned (closed or failed)
        self._thread = threading.Thread(target=self._main, name=f"lr-subscription-{self.id}", daemon=True)

    # --- what the application uses ---------------------------------------------------------------
    @property
    def demand(self) -> Demand:
        return self._demand

    @property
    def client_name(self) -> str:
        return self._demand.client

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def update(self, client: str | None = None, sources: Iterable[str] | None | _Unset = _UNSET) -> None:
        """Change the demand: another client and/or other sources (``None``: every source). Takes
        effect from the next pass, which starts at once."""
        current = self._demand
        self._demand = Demand.of(client or current.client, current.sources if isinstance(sources, _Unset) else sources)
        self.relay._reindex()
        self.wake(ALL)

    def join(self, timeout: float | None = None) -> bool:
        """Block until the subscription ends (closed, or failed) or ``timeout`` passes; True when it
        ended. Raises what ended it when it failed (``error``), e.g. a ``ConfigurationError``."""
        ended = self._ended.wait(timeout)
        if self.error is not None:
            raise self.error
        return ended

    def close(self, timeout: float = 10.0) -> bool:
        """Leave the relay and stop delivering; True when the delivery thread has ended. A callback
        in progress finishes first (its transaction commits or rolls back as usual). Called from
        the subscription's own callback, it returns at once and the thread ends after the callback."""
        self._stop.set()
        self._event.set()
        self.relay._leave(self)
        if threading.current_thread() is self._thread or not self._thread.ident:
            return not self._thread.is_alive()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # --- what the relay uses -------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def wake(self, source: str | None) -> None:
        """Note news for ``source`` (``ALL``: a full pass). Never blocks on delivery."""
        with self._lock:
            if source is ALL:
                self._full = True
            elif source not in self._pending:
                self._pending.add(source)
            else:
                return  # already pending: one wake-up per queue
            self.wakeups += 1
        self._event.set()

    def wait(self, timeout: float) -> set[str] | None:
        """The follow loop's wake-ups (wakeup.Wakeups): sources with news, or ``ALL``."""
        self._event.wait(timeout)
        with self._lock:
            self._event.clear()
            full, pending = self._full, self._pending
            self._full, self._pending = False, set()
        return ALL if full else pending

    def _main(self) -> None:
        try:
            follow(
                Connector(self._connect, self._set_delivering),
                self.listener,
                lambda: self._demand,
                self,
                self._stop,
                self.stats,
                self._options,
            )
        except BaseException as exc:  # what follow cannot heal (it retries a sink that is down)
            self.fail(exc)
            self.relay._leave(self)
        finally:
            self._ended.set()

    def fail(self, exc: BaseException) -> None:
        """End this subscription with ``exc`` (kept in ``error``, raised by ``join``)."""
        if self.error is None:  # said before it is set: whoever sees ``error`` finds the log line written
            if isinstance(exc, LRError):  # lr's own, with its fix: one line, no traceback
                log.error("subscription %s (%s) stopped: %s", self.id, self._demand, one_line(exc))
            else:
                log.exception("subscription %s (%s) stopped", self.id, self._demand)
            self.error = exc
        self._stop.set()
        self._event.set()

    def __repr__(self) -> str:
        return f"Subscription({self.id}, {self._demand})"


class Relay:
    """Subscriptions to one sink sharing one LISTEN connection (see the module docstring)."""

    TAP_WAIT = 1.0  # the tap thread re-checks closing at least this often

    def __init__(
        self,
        connect: Connect,
        batch_size: int = FollowOptions.batch_size,
        poll_interval: float = FollowOptions.poll_interval,
        retry_interval: float = FollowOptions.retry_interval,
        batch_bytes: int = FollowOptions.batch_bytes,
    ) -> None:
        self._connect = connect
        self._defaults = FollowOptions(batch_size, poll_interval, retry_interval, batch_bytes)
        self._lock = threading.Lock()
        self._subs: dict[int, Subscription] = {}
        self._by_client: dict[str, list[Subscription]] = {}
        self._closing = threading.Event()
        self.error: BaseException | None = None  # what ended the tap, and with it the relay
        self._tap = Tap(connect)
        self._tap.wanted = False
        self.notified: Counter[tuple[str, str]] = Counter()  # (client, source) wake-ups read from the tap
        self._thread = threading.Thread(target=self._tap_loop, name="lr-relay-tap", daemon=True)
        self._thread.start()

    def subscribe(
        self,
        listener: Listener,
        client_name: str,
        sources: Iterable[str] | None = None,
        connect: Connect | None = None,
        options: FollowOptions | None = None,
    ) -> Subscription:
        """Join: deliver ``client_name``'s queues (from ``sources`` only, if given) to ``listener``
        on a new thread and connection (``connect``), starting with what is already queued.
        ``options``: batch sizes and pauses of this subscription (default: the relay's)."""
        require_listener(listener)
        options = options or self._defaults
        sub = Subscription(
            self,
            listener,
            Demand.of(client_name, sources),
            connect or self._connect,
            options,
        )
        with self._lock:
            if self.error is not None:
                raise LRError(f"the relay stopped: {one_line(self.error)}") from self.error
            if self._closing.is_set():
                raise LRError("the relay is closed; create a new one to subscribe")
            self._subs[sub.id] = sub
        self._reindex()
        sub.start()
        return sub

    @property
    def subscriptions(self) -> list[Subscription]:
        with self._lock:
            return list(self._subs.values())

    @property
    def listening(self) -> bool:
        """Whether the tap (the shared LISTEN connection) is open."""
        return self._tap.listening

    def close(self, timeout: float = 10.0) -> bool:
        """Close every subscription and the tap; True when every thread has ended in ``timeout``."""
        deadline = time.monotonic() + timeout
        self._closing.set()
        ended = True
        for sub in self.subscriptions:
            ended = sub.close(max(0.0, deadline - time.monotonic())) and ended
        self._tap.interrupt()
        if threading.current_thread() is not self._thread:
            self._thread.join(max(0.0, deadline - time.monotonic()))
            ended = ended and not self._thread.is_alive()
        return ended

    def join(self, timeout: float | None = None) -> bool:
        """Block until the relay is closed or fails, or ``timeout`` passes; True when it ended.
        Raises what ended its tap (e.g. a ``ConfigurationError``: every subscription ended with it)."""
        self._thread.join(timeout)
        if self.error is not None:
            raise self.error
        return not self._thread.is_alive()

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- demand bookkeeping (the tapper) -------------------------------------------------------
    def _leave(self, sub: Subscription) -> None:
        with self._lock:
            self._subs.pop(sub.id, None)
        self._reindex()

    def _reindex(self) -> None:
        """Rebuild the client → subscriptions index; open the tap only while something is demanded."""
        with self._lock:
            index: dict[str, list[Subscription]] = {}
            for sub in self._subs.values():
                index.setdefault(sub.demand.client, []).append(sub)
            self._by_client = index
            wanted = bool(index) and not self._closing.is_set()
        if wanted != self._tap.wanted:
            self._tap.wanted = wanted
            self._tap.interrupt()

    def _tap_loop(self) -> None:
        try:
            while not self._closing.is_set():
                notes = self._tap.queues(self.TAP_WAIT)
                if notes is ALL:
                    for sub in self.subscriptions:
                        sub.wake(ALL)
                    continue
                for client, source in notes:
                    self.notified[(client, source)] += 1
                    with self._lock:
                        targets = [s for s in self._by_client.get(client, ()) if s.demand.wants(client, source)]
                    for sub in targets:
                        sub.wake(source)
        except BaseException as exc:  # what the tap cannot heal (it reopens a LISTEN that was lost)
            self._fail(exc)
        finally:
            self._tap.close()

    def _fail(self, exc: BaseException) -> None:
        """The tap cannot go on: end the relay and every subscription with ``exc``."""
        if isinstance(exc, LRError):
            log.error("relay stopped: its LISTEN connection failed: %s", one_line(exc))
        else:
            log.exception("relay stopped: its tap failed")
        self.error = exc  # (after the log line, as ``Subscription.fail``)
        self._closing.set()
        for sub in self.subscriptions:
            sub.fail(exc)
            self._leave(sub)
