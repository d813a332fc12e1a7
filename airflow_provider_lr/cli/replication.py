"""``lr topology``, ``lr sync`` and ``lr trim``: replication without Airflow (``lr full-sync``: ``full_sync.py``)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg2
import psycopg2.extensions

from airflow_provider_lr.cli.common import (
    UsageError,
    at_site,
    check_topology,
    connector,
    listen_address,
    load_topology,
    nonnegative_seconds,
    positive_int,
    with_topology,
)
from airflow_provider_lr.engine import progress
from airflow_provider_lr.engine.db import conninfo
from airflow_provider_lr.engine.db.timeouts import DEADLINES
from airflow_provider_lr.engine.errors import (
    LRError,
    RepeatedErrors,
    listing,
    one_line,
    still_failing,
)
from airflow_provider_lr.engine.session import stream
from airflow_provider_lr.engine.session.runner import CycleReport, unsettled
from airflow_provider_lr.engine.site import metrics, replicator, topology
from airflow_provider_lr.engine.site.stale_topology import StaleWatch, sync_check
from airflow_provider_lr.engine.source import trim
from airflow_provider_lr.engine.store import topology as topologies


def _warn_providers(topo: topologies.Topology) -> None:
    for warning in topology.provider_warnings(topo):
        print(f"lr: warning: {warning}", file=sys.stderr)


def cmd_topology_apply(args: argparse.Namespace) -> int:
    topo = load_topology(args)
    _warn_providers(topo)
    for site_id, (pruned, kept) in topology.apply_everywhere(topo, connector(topo), prune=args.prune).items():
        sessions = [str(k) for k in topo.sessions(source=site_id)]
        print(
            f"{site_id}: topology {topo.topology_config_id} applied; source of "
            f"{listing(sessions) if sessions else 'no sessions'}"
        )
        for name in pruned:
            print(f"  pruned sink session {name} (no longer in the topology)")
        for why in kept:
            print(f"  kept sink session {why}; prune again once they are consumed")
    return 0


def cmd_topology_validate(args: argparse.Namespace) -> int:
    topo = load_topology(args)
    sessions = topo.sessions()
    print(
        f"{args.topology or topologies.default_path()}: valid; topology "
        f"{topo.topology_config_id}, {len(topo.sites)} sites, {len(sessions)} sessions"
    )
    for key in sessions:
        print(f"  {key}")
    _warn_providers(topo)
    for warning in topology.connection_warnings(topo):
        print(f"lr: warning: {warning}", file=sys.stderr)
    return 0


def cycle_line(r: CycleReport) -> str:
    """One session's cycle as ``lr sync`` prints it: only what the cycle knows (a session that failed
    before it was negotiated has no state, position or backlog to show, so none is made up)."""
    if r.error and not r.decision:
        return f"{r.session}: ERROR {r.error}"
    parts = [r.decision or "-", f"state={r.state or '-'}", f"delivered={r.delivered}"]
    if r.snapshot_messages:
        parts.append(f"snapshot={r.snapshot_messages}")
    if r.tables:
        prefix = f"{r.session}:"
        names = ", ".join(t.removeprefix(prefix) for t in r.tables)
        parts.append(f"table rows={r.table_rows} ({names})")
    if r.acked_position >= 0:
        parts.append(f"acked={r.acked_position}")
    if not r.error:
        parts.append(f"remaining={r.remaining}")
    line = f"{r.session}: {' '.join(parts)}"
    line += f" SKIPPED: {r.skipped}" if r.skipped else ""
    return line + (f" ERROR {r.error}" + (f" ({one_line(r.reason)})" if r.reason else "") if r.error else "")


def _say(behind: str) -> None:
    print(f"lr sync: {behind}", file=sys.stderr, flush=True)


def _replicated(args: argparse.Namespace, what: str) -> topologies.Topology:
    """The topology, refused when it has no session: ``what`` would silently do nothing. A
    connections file that cannot be read is refused here too, before any site is reached (exit 2,
    one line, as every other command says it): ``lr sync`` said it twice, first as the in-process
    fan-out's reason not to run."""
    topo = load_topology(args)
    if not topo.sessions():
        raise LRError(
            f"{args.topology or topologies.default_path()}: the topology replicates nothing (no "
            f"replication: entry), so there is nothing to {what}"
        )
    conninfo.load_connections_file()  # ``InputError`` naming the file, what is wrong and where
    return topo


