"""``lr tables open|close|list``: federated tables, replicated by lr itself (docs/tables.md)."""

from __future__ import annotations

import argparse

import psycopg2
import psycopg2.extensions

from airflow_provider_lr.cli.common import (
    UsageError,
    at_site,
    check_topology,
    connector,
    load_topology,
    named,
    read_site,
    with_topology,
)
from airflow_provider_lr.engine.db.durable_commits import durable
from airflow_provider_lr.engine.errors import LRError, TableError, listing, one_line
from airflow_provider_lr.engine.site import status_parts
from airflow_provider_lr.engine.source import full_sync
from airflow_provider_lr.engine.store import topology as topologies
from airflow_provider_lr.engine.tables import closed_notes, closing
from airflow_provider_lr.engine.tables import registry as table_registry
from airflow_provider_lr.engine.tables.definition import TableName


def _client_sources(topo: topologies.Topology, client: str) -> list[str]:
    """The sources of ``client``'s sessions; a client the topology does not replicate is refused
    (it would be recorded on the sites and never carried)."""
    clients = sorted({k.client for k in topo.sessions()})
    if client not in clients:
        raise LRError(
            f"client {client!r} is replicated by no session of the topology; its clients: "
            f"{listing(clients)} (fix --client, or add it to the topology and apply it)"
        )
    return sorted({k.source for k in topo.sessions() if k.client == client})


def _table_name(text: str) -> TableName:
    """A name lr cannot federate is the user's input: a usage error (exit 2) before any site is
    reached; it exited 1, as a site's refusal (a table that does not exist there)."""
    try:
        return TableName.parse(text)
    except TableError as exc:
        raise UsageError(str(exc)) from exc


def cmd_tables_open(args: argparse.Namespace) -> int:
    """lr tables open: record a table for a client on each site given (default, when federating:
    the sources of the client's sessions)."""
    _table_name(args.table)  # a name lr cannot federate is refused before any site is touched
    if not args.federated and not args.site:
        raise UsageError(
            "--no-federated: name the --site(s) that keep out of the table (on a source it stops "
            "the capture; on a sink its data is dropped)"
        )
    topo = load_topology(args)
    named(topo, sites=args.site or (), clients=(args.client,))
    sites = args.site or _client_sources(topo, args.client)
    if args.site:
        _client_sources(topo, args.client)  # a --site does not make an unknown client right
    check_topology(topo, sites)
    for site_id in sites:
        with at_site(site_id):
            conn = durable(connector(topo))(site_id)  # kept by a site crashing right after
            try:
                if not args.federated:  # stops the capture here, as a close does
                    here = {str(t.table): t for t in table_registry.list_tables(conn)}
                    _before_capture_stops(topo, conn, site_id, here.get(str(TableName.parse(args.table))))
                table = table_registry.open_table(conn, args.table, args.client, args.federated)
            finally:
                conn.close()
        print(f"{site_id}: {table.describe()}")
    return 0


def cmd_tables_close(args: argparse.Namespace) -> int:
    """lr tables close: stop replicating a table from each source given (default: every site that
    captures it). Its sinks keep their copy."""
    name = _table_name(args.table)
    topo = load_topology(args)
    named(topo, sites=args.site or ())
    sites = args.site or sorted(topo.sites)
    check_topology(topo, sites)
    closed = 0
    for site_id in sites:
        with at_site(site_id):
            conn = durable(connector(topo))(site_id)  # kept by a site crashing right after
            try:
                here = {str(t.table): t for t in table_registry.list_tables(conn)}
                table = here.get(str(name))
                if not args.site and (table is None or table.table_id is None):
                    continue  # not captured here: nothing of it to close on this site (a copy federated
                    # onward from here, its row naming its origin, is captured: closed too)
                _before_capture_stops(topo, conn, site_id, table)
                table = table_registry.close_table(conn, args.table)
            finally:
                conn.close()
        sinks = sorted({k.sink for k in topo.sessions(source=site_id) if k.client == table.client_name})
        closed += 1
        print(
            f"{site_id}: {table.table} closed: no longer captured or carried by its sessions"
            + (f"; its sinks {listing(sinks)} keep their copy, no longer updated" if sinks else "")
        )
        _tell_sinks(topo, sinks, site_id, args.table, table.client_name or "")
    if not closed:
        raise LRError(f"{args.table} is captured on no site of the topology (lr tables list)")
    return 0


def _before_capture_stops(
    topo: topologies.Topology,
    conn: psycopg2.extensions.connection,
    site_id: str,
    table: table_registry.RegisteredTable | None,
) -> None:
    """Let each sink of a table captured at ``site_id`` take its snapshot before the capture stops
    (a close, or an open as not federated): a closed table takes none (``closing``)."""
    if table is None or table.table_id is None or not table.client_name:
        return
    client = table.client_name
    sinks = sorted({k.sink for k in topo.sessions(source=site_id) if k.client == client})
    closing.wait_for_snapshots(conn, connector(topo), site_id, sinks, client, str(table.table), table.table_id)


# a site's tables, the copies it holds, (as a source) the (sink, client) of its forced full syncs open,
# and the parts not read (a lock another session holds on their table, ``status_parts``)
_Listed = tuple[list[table_registry.RegisteredTable], list[table_registry.HeldCopy], set[tuple[str, str]], list[str]]


