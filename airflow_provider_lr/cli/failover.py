"""``lr failover``: a sink becomes the source of its clients; the old source rejoins."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psycopg2
import psycopg2.extensions

from airflow_provider_lr.cli.common import (
    UsageError,
    check_topology,
    connector,
    database_error,
    load_topology,
    named,
    reason_text,
    with_topology,
)
from airflow_provider_lr.engine.errors import LRError, TopologyMismatchError, listing
from airflow_provider_lr.engine.site import failover, topology
from airflow_provider_lr.engine.store import topology as topologies


@contextmanager
def _resumable(
    what: str, connect: Callable[[str], psycopg2.extensions.connection]
) -> Iterator[Callable[[str], psycopg2.extensions.connection]]:
    """A site that fails a step part-way (its server stopped, its connection lost at a commit) is
    said with the site and what to do: every step of a failover or a rejoin commits on one site and
    a re-run finishes it (docs/failover.md, *Re-running and crashes*). Before, it read `lr:
    OperationalError: server closed the connection unexpectedly`, naming no site and no next step."""
    made: list[psycopg2.extensions.connection] = []

    def connected(site: str) -> psycopg2.extensions.connection:
        made.append(connect(site))
        return made[-1]

    try:
        yield connected
    except (psycopg2.OperationalError, psycopg2.InterfaceError) as exc:  # a refusal (a grant) is not re-run
        cursor = getattr(exc, "cursor", None)
        lost = [getattr(c, "site", "?") for c in made if c.closed == 2]  # broken, not closed by lr
        sites = [getattr(cursor.connection, "site", None)] if cursor is not None else lost
        where = ", ".join(s for s in sites if s) or "a site"
        raise LRError(
            f"{what} stopped part-way at {where}: {database_error(exc)}; what was done stands: run the same "
            "command again once every site it needs answers (a re-run finishes it)"
        ) from exc


def cmd_failover(args: argparse.Namespace) -> int:
    """``--promote SITE``: fail its source's clients over to it (docs/failover.md); ``--rejoin SITE``:
    the old source (or a site the failover could not reach) takes the new topology."""
    topo = load_topology(args)
    named(topo, sites=(args.promote, args.rejoin, args.from_site), clients=args.client or ())
    why = args.out and topologies.unwritable(args.out)
    if why:  # known before anything is done: the failover writes it last
        raise UsageError(f"--out {args.out}: {why}; name the file to write the new topology to")
    if args.rejoin:  # the site rejoining runs an older topology by design: the file must be the others'
        stale = topology.explained(
            topologies.unheld(topo, topology.recorded_ids(topo, connector(topo), set(topo.sites) - {args.rejoin})),
            connector(topo),
        )
        if stale is not None:
            raise TopologyMismatchError(stale.message())
        with _resumable(f"the rejoin of {args.rejoin}", connector(topo)) as connect:
            back = failover.rejoin(args.rejoin, connect, topo)
        print(f"{back.site}: topology {back.topology_config_id} of failover {back.failover_id} applied")
        for name in back.retired:
            print(f"  retired source session {name}")
        for client, count in back.tail.items():
            print(f"  {client}: {count} entries committed here after the cut were received by nobody (not replicated)")
        for client, count in back.table_tail.items():
            if count:
                print(
                    f"  {client}: {count} table change entries committed here after the cut were received by nobody: "
                    "the new source's table snapshot replaces them"
                )
        for table in back.guarded:
            print(f"  table {table}: a sink of the new source now; writes of this site's applications are refused")
        for name in back.reopened:
            print(f"  reopened session {name}, closed here by an earlier failover")
        if back.already:
            print(
                "  it ran this topology already (an earlier rejoin or a planned switchover applied it): its sessions "
                "from the new source go on"
            )
        else:
            print("  its sessions from the new source start with a full sync (`lr sync` or the lr_replication DAG)")
        return 0
    old = args.from_site or failover.only_source(topo, args.promote, args.client or None)
    # sites already on this failover's topology (a re-run finishing it) are fine; any other id is not
    check_topology(topo, also={failover.derive(topo, old, args.promote, args.client or None)[0].topology_config_id})
    with _resumable(f"the failover of {old} to {args.promote}", connector(topo)) as connect:
        done = failover.promote(
            failover.FailoverRequest(
                old,
                args.promote,
                clients=args.client or None,
                reason=args.reason,
                same_destinations=args.same_destinations,
                planned=args.planned,
                allow_table_divergence=args.allow_table_divergence,
            ),
            connect,
            topology=topo,
        )
    target = args.out or topologies.failover_files(done.topology.topology_config_id)[0]
    try:
        out = topologies.write_document(done.topology, target)
    except OSError as exc:  # the failover is done: said, with how to write its topology
        raise LRError(
            f"failover {done.failover_id} is done ({done.to_site} is the source of {', '.join(done.clients)}), but "
            f"its topology {done.topology.topology_config_id} could not be written to {target} ({exc.strerror or exc}); "
            "run the same command with --out FILE to write it (a re-run finishes what is left and writes it)"
        ) from exc
    kind = "planned switchover" if done.planned else "unplanned failover"
    print(
        f"{kind} {done.failover_id}{' (resumed)' if done.resumed else ''}: {done.to_site} is the source of "
        f"{', '.join(done.clients)} (was {done.from_site}); cut at {listing(done.positions)}, "
        f"new sessions after {done.base}"
    )
    for site, notes in sorted(done.outcome.items()):
        for client, note in notes.items():
            print(f"  {site}/{client}: {note}")
    for client, tables in sorted(done.tables.items()):
        if tables:
            print(
                f"  {client}: {done.to_site} captures its federated table(s) {', '.join(tables)}; every other sink "
                f"takes a snapshot of them from {done.to_site}"
            )
    for table in done.diverged:
        print(f"  DIVERGED table {table}: its replication stops (lr status lists it)")
    print(f"  lost: {done.lost}")
    print(f"  new topology {done.topology.topology_config_id} written to {out}: use it from now on (LR_TOPOLOGY)")
    for site in done.pending:
        if site in done.busy:
            print(f"  {site} was not rejoined: {done.busy[site]} (`lr failover --rejoin {site}`)")
        else:
            print(f"  {site} was not reached: when it is back, run `lr failover --rejoin {site}`")
    return 0


def add_failover(sub: argparse._SubParsersAction) -> None:
    """``lr failover --promote|--rejoin``."""
    fo = with_topology(
        sub.add_parser(
            "failover",
            help="make a sink the source of its clients, or rejoin the old source as a sink (docs/failover.md)",
        )
    )
    which = fo.add_mutually_exclusive_group(required=True)
    which.add_argument("--promote", metavar="SITE", help="the sink that becomes the source")
    which.add_argument("--rejoin", metavar="SITE", help="apply the failover's topology on a site that was not reached")
    fo.add_argument("--from", dest="from_site", metavar="SITE", help="the old source (default: the promoted site's)")
    fo.add_argument("--client", action="append", help="a client to fail over (repeat; default: all it receives)")
    fo.add_argument(
        "--reason",
        type=reason_text,
        default="failover from the command line",
        help="recorded with the full-sync requests it makes",
    )
    fo.add_argument(
        "--same-destinations",
        action="store_true",
        help="every entry of these clients went to all their sinks: a sink behind the promoted one "
        "gets the gap copied from it instead of a full sync",
    )
    fo.add_argument(
        "--planned",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="drain the old source first (default: when it can be reached)",
    )
    fo.add_argument(
        "--allow-table-divergence",
        action="store_true",
        help="promote even when it does not hold a federated table another sink takes from the old "
        "source: that table stops replicating (lr status marks it DIVERGED)",
    )
    fo.add_argument("--out", help="where to write the new topology (default: $LR_HOME/topology-<id>.yaml)")
    fo.set_defaults(func=cmd_failover)
