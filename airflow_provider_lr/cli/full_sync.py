"""``lr full-sync``: force a full (snapshot) sync of the chosen sessions, and ``--wait`` for them."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import TypeVar

import psycopg2

from airflow_provider_lr.cli.common import (
    check_topology,
    connector,
    load_topology,
    named,
    nonnegative_seconds,
    reason_text,
    unreachable,
    with_topology,
)
from airflow_provider_lr.engine.errors import LRError, SiteUnreachableError, one_line
from airflow_provider_lr.engine.session import lease
from airflow_provider_lr.engine.site.failover_record import moved_on
from airflow_provider_lr.engine.source import full_sync
from airflow_provider_lr.engine.store import topology as topologies
from airflow_provider_lr.engine.vocabulary import SessionKey

T = TypeVar("T")


def cmd_full_sync(args: argparse.Namespace) -> int:
    """Force a full sync of the chosen sessions (a sink, a source, a client, or all of them at
    once); ``--wait``: until each request is applied at its sink, by whichever replicator (the
    seconds counted from the command's start: a site's connect timeout is in them)."""
    started = time.monotonic()
    topo = load_topology(args)
    named(topo, sites=(args.source, args.sink), clients=(args.client,))
    keys = topo.select(args.source, args.sink, args.client)
    check_topology(topo, {site for k in keys for site in (k.source, k.sink)})
    requests = full_sync.request_for_sessions(keys, connector(topo), args.reason)
    print(f"full sync requested for {len(requests)} session(s):")
    for key, request in requests.items():
        print(f"  {key}: request {request.request_id}")
    if args.wait is None:
        print("`lr sync`, lr_streaming or the lr_replication DAG carries them out (`lr full-sync --wait` waits)")
        return 0
    # a sink that did not answer the topology check (a stopped server) cannot apply its request
    # meanwhile: not waited for (the wait took --wait more, then named nobody), said at once
    lost = {site: why for site in sorted({k.sink for k in requests}) if (why := unreachable(topo, site))}
    waited = {key: r.request_id for key, r in requests.items() if key.sink not in lost}
    sources = _Sources(topo)
    try:
        outcomes = _wait_applied(sources, waited, max(0.0, started + args.wait - time.monotonic())) if waited else {}
        pending = [k for k, f in outcomes.items() if f is not None and f.outcome is full_sync.Outcome.PENDING]
        workers = _who_works_on(sources, pending)
    finally:
        sources.close()
    for key in requests:
        if key.sink in lost:
            print(f"  {key}: not applied: its sink {key.sink} does not answer ({lost[key.sink]}); not waited for")
            continue
        at = sources.moved.get(key, key)
        silent = sources.silent.get(at.source)
        if key not in outcomes:  # its source never answered a look
            print(f"  {key}: not known to be applied: its source {at.source} does not answer ({silent})")
            continue
        found = outcomes[key]
        said = found.describe() if found is not None else "request gone"
        if at != key:
            said = f"failed over: asked of {at.source} as {at}: {said}"
        if silent and (found is None or not found.final):
            said += f"; its source {at.source} did not answer the last look ({silent})"
        print(f"  {key}: {said}{workers.get(key, '')}")
    applied = all(
        k in outcomes and (f := outcomes[k]) is not None and f.outcome is full_sync.Outcome.APPLIED for k in waited
    )
    return 0 if applied and not lost else 1


class _Sources:
    """One connection per source for the whole wait (its looks, then what it says of each request
    still open), opened when first needed and again once after one was lost (a source restarted
    meanwhile). Before, every look connected to each source anew and the end once per session
    pending: a minute's wait on 40 sessions made about 100 connections to a source. A source that
    does not answer a look (stopped, restarting) is looked at again at the next one: its requests
    are kept on it, and a replicator applies them once it is back, so the wait goes on (it ended at
    once, exit 1, saying nothing of any request); ``silent`` says why it did not answer the last."""

    def __init__(self, topo: topologies.Topology) -> None:
        self.topo = topo
        self.conns: dict[str, psycopg2.extensions.connection] = {}
        self.silent: dict[str, str] = {}  # a source that did not answer its last look -> why
        self.moved: dict[SessionKey, SessionKey] = {}  # a request a failover asked of the new source -> its session

    def each(
        self, source: str, keys: list[SessionKey], work: Callable[[psycopg2.extensions.connection, SessionKey], T]
    ) -> dict[SessionKey, T]:
        """``work`` for each of ``keys`` of ``source`` on its connection; connected anew and run
        again once when that connection was lost; nothing (noted in ``silent``) when the source
        does not answer."""
        mine = [k for k in keys if k.source == source]
        for last in (False, True):
            try:
                conn = self._conn(source)
                done = {k: work(conn, k) for k in mine}
            except SiteUnreachableError as exc:
                self.silent[source] = one_line(exc)
                return {}
            except (psycopg2.OperationalError, psycopg2.InterfaceError) as exc:
                lost = self.conns.pop(source, None)  # none: lost while it was being set up
                if lost is not None:
                    lost.close()
                if last:
                    self.silent[source] = one_line(exc)
                continue
            self.silent.pop(source, None)
            return done
        return {}

    def _conn(self, source: str) -> psycopg2.extensions.connection:
        conn = self.conns.get(source)
        if conn is None or conn.closed:
            conn = self.conns[source] = connector(self.topo)(source)
        return conn

    def close(self) -> None:
        for conn in self.conns.values():
            conn.close()
        self.conns.clear()


def _who_works_on(sources: _Sources, keys: list[SessionKey]) -> dict[SessionKey, str]:
    """Why each request of ``keys`` is still open: the replicator holding its session, or nobody (no
    `lr sync` runs, lr_streaming is paused), and the session's last error (its sink unreachable,
    say), which a new user otherwise has to guess."""
    said: dict[SessionKey, str] = {}
    back = {sources.moved.get(k, k): k for k in keys}  # a request a failover moved: its new session
    for source in sorted({k.source for k in back}):
        try:
            said.update({back[k]: why for k, why in sources.each(source, list(back), _works_on).items()})
        except (LRError, psycopg2.Error):  # the source is gone meanwhile: the outcome alone is said
            continue
    return said


def _works_on(conn: psycopg2.extensions.connection, key: SessionKey) -> str:
    """What ``_who_works_on`` says of one session, on its source's connection."""
    return lease.works_on(conn, key.sink, key.client)


