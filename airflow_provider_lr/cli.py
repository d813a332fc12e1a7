"""The ``lr`` command line: local sites, schema install, replication without Airflow, status, demo."""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import psycopg2
import yaml

from airflow_provider_lr.engine import progress
from airflow_provider_lr.engine.errors import LRError
from airflow_provider_lr.engine.session import replicator, stream
from airflow_provider_lr.engine.site import conninfo, failover, metrics, schema, status, topology
from airflow_provider_lr.engine.site import roles as site_roles
from airflow_provider_lr.engine.source import full_sync, trim
from airflow_provider_lr.engine.tables import registry as table_registry
from airflow_provider_lr.paths import lr_home

if TYPE_CHECKING:
    from airflow_provider_lr.embedded.sites import SiteManager


@contextmanager
def _embedded_tooling(args: argparse.Namespace, hint: str = "") -> Iterator[None]:
    """Import the embedded tooling (``lr sites``, ``lr demo``) only in the commands that use it: it
    is the ``[embedded]`` extra, which an Airflow worker does not install; without it, say so."""
    try:
        yield
    except ModuleNotFoundError as exc:  # the embedded package's own message names the extra to install
        raise LRError(f"{args.command}: {exc}{hint}") from exc


def _manager(args: argparse.Namespace, hint: str = "") -> SiteManager:
    with _embedded_tooling(args, hint):
        from airflow_provider_lr.embedded.sites import SiteManager
    return SiteManager(args.home)


def cmd_sites_up(args: argparse.Namespace) -> int:
    manager = _manager(args)
    ids = args.ids.split(",") if args.ids else None
    sites = manager.up(count=args.count, site_ids=ids)
    print(f"{'site':<10} {'region':<10} {'connection':<14} dsn")
    for site in sites:
        print(f"{site.site_id:<10} {site.region:<10} {site.conn_id:<14} {site.dsn()}")
    print(f"\nAirflow connections: {manager.home / 'connections.json'} (conn_file_path for dag.test)")
    print(f"                     {manager.home / 'airflow.env'} (source it: set -a; . {manager.home / 'airflow.env'})")
    return 0


def cmd_sites_down(args: argparse.Namespace) -> int:
    stopped = _manager(args).down(args.ids.split(",") if args.ids else None, remove=args.remove)
    print(("removed: " if args.remove else "stopped: ") + (", ".join(stopped) or "nothing"))
    return 0


def cmd_sites_list(args: argparse.Namespace) -> int:
    manager = _manager(args)
    sites = manager.sites()
    if not sites:
        print(f"no embedded sites under {manager.home} (start some: lr sites up --count 3)")
        return 0
    print(f"{'site':<10} {'region':<10} {'state':<8} {'port':<6} data directory")
    for site in sites:
        state = "running" if manager.is_running(site) else "stopped"
        print(f"{site.site_id:<10} {site.region:<10} {state:<8} {site.port:<6} {site.pgdata}")
    return 0


def _targets(args: argparse.Namespace) -> list[conninfo.ConnInfo]:
    if args.site:
        return [conninfo.resolve(s) for s in args.site]
    sites = _manager(args, hint=" (or name the sites with --site)").sites()
    if not sites:
        raise LRError("no --site given and no embedded sites (lr sites up --count 3)")
    return [s.conninfo() for s in sites]


def cmd_init(args: argparse.Namespace) -> int:
    for info in _targets(args):
        site_id = args.site_id or info.site_id
        if not site_id:
            raise LRError(f"{info.safe_dsn}: give --site-id (the connection has no site_id extra)")
        conn = info.connect()
        try:
            before = schema.current_version(conn)
            result = schema.init_site(conn, site_id, args.region or info.region)  # None: keep the recorded one
            refreshed = site_roles.reapply(conn) if result.applied else []  # new tables for existing roles
        finally:
            conn.close()
        change = f"upgraded {before} → {result.version}" if result.applied else f"up to date (v{result.version})"
        print(f"{site_id}: lr schema {change}" + (f"; grants refreshed for {', '.join(refreshed)}" if refreshed else ""))
    return 0


def _topology(args: argparse.Namespace) -> topology.Topology:
    return topology.load(args.topology)