STOPPING = (
    "lr sync: stopping (SIGTERM): the step in progress ends first (a full sync's supply takes as long as "
    "its provider); SIGTERM again stops at once, rolling that step back\n"
)


STOPPING_CALLS_S = 3.0  # a stopping lr sync: the longest any call of its waits (DEADLINES.hurry)


def _stop_asked(stop: threading.Event, now: bool = False) -> None:
    """SIGTERM: leave cleanly once the step in progress ends, and say so (a provider's supply may
    run for minutes, and a stop that said nothing looked hung); a second SIGTERM (or Ctrl-C: ``now``)
    leaves now: that step's transaction is rolled back and the leases are released. A site that
    stopped answering holds the stop ``STOPPING_CALLS_S`` per call, not a call deadline each."""
    DEADLINES.hurry(STOPPING_CALLS_S)
    if now or stop.is_set():
        raise KeyboardInterrupt
    stop.set()
    os.write(sys.stderr.fileno(), STOPPING.encode())  # not print: the handler may interrupt one


REPORT_EVERY = 30.0  # lr sync streaming: seconds between progress lines, unless --report-every says
GIVE_UP_AFTER = 60.0  # lr sync --until-idle: seconds without progress before it gives up


def cmd_sync(args: argparse.Namespace) -> int:
    if args.once and args.cycles is not None:  # --cycles was ignored, silently
        raise UsageError(f"--once is one cycle, --cycles N is N: give one of them (not both: --cycles {args.cycles})")
    if args.give_up_after is not None and not args.until_idle:  # it was ignored, silently
        raise UsageError("--give-up-after applies to --until-idle only: no other run of lr sync gives up")
    streaming = not (args.once or args.cycles or args.until_idle or args.no_stream)
    if args.report_every is not None and not streaming:  # it was ignored, silently
        raise UsageError(
            "--report-every applies to a streaming lr sync only (no --once, --cycles, --until-idle or "
            "--no-stream): a run of cycles prints a line per cycle instead"
        )
    topo = _replicated(args, "sync")
    stop = threading.Event()
    # before the start (the sites' check, joining the members): a SIGTERM then stops it cleanly too
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: _stop_asked(stop))  # a service manager's stop: leave cleanly
        signal.signal(signal.SIGINT, lambda *_: _stop_asked(stop, now=True))
    # an open-ended run shares the sessions with the other `lr sync` processes (membership); a
    # bounded one (a batch, a catch-up) works every session it can lease, as it ends anyway
    bounded = bool(args.once or args.cycles or args.until_idle)
    # an open-ended run follows its topology file (an edit applied meanwhile: sessions, sites)
    following: list[replicator.Replicator] = []

    def connect(site_id: str) -> psycopg2.extensions.connection:
        return connector(following[0].topology if following else topo)(site_id)

    try:
        behind = sync_check(topo, connector)
        if behind is not None:
            _say(behind)
        repl = replicator.Replicator(
            topo, connect, log_failures=False, membership=not bounded, follow_file=not bounded, stop=stop
        )  # prints reports
    except KeyboardInterrupt:  # a second SIGTERM, or Ctrl-C, while starting: the members' lock goes with its connection
        return 1
    following.append(repl)
    stale = StaleWatch(repl, stop, behind, connector, _say)
    skips: dict[str, str] = {}  # a session leased elsewhere is said once, and again when that changes
    failing = RepeatedErrors()  # a sink down for minutes is said once, then "still failing (N times)"

    def say(subject: str, line: str, error: str, quiet: bool = False) -> None:
        if not error:
            failing.cleared(subject)
            if not quiet:
                print(line, flush=True)
            return
        times = failing.due(subject, error)
        if times:
            print(line if times == 1 else f"{subject}: {still_failing(times, error)}", flush=True)

    def show(reports: list[CycleReport]) -> None:
        stale.seen(reports)
        for r in reports:
            new_skip = bool(r.skipped) and skips.get(r.session) != r.skipped  # said once, again when it changes
            skips[r.session] = r.skipped
            say(r.session, cycle_line(r), r.error, quiet=r.idle and not (args.verbose or args.once or new_skip))

    def show_end(end: stream.StreamEnd) -> None:
        say(
            end.session,
            f"{end.session}: stream handed back after {end.delivered} entries: {end.reason}"
            + (f" ERROR {end.error}" if end.error else ""),
            end.error,
        )

    def show_counted(reports: list) -> None:
        counters.cycle(reports)  # the streamer counts its own cycles
        show(reports)

    reports: list = []
    counters = metrics.ReplicationCounters()
    served = metrics.start(counters.registry, args.metrics_listen) if args.metrics_listen else None
    if served:
        print(f"lr sync: counters at {served[2]}", flush=True)
    try:
        cycles = 1 if args.once else args.cycles
        with _progress_bars():
            if streaming:
                stream.Streamer(repl, counters=counters).run(
                    stop,
                    interval=args.interval,
                    on_cycle=show,
                    on_end=show_end,
                    on_pulse=lambda line: print(line, flush=True),
                    pulse_every=REPORT_EVERY if args.report_every is None else args.report_every,
                )
            else:
                reports = repl.run(
                    max_cycles=cycles,
                    until_idle=args.until_idle,
                    interval=args.interval,
                    on_cycle=show_counted,
                    give_up_after=GIVE_UP_AFTER if args.give_up_after is None else args.give_up_after,
                    stop=stop,
                )
    except KeyboardInterrupt:
        reports = []
    finally:
        DEADLINES.hurry(STOPPING_CALLS_S)  # leases released and membership left on a silent site: bounded
        try:
            repl.close()
        finally:
            DEADLINES.hurry(None)  # (cli.main may run again in this process)
        if served:
            metrics.stop_serving(*served[:2])
    if stale.error is not None:  # as at its start: no reachable site runs the file any more
        raise stale.error
    stuck = unsettled(reports) if args.until_idle else []
    if stuck:
        print(
            f"lr sync: {len(stuck)} session(s) not settled, no progress for {repl.stalled_for:.0f}s:", file=sys.stderr
        )
        for line in stuck:
            print(f"  {line}", file=sys.stderr)
    return 1 if stuck or any(r.error for r in reports) else 0


