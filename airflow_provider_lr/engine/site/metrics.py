"""lr as Prometheus metrics, on ``prometheus_client`` (its registry, exposition and HTTP server).

Two kinds, from two places, because each figure is read where it is true:

* **Levels, read at scrape time** (``StatusCollector``; ``lr metrics``): the same live figures as
  ``lr status`` (lag, readiness, waiting entries, ages) and an info metric per site naming its
  topology and schema version. Any process that reaches the sites can serve them.
* **Counts, kept where the work happens** (``ReplicationCounters``; ``lr sync --metrics-listen``):
  entries and bytes delivered, full syncs applied, failed steps and stream hand-backs per session,
  and a histogram of the delivery lag seen at each acknowledgement. They are incremented by the
  replicator process as it delivers (its cycles' reports, each stream's sink writes), so they live
  as long as that process: Prometheus' ``rate()``/``increase()`` take a restart's reset in their
  stride. (Durable totals in PostgreSQL would cost a write on every delivery; Airflow tasks send
  their own counters through Airflow's metrics, ``operators/telemetry``.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, start_http_server
from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from airflow_provider_lr.engine.counters import DeliveryCounters
from airflow_provider_lr.engine.errors import ConfigurationError
from airflow_provider_lr.engine.site.status import SiteStatus, cross_check, trim_marks
from airflow_provider_lr.engine.site.status_parts import DIVERGED, HELD_BACK, MEMBERS, SESSIONS, TOPOLOGY
from airflow_provider_lr.engine.source.backlog import readiness
from airflow_provider_lr.engine.store.topology import Topology
from airflow_provider_lr.engine.vocabulary import SessionKey

SESSION_LABELS = ("source", "sink", "client")
QUEUE_LABELS = ("sink", "source", "client")
# The delivery lag's buckets (seconds): a stream's milliseconds up to a sink down for an hour.
LAG_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)


class StatusCollector(Collector):
    """Every site's status as gauges, read from the sites on each collect (``statuses``: site id →
    ``SiteStatus``, or why it could not be read); a site that could not be read is ``lr_site_up 0``.
    With the ``topology`` read from a file, whether each site runs it (``lr status``'s file check)."""

    def __init__(self, statuses: Callable[[], dict[str, SiteStatus | str]], topology: Topology | None = None) -> None:
        self.statuses, self.topology = statuses, topology

    def collect(self) -> Iterable[Any]:
        found = self.statuses()
        cross_check(found)
        marks = trim_marks(found)

        def family(name: str, text: str, labels: tuple[str, ...]) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, text, labels=list(labels))

        up = family("lr_site_up", "1 when the site could be read", ("site",))
        info = InfoMetricFamily(
            "lr_site", "the topology applied at the site and its lr schema version", labels=["site"]
        )
        trim = family("lr_log_trim_mark", "commit position up to which the site's log is trimmed", ("site",))
        held = family(
            "lr_log_held_back", "transactions holding the log's read barrier or with uncommitted entries", ("site",)
        )
        matches = family(
            "lr_site_topology_matches_file",
            "1 when the site runs the topology of the file lr read (0: a stale or unapplied file)",
            ("site",),
        )
        diverged = family(
            "lr_tables_diverged", "federated tables of the site that do not replicate (lr status: DIVERGED)", ("site",)
        )
        lag_entries = family(
            "lr_session_lag_entries", "committed entries not yet acknowledged by the sink", SESSION_LABELS
        )
        lag_seconds = family(
            "lr_session_lag_seconds",
            "age of the oldest committed entry not yet acknowledged by the sink",
            SESSION_LABELS,
        )
        ready = family(
            "lr_session_ready", "1 when the sink holds everything committed for it (source side)", SESSION_LABELS
        )
        error = family("lr_session_error", "1 when the session's last step failed", SESSION_LABELS)
        success_age = family(
            "lr_session_last_success_age_seconds", "seconds since the session last completed a step", SESSION_LABELS
        )
        requests = family(
            "lr_full_sync_requests_open",
            "full-sync requests pending or supplied, not applied yet",
            (*SESSION_LABELS, "status"),
        )
        waiting = family(
            "lr_receive_queue_waiting_entries",
            "entries in a receive queue not yet consumed by subscribers",
            QUEUE_LABELS,
        )
        oldest = family(
            "lr_receive_queue_oldest_seconds", "age of the oldest entry waiting in a receive queue", QUEUE_LABELS
        )
        dead = family("lr_receive_queue_dead_letters", "entries moved to dead letters", QUEUE_LABELS)
        unread = family(
            "lr_site_parts_unread",
            "parts of the site's status not read (a lock another session holds on an lr table; lr status says which)",
            ("site",),
        )
        members = family(
            "lr_replicator_members",
            "replicator processes alive and sharing the site's sessions (as a source)",
            ("site",),
        )
        for site, st in found.items():
            up.add_metric([site], 0 if isinstance(st, str) else 1)
            if isinstance(st, str):
                continue
            info.add_metric(
                [site], {"topology_id": st.topology_config_id or "", "schema_version": str(st.schema_version)}
            )
            if st.trim_mark is not None:  # (not read: no sample, not a made-up 0)
                trim.add_metric([site], st.trim_mark)
            unread.add_metric([site], len(st.unread))
            # a part not read gives no sample (its empty list is no "none"); its sessions not read,
            # whether the site is a source (whose log can be held back) is not known either; a site
            # that is no source (a sink only) has no log to hold back: no sample, as for the lag
            if st.read(SESSIONS, HELD_BACK) and any(s["role"] == "source" for s in st.sessions):
                held.add_metric([site], len(st.held_back_by))
            if st.read(DIVERGED):
                diverged.add_metric([site], len(st.diverged))
            if st.read(MEMBERS):
                members.add_metric([site], len(st.members))
            if self.topology is not None and st.read(TOPOLOGY):
                matches.add_metric([site], int(st.topology_config_id == self.topology.topology_config_id))
            for s in st.sessions:
                if s["role"] != "source":
                    continue
                labels = [s["source_site_id"], s["sink_site_id"], s["client_name"]]
                if s.get("lag_seconds", 0.0) is not None:  # None: its backlog not read
                    lag_entries.add_metric(labels, s["remaining_entries_to_send"] or 0)
                    lag_seconds.add_metric(labels, s.get("lag_seconds") or 0.0)
                ready.add_metric(labels, int(readiness(s, marks.get(s["source_site_id"])) == "ready"))
                error.add_metric(labels, int(bool(s.get("last_error"))))
                if s.get("last_success_age_s") is not None:
                    success_age.add_metric(labels, s["last_success_age_s"])
            for r in st.full_sync_requests:
                requests.add_metric([site, r["sink"], r["client"], r["status"]], 1)
            for q in st.receive_queues:
                labels = [site, q["source"], q["client"]]
                waiting.add_metric(labels, q["waiting"])
                oldest.add_metric(labels, q["oldest_waiting_s"])
                dead.add_metric(labels, q["dead_letters"])
        yield from (
            up,
            info,
            lag_entries,
            lag_seconds,
            ready,
            error,
            success_age,
            requests,
            waiting,
            oldest,
            dead,
            held,
            trim,
            diverged,
            unread,
            members,
        )
        if self.topology is not None:
            yield matches