def _connect(topo: topology.Topology):
    return lambda site_id: topology.site_conninfo(topo, site_id).connect()


def cmd_topology_apply(args: argparse.Namespace) -> int:
    topo = _topology(args)
    for site_id, (pruned, kept) in topology.apply_everywhere(topo, _connect(topo), prune=args.prune).items():
        sessions = [str(k) for k in topo.sessions(source=site_id)]
        print(f"{site_id}: topology {topo.topology_config_id} applied; source of {sessions or 'no sessions'}")
        for name in pruned:
            print(f"  pruned sink session {name} (no longer in the topology)")
        for why in kept:
            print(f"  kept sink session {why}; prune again once they are consumed")
    return 0


def cmd_topology_validate(args: argparse.Namespace) -> int:
    topo = _topology(args)
    sessions = topo.sessions()
    print(f"{args.topology or topology.default_path()}: valid; topology "
          f"{topo.topology_config_id}, {len(topo.sites)} sites, {len(sessions)} sessions")
    for key in sessions:
        print(f"  {key}")
    return 0


def cmd_sync(args: argparse.Namespace) -> int:
    topo = _topology(args)
    repl = replicator.Replicator(topo, _connect(topo))

    def show(reports: list) -> None:
        for r in reports:
            if r.error or not r.idle or args.verbose:
                print(f"{r.session}: {r.decision or '-'} state={r.state or '-'} delivered={r.delivered} "
                      f"snapshot={r.snapshot_messages} acked={r.acked_position} remaining={r.remaining}"
                      + (f" ERROR {r.error}" if r.error else "") + (f" ({r.reason})" if r.reason and r.error else ""),
                      flush=True)

    def show_end(end: stream.StreamEnd) -> None:
        print(f"{end.session}: stream handed back after {end.delivered} entries: {end.reason}"
              + (f" ERROR {end.error}" if end.error else ""), flush=True)

    def show_counted(reports: list) -> None:
        counters.cycle(reports)  # the streamer counts its own cycles
        show(reports)

    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: stop.set())  # a service manager's stop: leave cleanly
    streaming = not (args.once or args.cycles or args.until_idle or args.no_stream)
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
                    stop, interval=args.interval, on_cycle=show, on_end=show_end,
                    on_pulse=lambda line: print(line, flush=True), pulse_every=args.report_every)
            else:
                reports = repl.run(max_cycles=cycles, until_idle=args.until_idle, interval=args.interval,
                                   on_cycle=show_counted, give_up_after=args.give_up_after, stop=stop)
    except KeyboardInterrupt:
        reports = []
    finally:
        repl.close()
        if served:
            metrics.stop_serving(*served[:2])
    stuck = replicator.unsettled(reports) if args.until_idle else []
    if stuck:
        print(f"lr sync: {len(stuck)} session(s) not settled, no progress for {repl.stalled_for:.0f}s:",
              file=sys.stderr)
        for line in stuck:
            print(f"  {line}", file=sys.stderr)
    return 1 if stuck or any(r.error for r in reports) else 0


def cmd_full_sync(args: argparse.Namespace) -> int:
    topo = _topology(args)
    clients = [args.client] if args.client else sorted({k.client for k in topo.sessions() if k.sink == args.sink})
    sessions = [k for k in topo.sessions() if k.sink == args.sink and k.client in clients]
    if not sessions:
        raise LRError(f"no session replicates to {args.sink!r}" + (f" for client {args.client!r}" if args.client else ""))
    for key in sessions:
        conn = _connect(topo)(key.source)
        try:
            request = full_sync.request_full_sync(conn, key.sink, key.client, args.reason, forced=True)
        finally:
            conn.close()
        print(f"{key}: full sync requested ({request.request_id}); `lr sync` or the lr_replication DAG carries it out")
    return 0