def cmd_trim(args: argparse.Namespace) -> int:
    topo = _replicated(args, "trim")
    sources = sorted({k.source for k in topo.sessions()})
    check_topology(topo, sources)
    for site_id in sources:
        with at_site(site_id):
            conn = connector(topo)(site_id)
            try:
                result = (
                    trim.retention_trim(conn, args.retention) if args.retention is not None else trim.safe_trim(conn)
                )
            finally:
                conn.close()
        print(
            f"{site_id}: "
            + (
                f"trimmed to {result.trim_mark} ({result.entries_removed} entries removed)"
                if result
                else "not trimmed (a commit in flight holds the barrier)"
            )
        )
    return 0


@contextmanager
def _progress_bars() -> Iterator[None]:
    """Long work (full-sync supply, transfer, apply; catch-ups) as progress bars on a terminal;
    elsewhere (a pipe, a log file) the engine's periodic log lines stay."""
    if not sys.stderr.isatty():
        yield
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TaskID, TaskProgressColumn, TextColumn, TimeRemainingColumn

    bars = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        TextColumn("{task.completed:,.0f} {task.fields[unit]}"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=False,
    )
    tasks: dict[int, TaskID] = {}

    def show(item: progress.Progress) -> None:
        task = tasks.get(id(item))
        if task is None:
            task = tasks[id(item)] = bars.add_task(item.task, total=item.total, unit=item.unit)
        bars.update(task, completed=item.done, total=item.total)
        if item.finished:
            if item.stopped:  # paused or stopped short of its end: the bar says so
                bars.update(task, description=f"{item.task} (stopped: the rest later)")
            bars.stop_task(task)
            del tasks[id(item)]

    with bars, progress.listen(show):
        yield