def _wait_applied(sources: _Sources, requests: dict, timeout: float) -> dict:
    """Each request's outcome (``full_sync.outcome``) once it is final, or after ``timeout`` seconds:
    the last pause is cut at the deadline (a pause doubling to 5 s slept past it), and at most 1 s
    passes between two looks (on one connection per source, at the requests not final yet), so an
    applied request is said soon. A request a failover asked of the new source instead is followed
    there (``sources.moved``): before, the wait said the old one cancelled ('session removed from the
    topology') or that no replicator held its session."""
    deadline, pause = time.monotonic() + timeout, 0.2
    found: dict = {}
    ids = dict(requests)
    where: dict[SessionKey, str] = {}  # the session a request is looked at on -> its id there
    awaiting: set[SessionKey] = set()  # closed by a switchover's drain, not asked of the new source yet

    def look(conn: psycopg2.extensions.connection, key: SessionKey) -> full_sync.RequestOutcome | None:
        return full_sync.outcome(conn, where[key])

    while True:
        open_ = [k for k in ids if _still_open(found, awaiting, k)]
        at = {k: sources.moved.get(k, k) for k in open_}  # where each request is looked at
        where.update({at[k]: ids[k] for k in open_})
        for source in sorted({key.source for key in at.values()}):
            mine = [k for k in open_ if at[k].source == source]
            if unreachable(sources.topo, source):  # found silent in this command: not answering again
                sources.silent.setdefault(source, unreachable(sources.topo, source) or "")
                open_ = [k for k in open_ if k not in mine]
                continue
            back = {at[k]: k for k in mine}
            looked = sources.each(source, list(back), look)
            found.update({back[key]: outcome for key, outcome in looked.items()})
        for k in open_:
            f = found.get(k)
            went = moved_on(f)
            awaiting.discard(k)
            if went is not None and went[1] is None:  # a switchover under way: its request there comes next
                awaiting.add(k)
            elif went is not None:
                sources.moved[k], ids[k] = SessionKey(went[0], k.sink, k.client), str(went[1])
                del found[k]  # looked at again, at the new source
        left = deadline - time.monotonic()
        # a request not looked at yet (its source did not answer) is still open
        if not [k for k in open_ if _still_open(found, awaiting, k)] or left <= 0:
            return found
        time.sleep(min(pause, left))
        pause = min(pause * 2, 1.0)


def _still_open(found: dict, awaiting: set[SessionKey], key: SessionKey) -> bool:
    """Not looked at yet (its source did not answer), open, or moved by a switchover under way."""
    return key not in found or key in awaiting or (found[key] is not None and not found[key].final)


def add_full_sync(sub: argparse._SubParsersAction) -> None:
    """``lr full-sync``."""
    fs = with_topology(
        sub.add_parser(
            "full-sync",
            help="force a full (snapshot) sync of the chosen sessions (none chosen: every session of the topology)",
        )
    )
    fs.add_argument("--sink", help="only the sessions to this sink (default: every sink)")
    fs.add_argument("--source", help="only the sessions from this source (default: every source)")
    fs.add_argument("--client", help="only this client's sessions (default: every client)")
    fs.add_argument(
        "--reason",
        type=reason_text,
        default="requested from the command line",
        help="recorded with each request (lr status shows it; default: 'requested from the command line')",
    )
    fs.add_argument(
        "--wait",
        type=nonnegative_seconds,
        default=None,
        metavar="SECONDS",
        help="wait up to this long until each request is applied at its sink, by whichever replicator "
        "(`lr sync`, lr_streaming, lr_replication); exit 1 unless every one was (default: return once requested)",
    )
    fs.set_defaults(func=cmd_full_sync)