def cmd_failover(args: argparse.Namespace) -> int:
    """``--promote SITE``: fail its source's clients over to it (docs/failover.md); ``--rejoin SITE``:
    the old source (or a site the failover could not reach) takes the new topology."""
    topo = _topology(args)
    if args.rejoin:
        back = failover.rejoin(args.rejoin, _connect(topo), topo)
        print(f"{back.site}: topology {back.topology_config_id} of failover {back.failover_id} applied")
        for name in back.retired:
            print(f"  retired source session {name}")
        for client, count in back.tail.items():
            print(f"  {client}: {count} entries committed here after the cut were received by nobody (not replicated)")
        print("  its sessions from the new source start with a full sync (`lr sync` or the lr_replication DAG)")
        return 0
    old = args.from_site or failover.only_source(topo, args.promote)
    done = failover.promote(old, args.promote, _connect(topo), topology=topo, clients=args.client or None,
                            reason=args.reason, same_destinations=args.same_destinations, planned=args.planned)
    out = args.out or os.path.join(lr_home(), f"topology-{done.topology.topology_config_id}.yaml")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w", encoding="utf-8") as fh:
        yaml.safe_dump(done.topology.document, fh, sort_keys=False)
    kind = "planned switchover" if done.planned else "unplanned failover"
    print(f"{kind} {done.failover_id}{' (resumed)' if done.resumed else ''}: {done.to_site} is the source of "
          f"{', '.join(done.clients)} (was {done.from_site}); cut at {done.positions}, new sessions after {done.base}")
    for site, notes in sorted(done.outcome.items()):
        for client, note in notes.items():
            print(f"  {site}/{client}: {note}")
    print(f"  lost: {done.lost}")
    print(f"  new topology {done.topology.topology_config_id} written to {out}: use it from now on (LR_TOPOLOGY)")
    for site in done.pending:
        print(f"  {site} was not reached: when it is back, run `lr failover --rejoin {site}`")
    return 0


def _site_statuses(topo: topology.Topology) -> dict[str, status.SiteStatus | str]:
    """Every site's status, or why it could not be read (a site that is down is part of the status)."""
    found: dict[str, status.SiteStatus | str] = {}
    for site_id in sorted(topo.sites):
        try:
            conn = _connect(topo)(site_id)
        except Exception as exc:
            found[site_id] = f"{site_id}: UNREACHABLE ({str(exc).strip()})"
            continue
        try:
            found[site_id] = status.site_status(conn, site_id)
        except (LRError, psycopg2.Error) as exc:
            found[site_id] = f"{site_id}: UNREADABLE ({str(exc).strip()})"
        finally:
            conn.close()
    return found


def cmd_status(args: argparse.Namespace) -> int:
    """Exit code: 0 healthy, 1 degraded (a session errs, is behind its trim mark or lags more
    than --max-lag), 2 a site could not be reached."""
    found = _site_statuses(_topology(args))
    code, reasons = status.health(found, args.max_lag)
    if args.json:
        print(json.dumps(status.sites_as_dict(found, args.max_lag), indent=2))
        return code
    print(status.render_sites(found))
    print(f"health: {['healthy', 'degraded', 'unreachable'][code]}" + "".join(f"\n  {r}" for r in reasons))
    return code


def cmd_metrics(args: argparse.Namespace) -> int:
    """Prometheus text exposition of every site's status (for node_exporter's textfile collector,
    or a scrape through `lr metrics --listen`)."""
    topo = _topology(args)
    registry = metrics.status_registry(lambda: _site_statuses(topo))
    if args.listen:
        return metrics.serve(registry, args.listen, announce=lambda line: print(line, flush=True))
    sys.stdout.write(metrics.exposition(registry))
    return 0


def cmd_trim(args: argparse.Namespace) -> int:
    topo = _topology(args)
    sources = sorted({k.source for k in topo.sessions()})
    for site_id in sources:
        conn = _connect(topo)(site_id)
        try:
            result = trim.retention_trim(conn, args.retention) if args.retention is not None else trim.safe_trim(conn)
        finally:
            conn.close()
        print(f"{site_id}: " + (f"trimmed to {result.trim_mark} ({result.entries_removed} entries removed)"
                                if result else "not trimmed (a commit in flight holds the barrier)"))
    return 0


def _site_name(info: conninfo.ConnInfo) -> str:
    return info.site_id or info.conn_id or info.safe_dsn


