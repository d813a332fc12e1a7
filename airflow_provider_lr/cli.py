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
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Sequence

import psycopg2
import yaml

from airflow_provider_lr.engine import progress
from airflow_provider_lr.engine.errors import LRError, RepeatedErrors, TopologyMismatchError, listing, one_line, still_failing
from airflow_provider_lr.engine.site import replicator
from airflow_provider_lr.engine.session import stream
from airflow_provider_lr.engine.session.runner import CycleReport
from airflow_provider_lr.engine.db import conninfo, schema
from airflow_provider_lr.engine.site import failover, metrics, status, topology
from airflow_provider_lr.engine.store import topology as topologies
from airflow_provider_lr.engine.site import roles as site_roles
from airflow_provider_lr.engine.db.timeouts import Purpose
from airflow_provider_lr.engine.source import full_sync, trim
from airflow_provider_lr.engine.tables import registry as table_registry
from airflow_provider_lr.engine.tables.definition import TableName
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
    note = manager.relocation_note(sites)
    if note:
        print(f"\n{note}")
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
    note = manager.relocation_note(sites)
    if note:
        print(note)
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
        with _at_site(site_id):
            conn = info.connect(Purpose.BULK)  # a migration may rewrite a large table: no statement timeout
            try:
                before = schema.current_version(conn)
                result = schema.init_site(conn, site_id, args.region or info.region)  # None: keep the recorded one
                refreshed = site_roles.reapply(conn) if result.applied else []  # new tables for existing roles
            finally:
                conn.close()
        change = f"upgraded {before} → {result.version}" if result.applied else f"up to date (v{result.version})"
        print(f"{site_id}: lr schema {change}" + (f"; grants refreshed for {', '.join(refreshed)}" if refreshed else ""))
    return 0


def _topology(args: argparse.Namespace) -> topologies.Topology:
    return topologies.load(args.topology)


def _connect(topo: topologies.Topology):
    return lambda site_id: topologies.site_conninfo(topo, site_id).connect()


def _warn_providers(topo: topologies.Topology) -> None:
    for warning in topology.provider_warnings(topo):
        print(f"lr: warning: {warning}", file=sys.stderr)


def _check(topo: topologies.Topology, sites: Iterable[str] | None = None, also: Iterable[str] = ()) -> None:
    """Refuse a topology file that the reachable ``sites`` (default: all) do not run (a stale file
    after a failover, an edited one not applied), naming the file and the ids the sites hold."""
    topology.check_sites(topo, _connect(topo), None if sites is None else set(sites), set(also))


def cmd_topology_apply(args: argparse.Namespace) -> int:
    topo = _topology(args)
    _warn_providers(topo)
    for site_id, (pruned, kept) in topology.apply_everywhere(topo, _connect(topo), prune=args.prune).items():
        sessions = [str(k) for k in topo.sessions(source=site_id)]
        print(f"{site_id}: topology {topo.topology_config_id} applied; source of "
              f"{listing(sessions) if sessions else 'no sessions'}")
        for name in pruned:
            print(f"  pruned sink session {name} (no longer in the topology)")
        for why in kept:
            print(f"  kept sink session {why}; prune again once they are consumed")
    return 0


def cmd_topology_validate(args: argparse.Namespace) -> int:
    topo = _topology(args)
    sessions = topo.sessions()
    print(f"{args.topology or topologies.default_path()}: valid; topology "
          f"{topo.topology_config_id}, {len(topo.sites)} sites, {len(sessions)} sessions")
    for key in sessions:
        print(f"  {key}")
    _warn_providers(topo)
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


def _check_sync(topo: topologies.Topology) -> None:
    """``lr sync`` from a file no reachable site runs is refused outright (a stale file, an edited
    one not applied). When only some sites run another topology (a site a failover could not
    reach, before ``lr failover --rejoin``), it is said once here and the sessions on those sites
    are refused cycle by cycle (each one's error names the file), while the others replicate."""
    sites = {site for key in topo.sessions() for site in (key.source, key.sink)}
    recorded = topology.recorded_ids(topo, _connect(topo), sites)
    stale = topology.unheld(topo, recorded)
    if stale is not None:
        raise TopologyMismatchError(stale.message())
    behind = topology.drift(topo, recorded)
    if behind is not None:
        print(f"lr sync: {behind.message()}; their sessions are refused", file=sys.stderr, flush=True)