def _tell_sinks(topo: topologies.Topology, sinks: list[str], source: str, table: str, client: str) -> None:
    """Record the close on each sink's copy (``note_closed_copy``), so that a failover promoting
    one of them leaves the table closed; a sink not reached is said, not fatal: the close holds."""
    for sink in sinks:
        try:
            conn = durable(connector(topo))(sink)  # kept by a sink crashing right after: it was told
            try:
                closed_notes.note_closed_copy(conn, table, source, client)
            finally:
                conn.close()
        except (LRError, psycopg2.Error) as exc:
            print(
                f"  {sink}: not told of the close ({one_line(exc)}): a failover promoting it would capture "
                f"the table again; run lr tables close {table} --site {source} again once it is reachable"
            )


def cmd_tables_list(args: argparse.Namespace) -> int:
    """Each site's tables: those registered there (opened, closed, kept out) and the copies it holds
    as a sink (where from, their state; closed at a source read in the same run). Exit 2 when a site
    could not be read (the others are listed all the same); 1 when a part of one was not (a lock held
    on its lr table, said with the holder's pid) or its login lacks the grant to read it (REFUSED)."""
    topo = load_topology(args)
    code = 0
    named(topo, sites=args.site or ())
    sites = args.site or sorted(topo.sites)
    check_topology(topo, sites)
    found: dict[str, _Listed | str] = {site_id: read_site(topo, site_id, _tables_and_copies) for site_id in sites}
    closed = {
        (site, str(t.table))
        for site, read in found.items()
        if not isinstance(read, str)
        for t in read[0]
        if t.closed or t.closed_onward
    }
    for site_id, read in found.items():
        if isinstance(read, str):
            print(f"{site_id}: {read}")
            code = max(code, 1 if isinstance(read, status_parts.Refused) else 2)
            continue
        registered, copies, _, unread = read
        print(f"{site_id}:" + ("" if registered or copies or unread else " no tables registered"))
        held = {str(c.table) for c in copies}
        for table in registered:
            if table.closed_onward or not (
                table.source_site_id and str(table.table) in held and table.table_id is None
            ):  # (a copy only: said below)
                coming = table.source_site_id and table.federated and table.table_id is None  # a sink's, no copy
                print(
                    f"  {table.describe()}"
                    + (_renewed(found, table.source_site_id, site_id, table.client_name) if coming else "")
                )
        for copy in copies:
            shut = copy.closed_at_source or (copy.source_site_id, str(copy.table)) in closed
            renewed = (
                ""
                if shut or copy.state != "synced"
                else _renewed(found, copy.source_site_id, site_id, copy.client_name)
            )
            print(f"  {copy.describe(shut)}{renewed}")
        for part in unread:
            print(f"  {part}")
            code = max(code, 1)
    return code


def _tables_and_copies(conn: psycopg2.extensions.connection) -> _Listed:
    """Each part read on its own (``status_parts``): one lr table locked elsewhere costs only its part."""
    unread: list[str] = []
    with status_parts.short_lock_waits(conn):
        tables = status_parts.read_part(
            conn, unread, "tables registered here", lambda: table_registry.list_tables(conn)
        )
        copies = status_parts.read_part(conn, unread, "copies held here", lambda: table_registry.list_copies(conn))
        requested = status_parts.read_part(
            conn, unread, "full syncs requested here", lambda: full_sync.sessions_requested(conn)
        )
    return tables or [], copies or [], requested or set(), unread


def _renewed(found: dict[str, _Listed | str], source: str | None, sink: str, client: str | None) -> str:
    """What a sink's copy awaits when its source, read in the same run, has a forced full sync of
    the session open (``lr full-sync``): a new snapshot. Before, the copy read ``synced`` meanwhile."""
    read = found.get(source or "")
    if isinstance(read, str) or read is None or (sink, client) not in read[2]:
        return ""
    return f" (a new snapshot comes with the full sync requested at {source})"


def add_tables(sub: argparse._SubParsersAction) -> None:
    """``lr tables open|close|list``."""
    tables = sub.add_parser("tables", help="federated tables: replicated by lr itself (docs/tables.md)").add_subparsers(
        dest="tables_command", required=True
    )
    op = with_topology(
        tables.add_parser(
            "open",
            help="record a table for a client; --federated (default) "
            "captures and replicates it, --no-federated keeps a site out of it",
        )
    )
    op.add_argument("table", help="SCHEMA.TABLE (a bare name is in public)")
    op.add_argument("--client", required=True, help="the client whose sessions carry the table")
    op.add_argument(
        "--federated",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="replicate the table (default); --no-federated: these sites keep out of it",
    )
    op.add_argument(
        "--site", action="append", help="site id (repeatable; default with --federated: the client's sources)"
    )
    op.set_defaults(func=cmd_tables_open)
    cl = with_topology(
        tables.add_parser(
            "close",
            help="stop replicating a table (capture dropped at its source; "
            "its sinks keep their copy, no longer updated); open it again to resume",
        )
    )
    cl.add_argument("table", help="SCHEMA.TABLE (a bare name is in public)")
    cl.add_argument("--site", action="append", help="site id (repeatable; default: every site that captures it)")
    cl.set_defaults(func=cmd_tables_close)
    ls = with_topology(
        tables.add_parser(
            "list",
            help="the tables registered on each site (exit 2: a site could not be read; 1: a part of one, or refused)",
        )
    )
    ls.add_argument("--site", action="append", help="site id (repeatable; default: every site)")
    ls.set_defaults(func=cmd_tables_list)