def _retention(text: str) -> float:
    """``--retention``: seconds, refused here by the engine's own rule (``trim.check_retention``)."""
    try:
        return trim.check_retention(nonnegative_seconds(text))
    except LRError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of seconds between 0 and {trim.MAX_RETENTION:.0f}"
        ) from None


def add_topology(sub: argparse._SubParsersAction) -> None:
    """``lr topology apply|validate``."""
    topo = sub.add_parser("topology", help="the sites and who replicates to whom").add_subparsers(
        dest="topology_command", required=True
    )
    ap = with_topology(topo.add_parser("apply", help="record the topology on every site (all or nothing)"))
    ap.add_argument(
        "--prune",
        action="store_true",
        help="also remove sink sessions the topology no longer has (kept while entries wait in their queue)",
    )
    ap.set_defaults(func=cmd_topology_apply)
    validate = topo.add_parser(
        "validate",
        help="check the topology file against its schema, offline; warn of a client without a usable "
        "full-sync provider and of a site whose connection cannot be resolved here",
    )
    with_topology(validate).set_defaults(func=cmd_topology_validate)


def add_sync(sub: argparse._SubParsersAction) -> None:
    """``lr sync`` and ``lr full-sync``."""
    sync = with_topology(
        sub.add_parser(
            "sync",
            help="replicate every session (no Airflow): streaming until stopped, or cycles (--once, "
            "--cycles, --until-idle, --no-stream); several running at once share the sessions, and "
            "take over a stopped or killed one's within seconds",
        )
    )
    sync.add_argument("--once", action="store_true", help="one cycle")
    sync.add_argument("--cycles", type=positive_int, default=None, help="at most this many cycles (default: forever)")
    sync.add_argument("--until-idle", action="store_true", help="stop when every session is caught up")
    sync.add_argument(
        "--give-up-after",
        type=nonnegative_seconds,
        default=None,
        metavar="SECONDS",
        help="with --until-idle: stop, exit 1 and say why, after this long without progress while "
        "sessions still fail or wait (default 60)",
    )
    sync.add_argument(
        "--no-stream",
        action="store_true",
        help="cycles only, as a batch replicator: negotiate every session each cycle, sleep "
        "--interval when idle (default: sessions in log-entry sync stream, woken by commits)",
    )
    sync.add_argument(
        "--interval",
        type=nonnegative_seconds,
        default=1.0,
        metavar="SECONDS",
        help="pause between idle cycles; streaming: between cycles of the sessions not streaming (default 1)",
    )
    sync.add_argument("-v", "--verbose", action="store_true", help="also print idle cycles")
    sync.add_argument(
        "--report-every",
        type=nonnegative_seconds,
        metavar="SECONDS",
        help="streaming only: a progress line this often (entries/s, lag of the session most behind; 0: none; "
        "default 30)",
    )
    sync.add_argument(
        "--metrics-listen",
        type=listen_address,
        metavar="HOST:PORT",
        help="serve this replicator's counters (entries and bytes delivered, full syncs, errors, "
        "hand-backs, a lag histogram) for Prometheus on /metrics",
    )
    sync.set_defaults(func=cmd_sync)


def add_trim(sub: argparse._SubParsersAction) -> None:
    """``lr trim``."""
    tr = with_topology(sub.add_parser("trim", help="trim the shared logs of the sources"))
    tr.add_argument(
        "--retention",
        type=_retention,
        default=None,
        metavar="SECONDS",
        help="trim what is older than this even if a session lags (default: safe trim)",
    )
    tr.set_defaults(func=cmd_trim)