def _replicated(args: argparse.Namespace, what: str) -> topologies.Topology:
    """The topology, refused when it has no session: ``what`` would silently do nothing."""
    topo = _topology(args)
    if not topo.sessions():
        raise LRError(f"{args.topology or topologies.default_path()}: the topology replicates nothing (no "
                      f"replication: entry), so there is nothing to {what}")
    return topo


def cmd_sync(args: argparse.Namespace) -> int:
    topo = _replicated(args, "sync")
    _check_sync(topo)
    repl = replicator.Replicator(topo, _connect(topo), log_failures=False)  # each report is printed here
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
        for r in reports:
            new_skip = bool(r.skipped) and skips.get(r.session) != r.skipped  # said once, again when it changes
            skips[r.session] = r.skipped
            say(r.session, cycle_line(r), r.error, quiet=r.idle and not (args.verbose or args.once or new_skip))

    def show_end(end: stream.StreamEnd) -> None:
        say(end.session, f"{end.session}: stream handed back after {end.delivered} entries: {end.reason}"
            + (f" ERROR {end.error}" if end.error else ""), end.error)

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
    """Force a full sync of the chosen sessions (a sink, a source, a client, or all of them at
    once); ``--wait``: until each request is applied at its sink, by whichever replicator."""
    topo = _topology(args)
    keys = topo.select(args.source, args.sink, args.client)
    _check(topo, {site for k in keys for site in (k.source, k.sink)})
    requests = full_sync.request_for_sessions(keys, _connect(topo), args.reason)
    print(f"full sync requested for {len(requests)} session(s):")
    for key, request in requests.items():
        print(f"  {key}: request {request.request_id}")
    if args.wait is None:
        print("`lr sync`, lr_streaming or the lr_replication DAG carries them out (`lr full-sync --wait` waits)")
        return 0
    outcomes = _wait_applied(topo, {key: r.request_id for key, r in requests.items()}, args.wait)
    for key, found in outcomes.items():
        print(f"  {key}: {found.describe() if found is not None else 'request gone'}")
    return 0 if all(f is not None and f.outcome is full_sync.Outcome.APPLIED for f in outcomes.values()) else 1


def _wait_applied(topo: topologies.Topology, requests: dict, timeout: float) -> dict:
    """Each request's outcome (``full_sync.outcome``) once it is final, or after ``timeout`` seconds."""
    deadline, pause = time.monotonic() + timeout, 0.2
    found: dict = {}
    while True:
        for source in sorted({k.source for k in requests}):
            conn = _connect(topo)(source)
            try:
                for key in (k for k in requests if k.source == source):
                    found[key] = full_sync.outcome(conn, requests[key])
            finally:
                conn.close()
        if all(f is None or f.final for f in found.values()) or time.monotonic() > deadline:
            return found
        time.sleep(pause)
        pause = min(pause * 2, 5.0)