def cmd_roles_change(args: argparse.Namespace) -> int:
    """lr roles grant|revoke: the same plan on every site (``--print``: show it, change nothing)."""
    password = None
    if getattr(args, "password_env", None):
        import os

        password = os.environ.get(args.password_env)
        if password is None:
            raise LRError(f"--password-env {args.password_env}: that environment variable is not set")
    for info in _targets(args):
        conn = info.connect()
        try:
            if args.roles_command == "grant":
                plan = site_roles.plan_grant(conn, args.kind, args.role, args.client or (), args.create, password)
            else:
                plan = site_roles.plan_revoke(conn, args.kind, args.role, args.client or ())
            if args.dry_run:
                print(f"-- {_site_name(info)}")
                print("\n".join(site_roles.render(conn, plan)))
                continue
            site_roles.run(conn, plan)
        finally:
            conn.close()
        what = args.kind + (f" of {', '.join(args.client)}" if args.client else "")
        done = "granted to" if args.roles_command == "grant" else "revoked from"
        print(f"{_site_name(info)}: {what} {done} {args.role}")
    return 0


def cmd_roles_list(args: argparse.Namespace) -> int:
    for info in _targets(args):
        conn = info.connect()
        try:
            found = site_roles.list_grants(conn)
        finally:
            conn.close()
        print(f"{_site_name(info)}: " + ("no roles granted" if not found else ""))
        for grant in found:
            print(f"  {grant.describe()}")
    return 0


def cmd_tables_open(args: argparse.Namespace) -> int:
    """lr tables open: record a table for a client on each site given (default, when federating:
    the sources of the client's sessions)."""
    topo = _topology(args)
    if not args.federated and not args.site:
        raise LRError("--no-federated: name the --site(s) that keep out of the table (on a source it stops "
                      "the capture; on a sink its data is dropped)")
    sites = args.site or sorted({k.source for k in topo.sessions() if k.client == args.client})
    if not sites:
        raise LRError(f"client {args.client!r} is replicated by no session of the topology; name the --site")
    for site_id in sites:
        conn = _connect(topo)(site_id)
        try:
            table = table_registry.open_table(conn, args.table, args.client, args.federated)
        finally:
            conn.close()
        print(f"{site_id}: {table.describe()}")
    return 0


def cmd_tables_list(args: argparse.Namespace) -> int:
    topo = _topology(args)
    for site_id in (args.site or sorted(topo.sites)):
        conn = _connect(topo)(site_id)
        try:
            found = table_registry.list_tables(conn)
        finally:
            conn.close()
        print(f"{site_id}:" + ("" if found else " no tables registered"))
        for table in found:
            print(f"  {table.describe()}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    with _embedded_tooling(args):
        from airflow_provider_lr.embedded import demo
    return demo.run(_manager(args), sink_count=args.sinks)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return value


def _seconds(text: str) -> float:
    """A finite, non-negative number of seconds."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (0 or more)")
    return seconds


@contextmanager
def _progress_bars() -> Iterator[None]:
    """Long work (full-sync supply, transfer, apply; catch-ups) as progress bars on a terminal;
    elsewhere (a pipe, a log file) the engine's periodic log lines stay."""
    if not sys.stderr.isatty():
        yield
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

    bars = Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                    TextColumn("{task.completed:,.0f} {task.fields[unit]}"), TimeRemainingColumn(),
                    console=Console(stderr=True), transient=False)
    tasks: dict[int, object] = {}

    def show(item: progress.Progress) -> None:
        task = tasks.get(id(item))
        if task is None:
            task = tasks[id(item)] = bars.add_task(item.task, total=item.total, unit=item.unit)
        bars.update(task, completed=item.done, total=item.total)
        if item.finished:
            bars.stop_task(task)
            del tasks[id(item)]

    with bars, progress.listen(show):
        yield


