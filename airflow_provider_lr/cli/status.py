"""``lr status`` and ``lr metrics``: every site's sessions, read from the sites themselves."""

from __future__ import annotations

import argparse
import functools
import json
import sys

from airflow_provider_lr.cli.common import (
    listen_address,
    load_topology,
    nonnegative_seconds,
    read_site,
    with_topology,
)
from airflow_provider_lr.engine.site import metrics, status, status_parts
from airflow_provider_lr.engine.store import topology as topologies


def _site_statuses(topo: topologies.Topology) -> dict[str, status.SiteStatus | str]:
    """Every site's status, or why it could not be read (a site that is down is part of the status)."""
    found: dict[str, status.SiteStatus | str] = {}
    for site_id in sorted(topo.sites):
        read = read_site(topo, site_id, functools.partial(status.site_status, site_id=site_id))
        if isinstance(read, str):  # said with the site's name; a refusal stays one
            read = (status_parts.Refused if isinstance(read, status_parts.Refused) else str)(f"{site_id}: {read}")
        found[site_id] = read
    return found


def cmd_status(args: argparse.Namespace) -> int:
    """Exit code: 0 healthy, 1 degraded (a session errs, is behind its trim mark or lags more
    than --max-lag, a part of a site could not be read) or refused (a site's login lacks the grant
    to read it), 2 a site could not be reached or read."""
    topo = load_topology(args)
    found = _site_statuses(topo)
    code, reasons = status.health(found, args.max_lag, topo)
    if args.json:
        print(json.dumps(status.sites_as_dict(found, args.max_lag, topo), indent=2))
        return code
    stale = status.topology_drift(found, topo)
    if stale is not None:
        print(f"WARNING: {stale.message()}")
    print(status.render_sites(found))
    print(f"health: {status.health_word(found, code)}" + "".join(f"\n  {r}" for r in reasons))
    return code


def cmd_metrics(args: argparse.Namespace) -> int:
    """Prometheus text exposition of every site's status (for node_exporter's textfile collector,
    or a scrape through `lr metrics --listen`)."""
    topo = load_topology(args)
    registry = metrics.status_registry(lambda: _site_statuses(topo), topo)
    if args.listen:
        return metrics.serve(registry, args.listen, announce=lambda line: print(line, flush=True))
    sys.stdout.write(metrics.exposition(registry))
    return 0


def add_status(sub: argparse._SubParsersAction) -> None:
    """``lr status`` and ``lr metrics``."""
    st = with_topology(
        sub.add_parser(
            "status",
            help="sessions, states, lag and what holds the log back (exit 0 healthy, 1 degraded or refused, 2 unreachable)",
        )
    )
    st.add_argument("--json", action="store_true", help="machine-readable, for scripts")
    st.add_argument(
        "--max-lag",
        type=nonnegative_seconds,
        default=None,
        metavar="SECONDS",
        help="also degraded when a session's oldest undelivered entry is older than this",
    )
    st.set_defaults(func=cmd_status)
    me = with_topology(sub.add_parser("metrics", help="status as Prometheus metrics (text exposition)"))
    me.add_argument(
        "--listen",
        type=listen_address,
        metavar="HOST:PORT",
        help="serve /metrics over HTTP (read from the sites at each scrape) instead of printing once",
    )
    me.set_defaults(func=cmd_metrics)