def cmd_failover(args: argparse.Namespace) -> int:
    """``--promote SITE``: fail its source's clients over to it (docs/failover.md); ``--rejoin SITE``:
    the old source (or a site the failover could not reach) takes the new topology."""
    topo = _topology(args)
    if args.rejoin:  # the site rejoining runs an older topology by design: the file must be the others'
        stale = topology.unheld(topo, topology.recorded_ids(topo, _connect(topo), set(topo.sites) - {args.rejoin}))
        if stale is not None:
            raise TopologyMismatchError(stale.message())
        back = failover.rejoin(args.rejoin, _connect(topo), topo)
        print(f"{back.site}: topology {back.topology_config_id} of failover {back.failover_id} applied")
        for name in back.retired:
            print(f"  retired source session {name}")
        for client, count in back.tail.items():
            print(f"  {client}: {count} entries committed here after the cut were received by nobody (not replicated)")
        for client, count in back.table_tail.items():
            if count:
                print(f"  {client}: {count} table change entries committed here after the cut were received by nobody: "
                      "the new source's table snapshot replaces them")
        for table in back.guarded:
            print(f"  table {table}: a sink of the new source now; writes of this site's applications are refused")
        print("  its sessions from the new source start with a full sync (`lr sync` or the lr_replication DAG)")
        return 0
    old = args.from_site or failover.only_source(topo, args.promote)
    # sites already on this failover's topology (a re-run finishing it) are fine; any other id is not
    _check(topo, also={failover.derive(topo, old, args.promote, args.client or None)[0].topology_config_id})
    done = failover.promote(old, args.promote, _connect(topo), topology=topo, clients=args.client or None,
                            reason=args.reason, same_destinations=args.same_destinations, planned=args.planned,
                            allow_table_divergence=args.allow_table_divergence)
    out = args.out or os.path.join(lr_home(), f"topology-{done.topology.topology_config_id}.yaml")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w", encoding="utf-8") as fh:
        yaml.safe_dump(done.topology.document, fh, sort_keys=False)
    kind = "planned switchover" if done.planned else "unplanned failover"
    print(f"{kind} {done.failover_id}{' (resumed)' if done.resumed else ''}: {done.to_site} is the source of "
          f"{', '.join(done.clients)} (was {done.from_site}); cut at {listing(done.positions)}, "
          f"new sessions after {done.base}")
    for site, notes in sorted(done.outcome.items()):
        for client, note in notes.items():
            print(f"  {site}/{client}: {note}")
    for client, tables in sorted(done.tables.items()):
        if tables:
            print(f"  {client}: {done.to_site} captures its federated table(s) {', '.join(tables)}; every other sink "
                  f"takes a snapshot of them from {done.to_site}")
    for table in done.diverged:
        print(f"  DIVERGED table {table}: its replication stops (lr status lists it)")
    print(f"  lost: {done.lost}")
    print(f"  new topology {done.topology.topology_config_id} written to {out}: use it from now on (LR_TOPOLOGY)")
    for site in done.pending:
        print(f"  {site} was not reached: when it is back, run `lr failover --rejoin {site}`")
    return 0


def _site_statuses(topo: topologies.Topology) -> dict[str, status.SiteStatus | str]:
    """Every site's status, or why it could not be read (a site that is down is part of the status)."""
    found: dict[str, status.SiteStatus | str] = {}
    for site_id in sorted(topo.sites):
        try:
            conn = _connect(topo)(site_id)
        except Exception as exc:
            found[site_id] = f"{site_id}: UNREACHABLE ({one_line(exc)})"
            continue
        try:
            found[site_id] = status.site_status(conn, site_id)
        except (LRError, psycopg2.Error) as exc:
            found[site_id] = f"{site_id}: UNREADABLE ({one_line(exc)})"
        finally:
            conn.close()
    return found


def cmd_status(args: argparse.Namespace) -> int:
    """Exit code: 0 healthy, 1 degraded (a session errs, is behind its trim mark or lags more
    than --max-lag), 2 a site could not be reached."""
    topo = _topology(args)
    found = _site_statuses(topo)
    code, reasons = status.health(found, args.max_lag, topo)
    if args.json:
        print(json.dumps(status.sites_as_dict(found, args.max_lag, topo), indent=2))
        return code
    stale = status.topology_drift(found, topo)
    if stale is not None:
        print(f"WARNING: {stale.message()}")
    print(status.render_sites(found))
    print(f"health: {['healthy', 'degraded', 'unreachable'][code]}" + "".join(f"\n  {r}" for r in reasons))
    return code


def cmd_metrics(args: argparse.Namespace) -> int:
    """Prometheus text exposition of every site's status (for node_exporter's textfile collector,
    or a scrape through `lr metrics --listen`)."""
    topo = _topology(args)
    registry = metrics.status_registry(lambda: _site_statuses(topo), topo)
    if args.listen:
        return metrics.serve(registry, args.listen, announce=lambda line: print(line, flush=True))
    sys.stdout.write(metrics.exposition(registry))
    return 0