def _retention(text: str) -> float:
    """``--retention``: seconds, refused here by the engine's own rule (``trim.check_retention``)."""
    try:
        return trim.check_retention(_seconds(text))
    except LRError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of seconds between 0 and {trim.MAX_RETENTION:.0f}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lr", description="Log replication between PostgreSQL sites.")
    parser.add_argument("--home", default=None, help=f"state directory (default $LR_HOME or {lr_home()})")
    sub = parser.add_subparsers(dest="command", required=True)

    sites = sub.add_parser("sites", help="embedded PostgreSQL sites for local use").add_subparsers(
        dest="sites_command", required=True
    )
    up = sites.add_parser("up", help="start N sites (one PostgreSQL server and data directory each)")
    up.add_argument("--count", type=_positive_int, default=None)
    up.add_argument("--ids", help="comma-separated site ids instead of site-a, site-b, ...")
    up.set_defaults(func=cmd_sites_up)
    down = sites.add_parser("down", help="stop sites")
    down.add_argument("--ids")
    down.add_argument("--remove", action="store_true", help="also delete their data")
    down.set_defaults(func=cmd_sites_down)
    sites.add_parser("list", help="list sites and whether they run").set_defaults(func=cmd_sites_list)

    init = sub.add_parser("init", help="install or upgrade the lr schema on sites")
    init.add_argument("--site", action="append", help="DSN or Airflow connection id (default: all embedded sites)")
    init.add_argument("--site-id", help="site id to record (default: the connection's site_id extra)")
    init.add_argument("--region")
    init.set_defaults(func=cmd_init)

    def with_topology(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--topology", help="topology YAML (default $LR_TOPOLOGY or include/topology.yaml)")
        return p

    topo = sub.add_parser("topology", help="the sites and who replicates to whom").add_subparsers(
        dest="topology_command", required=True
    )
    ap = with_topology(topo.add_parser("apply", help="record the topology on every site (all or nothing)"))
    ap.add_argument("--prune", action="store_true",
                    help="also remove sink sessions the topology no longer has (kept while entries wait in their queue)")
    ap.set_defaults(func=cmd_topology_apply)
    with_topology(topo.add_parser("validate", help="check the topology file against its schema")).set_defaults(
        func=cmd_topology_validate
    )

    sync = with_topology(sub.add_parser(
        "sync", help="replicate every session (no Airflow): streaming until stopped, or cycles (--once, "
                     "--cycles, --until-idle, --no-stream)"))
    sync.add_argument("--once", action="store_true", help="one cycle")
    sync.add_argument("--cycles", type=_positive_int, default=None, help="at most this many cycles (default: forever)")
    sync.add_argument("--until-idle", action="store_true", help="stop when every session is caught up")
    sync.add_argument("--give-up-after", type=_seconds, default=60.0, metavar="SECONDS",
                      help="with --until-idle: stop, exit 1 and say why, after this long without progress while "
                           "sessions still fail or wait (default 60)")
    sync.add_argument("--no-stream", action="store_true",
                      help="cycles only, as a batch replicator: negotiate every session each cycle, sleep "
                           "--interval when idle (default: sessions in log-entry sync stream, woken by commits)")
    sync.add_argument("--interval", type=_seconds, default=1.0,
                      help="pause between idle cycles (s); streaming: between cycles of the sessions not streaming")
    sync.add_argument("-v", "--verbose", action="store_true", help="also print idle cycles")
    sync.add_argument("--report-every", type=_seconds, default=30.0, metavar="SECONDS",
                      help="streaming: a progress line this often (entries/s, lag of the session most behind; "
                           "0: none; default 30)")
    sync.add_argument("--metrics-listen", metavar="HOST:PORT",
                      help="serve this replicator's counters (entries and bytes delivered, full syncs, errors, "
                           "hand-backs, a lag histogram) for Prometheus on /metrics")
    sync.set_defaults(func=cmd_sync)

    fs = with_topology(sub.add_parser("full-sync", help="force a full (snapshot) sync of the sessions to a sink"))
    fs.add_argument("--sink", required=True)
    fs.add_argument("--client")
    fs.add_argument("--reason", default="requested from the command line")
    fs.set_defaults(func=cmd_full_sync)

    fo = with_topology(sub.add_parser("failover", help="make a sink the source of its clients, or rejoin the old "
                                      "source as a sink (docs/failover.md)"))
    which = fo.add_mutually_exclusive_group(required=True)
    which.add_argument("--promote", metavar="SITE", help="the sink that becomes the source")
    which.add_argument("--rejoin", metavar="SITE", help="apply the failover's topology on a site that was not reached")
    fo.add_argument("--from", dest="from_site", metavar="SITE", help="the old source (default: the promoted site's)")
    fo.add_argument("--client", action="append", help="a client to fail over (repeat; default: all it receives)")
    fo.add_argument("--reason", default="failover from the command line")
    fo.add_argument("--same-destinations", action="store_true",
                    help="every entry of these clients went to all their sinks: a sink behind the promoted one "
                         "gets the gap copied from it instead of a full sync")
    fo.add_argument("--planned", action=argparse.BooleanOptionalAction, default=None,
                    help="drain the old source first (default: when it can be reached)")
    fo.add_argument("--out", help="where to write the new topology (default: $LR_HOME/topology-<id>.yaml)")
    fo.set_defaults(func=cmd_failover)

    st = with_topology(sub.add_parser("status", help="sessions, states, lag and what holds the log back "
                                                     "(exit 0 healthy, 1 degraded, 2 unreachable)"))
    st.add_argument("--json", action="store_true", help="machine-readable, for scripts")
    st.add_argument("--max-lag", type=_seconds, default=None, metavar="SECONDS",
                    help="also degraded when a session's oldest undelivered entry is older than this")
    st.set_defaults(func=cmd_status)
    me = with_topology(sub.add_parser("metrics", help="status as Prometheus metrics (text exposition)"))
    me.add_argument("--listen", metavar="HOST:PORT",
                    help="serve /metrics over HTTP (read from the sites at each scrape) instead of printing once")
    me.set_defaults(func=cmd_metrics)

    tr = with_topology(sub.add_parser("trim", help="trim the shared logs of the sources"))
    tr.add_argument("--retention", type=_retention, default=None, metavar="SECONDS",
                    help="trim what is older than this even if a session lags (default: safe trim)")
    tr.set_defaults(func=cmd_trim)

    access = sub.add_parser("roles", help="least-privilege roles: replicator, writer or consumer of a client "
                            "(docs/security.md)").add_subparsers(dest="roles_command", required=True)
    for name, verb in (("grant", "give"), ("revoke", "take")):
        change = access.add_parser(name, help=f"{verb} a role the rights of a replicator, writer or consumer")
        change.add_argument("kind", choices=site_roles.KINDS)
        change.add_argument("--role", required=True, help="the PostgreSQL role (a login role, or a group of them)")
        change.add_argument("--client", action="append", help="writer/consumer: the client (repeatable)")
        change.add_argument("--site", action="append", help="DSN or Airflow connection id, as the owner of the lr "
                            "schema (default: all embedded sites)")
        change.add_argument("--print", dest="dry_run", action="store_true", help="print the SQL, change nothing")
        if name == "grant":
            change.add_argument("--create", action="store_true", help="create the role (LOGIN) where it is missing")
            change.add_argument("--password-env", metavar="VAR", help="--create: its password, from this variable")
        change.set_defaults(func=cmd_roles_change)
    shown = access.add_parser("list", help="the roles granted on each site")
    shown.add_argument("--site", action="append", help="DSN or Airflow connection id (default: all embedded sites)")
    shown.set_defaults(func=cmd_roles_list)

    tables = sub.add_parser("tables", help="federated tables: replicated by lr itself (docs/tables.md)").add_subparsers(
        dest="tables_command", required=True)
    op = with_topology(tables.add_parser("open", help="record a table for a client; --federated (default) "
                                         "captures and replicates it, --no-federated keeps a site out of it"))
    op.add_argument("table", help="SCHEMA.TABLE (a bare name is in public)")
    op.add_argument("--client", required=True, help="the client whose sessions carry the table")
    op.add_argument("--federated", action=argparse.BooleanOptionalAction, default=True)
    op.add_argument("--site", action="append", help="site id (repeatable; default with --federated: the "
                    "client's sources)")
    op.set_defaults(func=cmd_tables_open)
    ls = with_topology(tables.add_parser("list", help="the tables registered on each site"))
    ls.add_argument("--site", action="append", help="site id (repeatable; default: every site)")
    ls.set_defaults(func=cmd_tables_list)

    demo = sub.add_parser("demo", help="run the end-to-end demo on embedded sites")
    demo.add_argument("--sinks", type=_positive_int, default=2)
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # progress of long work (full-sync transfers) and per-session failures, on stderr
    logging.basicConfig(level=logging.WARNING, format="lr: %(message)s")
    logging.getLogger("airflow_provider_lr").setLevel(logging.INFO)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except LRError as exc:
        print(f"lr: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `lr status | head`: the reader went away; stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
