"""Maintenance operators: trim a source's shared log, report a sink's receive queues, release
stale session leases. Each takes a site as the small dict ``site_dicts`` returns."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg2.extensions
from airflow.sdk import BaseOperator

from airflow_provider_lr.engine.session import runner
from airflow_provider_lr.engine.site import queue_report, status_parts
from airflow_provider_lr.engine.source import trim
from airflow_provider_lr.operators.common import final_refusals, finals_refused, site_connection


class _SiteOperator(BaseOperator):
    template_fields: Sequence[str] = ("site",)

    def __init__(self, *, site: dict[str, str], **kwargs: Any) -> None:
        final_refusals(kwargs)  # a login without lr's grant: failed at once
        super().__init__(**kwargs)
        self.site = site

    @contextlib.contextmanager
    def connection(self) -> Iterator[psycopg2.extensions.connection]:
        """The site's connection; what no retry mends, in the work done on it, refused for good."""
        with finals_refused(self.log, self.task_id, f"site {self.site['site']}: "):
            with site_connection(self.site["conn_id"], self.site["site"]) as conn:
                yield conn


class LRTrimOperator(_SiteOperator):
    """Trim a source's shared log: safe trim (what every session has acknowledged) by default, or
    a retention trim of what is older than ``retention_seconds`` whatever the sessions say (a
    session left behind is sent to a snapshot sync at its next negotiation)."""

    template_fields: Sequence[str] = ("site", "retention_seconds")

    def __init__(self, *, retention_seconds: float | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.retention_seconds = retention_seconds

    def execute(self, context: Any) -> dict[str, Any]:
        with self.connection() as conn:
            if self.retention_seconds is None:
                result = trim.safe_trim(conn)
            else:
                result = trim.retention_trim(conn, float(self.retention_seconds))
        mode = "safe" if self.retention_seconds is None else f"retention {self.retention_seconds}s"
        if result is None:
            self.log.info(
                "%s: %s trim skipped (a commit in flight holds the barrier)",
                self.site["site"],
                mode,
            )
            return {"site": self.site["site"], "mode": mode, "trimmed": False}
        self.log.info(
            "%s: %s trim to %d, %d entries removed", self.site["site"], mode, result.trim_mark, result.entries_removed
        )
        return {
            "site": self.site["site"],
            "mode": mode,
            "trimmed": True,
            "trim_mark": result.trim_mark,
            "entries_removed": result.entries_removed,
        }


class LRReceiveQueueReportOperator(_SiteOperator):
    """Checkpoint of a sink's receive queues: messages waiting for subscribers, unapplied snapshot
    rows, the oldest waiting message and dead letters; warns when the oldest waits longer than
    ``warn_after_seconds`` (a subscriber that stopped consuming) or dead letters exist. A queue
    table another session holds locked (VACUUM FULL, an admin's ``LOCK``) is waited for as ``lr
    status`` waits (about a second), then warned of as not read, naming the pid that holds it
    (``queues`` None, ``unread`` the line): a report warns, it does not fail the run (it failed after
    the whole lock_timeout with a bare lock error)."""

    template_fields: Sequence[str] = ("site", "warn_after_seconds")

    def __init__(self, *, warn_after_seconds: float = 3600.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.warn_after_seconds = warn_after_seconds

    def execute(self, context: Any) -> dict[str, Any]:
        with self.connection() as conn:
            queues, unread = status_parts.read_alone(conn, "receive queues", lambda: queue_report.receive_queues(conn))
        if queues is None:
            self.log.warning("%s: %s", self.site["site"], "; ".join(unread))
            return {"site": self.site["site"], "queues": None, "unread": unread}
        for q in queues:
            stale = q["oldest_waiting_s"] > float(self.warn_after_seconds)
            (self.log.warning if stale or q["dead_letters"] else self.log.info)(
                "%s %s: %d waiting (oldest %.0fs), %d unapplied snapshot rows, %d dead letters",
                self.site["site"],
                q["queue"],
                q["waiting"],
                q["oldest_waiting_s"],
                q["unapplied_snapshot"],
                q["dead_letters"],
            )
        return {"site": self.site["site"], "queues": queues, "unread": unread}


class LRStaleLeaseCleanupOperator(_SiteOperator):
    """Release the expired session leases of a source (their holders died); fencing is unchanged."""

    def execute(self, context: Any) -> dict[str, Any]:
        with self.connection() as conn:
            released = runner.clear_stale_leases(conn)
        self.log.info("%s: released %d stale lease(s) %s", self.site["site"], len(released), released)
        return {"site": self.site["site"], "released": released}