def cmd_trim(args: argparse.Namespace) -> int:
    topo = _replicated(args, "trim")
    sources = sorted({k.source for k in topo.sessions()})
    _check(topo, sources)
    for site_id in sources:
        with _at_site(site_id):
            conn = _connect(topo)(site_id)
            try:
                result = (trim.retention_trim(conn, args.retention) if args.retention is not None
                          else trim.safe_trim(conn))
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
    if getattr(args, "create", False) and not (args.password_env or args.no_password):
        raise LRError("--create makes a LOGIN role: give its password with --password-env VAR (the variable "
                      "that holds it), or pass --no-password for a role that logs in without one")
    if getattr(args, "password_env", None):
        if args.no_password:
            raise LRError("--password-env and --no-password: give one of them")
        password = os.environ.get(args.password_env)
        if password is None:
            raise LRError(f"--password-env {args.password_env}: that environment variable is not set")
    for info in _targets(args):
        with _at_site(_site_name(info)):
            _change_roles(args, info, password)
        if not args.dry_run:
            what = args.kind + (f" of {', '.join(args.client)}" if args.client else "")
            done = "granted to" if args.roles_command == "grant" else "revoked from"
            print(f"{_site_name(info)}: {what} {done} {args.role}")
    return 0


def _change_roles(args: argparse.Namespace, info: conninfo.ConnInfo, password: str | None) -> None:
    """One site's grant or revoke (``--print``: its SQL, nothing changed)."""
    conn = info.connect()
    try:
        if args.roles_command == "grant":
            plan = site_roles.plan_grant(conn, args.kind, args.role, args.client or (), args.create, password)
        else:
            plan = site_roles.plan_revoke(conn, args.kind, args.role, args.client or ())
        if args.dry_run:
            print(f"-- {_site_name(info)}")
            print("\n".join(site_roles.render(conn, plan)))
            return
        site_roles.run(conn, plan)
    finally:
        conn.close()


def cmd_roles_list(args: argparse.Namespace) -> int:
    """Exit 2 when a site could not be read (the others are listed all the same)."""
    targets = {_site_name(info): info for info in _targets(args)}
    code = 0
    for name, found in _read_each(list(targets), lambda n: targets[n].connect(), site_roles.list_grants):
        if isinstance(found, str):
            print(f"{name}: {found}")
            code = 2
            continue
        assert isinstance(found, list)
        print(f"{name}: " + ("no roles granted" if not found else ""))
        for grant in found:
            print(f"  {grant.describe()}")
    return code


def _client_sources(topo: topologies.Topology, client: str) -> list[str]:
    """The sources of ``client``'s sessions; a client the topology does not replicate is refused
    (it would be recorded on the sites and never carried)."""
    clients = sorted({k.client for k in topo.sessions()})
    if client not in clients:
        raise LRError(f"client {client!r} is replicated by no session of the topology; its clients: "
                      f"{listing(clients)} (fix --client, or add it to the topology and apply it)")
    return sorted({k.source for k in topo.sessions() if k.client == client})


@contextmanager
def _at_site(site_id: str) -> Iterator[None]:
    """An error of one site's step names the site (when its message does not already)."""
    try:
        yield
    except LRError as exc:
        if site_id in str(exc):
            raise
        raise LRError(f"{site_id}: {one_line(exc)}") from exc


def _read_each(site_ids: Sequence[str], connect: Callable[[str], psycopg2.extensions.connection],
               read: Callable[[psycopg2.extensions.connection], object]) -> Iterator[tuple[str, object]]:
    """(site, what ``read`` returned) per site; a site that cannot be reached gives its error as
    one line (``str``) and the others are still read, as ``lr status`` does."""
    for site_id in site_ids:
        try:
            conn = connect(site_id)
        except LRError as exc:
            yield site_id, f"UNREACHABLE ({one_line(exc)})"
            continue
        try:
            yield site_id, read(conn)
        except (LRError, psycopg2.Error) as exc:
            yield site_id, f"UNREADABLE ({one_line(exc)})"
        finally:
            conn.close()