def status_registry(
    statuses: Callable[[], dict[str, SiteStatus | str]], topology: Topology | None = None
) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(StatusCollector(statuses, topology))
    return registry


def exposition(registry: CollectorRegistry) -> str:
    """The registry in Prometheus' text format (what a scrape gets)."""
    return generate_latest(registry).decode()


class ReplicationCounters(DeliveryCounters):
    """What one replicator process did, per session, counted as it happens (see the module
    docstring), as Prometheus counters, plus the totals the periodic progress line reads
    (``counters.Pulse``). Thread-safe: the stream threads and the cycles count into one."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__()
        self.registry = registry if registry is not None else CollectorRegistry()

        def counter(name: str, text: str) -> Counter:
            return Counter(name, text, SESSION_LABELS, registry=self.registry)

        self._entries = counter("lr_entries_delivered", "log entries this replicator made visible at the sink")
        self._bytes = counter(
            "lr_bytes_delivered", "bytes of log-entry messages this replicator made visible at the sink"
        )
        self._full_syncs = counter("lr_full_syncs", "full (snapshot) syncs this replicator applied at the sink")
        self._errors = counter("lr_session_errors", "failed session steps (a cycle or a stream)")
        self._hand_backs = counter("lr_stream_hand_backs", "streams handed back to the cycles to renegotiate")
        self._lag = Histogram(
            "lr_delivery_lag_seconds",
            "age of the oldest entry not yet acknowledged by the sink, seen at each acknowledgement",
            SESSION_LABELS,
            buckets=LAG_BUCKETS,
            registry=self.registry,
        )
        # each session's children of the two delivery counters (labels() returns the same ones)
        self._delivered: dict[str | SessionKey, tuple[Any, Any]] = {}

    @staticmethod
    def _labels(session: str | SessionKey) -> tuple[str, str, str]:
        key = session if isinstance(session, SessionKey) else SessionKey.parse(session)
        return key.source, key.sink, key.client

    def delivered(self, session: str | SessionKey, entries: int, nbytes: int = 0) -> None:
        if entries <= 0 and nbytes <= 0:
            return
        children = self._delivered.get(session)
        if children is None:  # a label lookup costs more than the increment: once per session
            labels = self._labels(session)
            children = self._delivered[session] = (self._entries.labels(*labels), self._bytes.labels(*labels))
        children[0].inc(entries)
        children[1].inc(nbytes)
        super().delivered(session, entries, nbytes)

    def lag(self, session: str | SessionKey, entries: int, seconds: float) -> None:
        self._lag.labels(*self._labels(session)).observe(seconds)
        super().lag(session, entries, seconds)

    def full_sync(self, session: str | SessionKey) -> None:
        self._full_syncs.labels(*self._labels(session)).inc()

    def error(self, session: str | SessionKey) -> None:
        self._errors.labels(*self._labels(session)).inc()

    def hand_back(self, session: str | SessionKey) -> None:
        self._hand_backs.labels(*self._labels(session)).inc()


def start(registry: CollectorRegistry, listen: str) -> tuple[Any, threading.Thread, str]:
    """Serve ``registry`` on ``host:port`` in a daemon thread (prometheus_client's server: the
    metrics on ``/metrics`` and on any other path); the server, its thread and its URL.
    ConfigurationError, naming the address, when it is not HOST:PORT or cannot be bound."""
    host, _, port = listen.rpartition(":")
    if not port.isdigit() or int(port) > 65535:
        raise ConfigurationError(f"cannot listen on {listen!r}: give HOST:PORT with a port from 0 to 65535")
    if host.startswith("[") and host.endswith("]"):  # an IPv6 host as a URL writes it: [::1]:9187
        host = host[1:-1]
    try:
        server, thread = start_http_server(int(port), addr=host or "127.0.0.1", registry=registry)
    except OSError as exc:  # in use, an address not of this machine, a name that does not resolve
        raise ConfigurationError(f"cannot listen on {listen!r}: {exc.strerror or exc}") from exc
    bound_host, bound_port = server.server_address[:2]
    if isinstance(bound_host, bytes):  # an AF_UNIX-style address in the stub's type; TCP gives str
        bound_host = bound_host.decode()
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    return server, thread, f"http://{shown}:{bound_port}/metrics"


def stop_serving(server: Any, thread: threading.Thread) -> None:
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def serve(
    registry: CollectorRegistry,
    listen: str,
    announce: Callable[[str], None] = print,
    stop: threading.Event | None = None,
) -> int:
    """Serve ``registry`` until interrupted (or ``stop``), saying where on start."""
    server, thread, url = start(registry, listen)
    announce(f"lr metrics: serving {url} (read from the sites at each scrape; Ctrl-C stops)")
    try:
        (stop or threading.Event()).wait()
    except KeyboardInterrupt:
        pass
    finally:
        stop_serving(server, thread)
    return 0