def cmd_tables_open(args: argparse.Namespace) -> int:
    """lr tables open: record a table for a client on each site given (default, when federating:
    the sources of the client's sessions)."""
    topo = _topology(args)
    if not args.federated and not args.site:
        raise LRError("--no-federated: name the --site(s) that keep out of the table (on a source it stops "
                      "the capture; on a sink its data is dropped)")
    sites = args.site or _client_sources(topo, args.client)
    if args.site:
        _client_sources(topo, args.client)  # a --site does not make an unknown client right
    _check(topo, sites)
    for site_id in sites:
        with _at_site(site_id):
            conn = _connect(topo)(site_id)
            try:
                table = table_registry.open_table(conn, args.table, args.client, args.federated)
            finally:
                conn.close()
        print(f"{site_id}: {table.describe()}")
    return 0


def cmd_tables_close(args: argparse.Namespace) -> int:
    """lr tables close: stop replicating a table from each source given (default: every site that
    captures it). Its sinks keep their copy."""
    topo = _topology(args)
    name = TableName.parse(args.table)
    sites = args.site or sorted(topo.sites)
    _check(topo, sites)
    closed = 0
    for site_id in sites:
        with _at_site(site_id):
            conn = _connect(topo)(site_id)
            try:
                here = {str(t.table): t for t in table_registry.list_tables(conn)}
                table = here.get(str(name))
                if not args.site and (table is None or table.table_id is None or table.source_site_id):
                    continue  # not captured here: nothing of it to close on this site
                table = table_registry.close_table(conn, args.table)
            finally:
                conn.close()
        sinks = sorted({k.sink for k in topo.sessions(source=site_id) if k.client == table.client_name})
        closed += 1
        print(f"{site_id}: {table.table} closed: no longer captured or carried by its sessions"
              + (f"; its sinks {listing(sinks)} keep their copy, no longer updated" if sinks else ""))
    if not closed:
        raise LRError(f"{args.table} is captured on no site of the topology (lr tables list)")
    return 0


def cmd_tables_list(args: argparse.Namespace) -> int:
    """Exit 2 when a site could not be read (the others are listed all the same)."""
    topo = _topology(args)
    code = 0
    sites = args.site or sorted(topo.sites)
    _check(topo, sites)
    for site_id, found in _read_each(sites, _connect(topo), table_registry.list_tables):
        if isinstance(found, str):
            print(f"{site_id}: {found}")
            code = 2
            continue
        assert isinstance(found, list)
        print(f"{site_id}:" + ("" if found else " no tables registered"))
        for table in found:
            print(f"  {table.describe()}")
    return code


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

    fs = with_topology(sub.add_parser("full-sync", help="force a full (snapshot) sync of the chosen sessions "
                                      "(none chosen: every session of the topology)"))
    fs.add_argument("--sink", help="only the sessions to this sink (default: every sink)")
    fs.add_argument("--source", help="only the sessions from this source (default: every source)")
    fs.add_argument("--client", help="only this client's sessions (default: every client)")
    fs.add_argument("--reason", default="requested from the command line")
    fs.add_argument("--wait", type=_seconds, default=None, metavar="SECONDS",
                    help="wait up to this long until each request is applied at its sink, by whichever replicator "
                         "(`lr sync`, lr_streaming, lr_replication); exit 1 unless every one was")
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
    fo.add_argument("--allow-table-divergence", action="store_true",
                    help="promote even when it does not hold a federated table another sink takes from the old "
                         "source: that table stops replicating (lr status marks it DIVERGED)")
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
            change.add_argument("--no-password", action="store_true",
                                help="--create: a role without a password (only where the server trusts local "
                                     "connections, as the embedded sites do)")
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
    cl = with_topology(tables.add_parser("close", help="stop replicating a table (capture dropped at its source; "
                                         "its sinks keep their copy, no longer updated); open it again to resume"))
    cl.add_argument("table", help="SCHEMA.TABLE (a bare name is in public)")
    cl.add_argument("--site", action="append", help="site id (repeatable; default: every site that captures it)")
    cl.set_defaults(func=cmd_tables_close)
    ls = with_topology(tables.add_parser("list", help="the tables registered on each site (exit 2: a site "
                                         "could not be read)"))
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
        print(f"lr: {one_line(exc)}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `lr status | head`: the reader went away; stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
