"""``lr sites``, ``lr init`` and ``lr demo``: embedded sites for local use, the schema on any site."""

from __future__ import annotations

import argparse

from airflow_provider_lr.cli.common import (
    UsageError,
    at_site,
    embedded_tooling,
    positive_int,
    region_text,
    site_id_text,
    site_ids_text,
    site_manager,
    target_sites,
)
from airflow_provider_lr.engine.db import schema
from airflow_provider_lr.engine.db.durable_commits import made_durable
from airflow_provider_lr.engine.db.timeouts import Purpose
from airflow_provider_lr.engine.site import roles as site_roles
from airflow_provider_lr.paths import home_unset_hint


def cmd_sites_up(args: argparse.Namespace) -> int:
    manager = site_manager(args)
    sites = manager.up(count=args.count, site_ids=args.ids)
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
    stopped = site_manager(args).down(args.ids, remove=args.remove)
    print(("removed: " if args.remove else "stopped: ") + (", ".join(stopped) or "nothing"))
    return 0


def cmd_sites_list(args: argparse.Namespace) -> int:
    manager = site_manager(args)
    sites = manager.sites()
    if not sites:
        hint = home_unset_hint(manager.home) or "start some: lr sites up --count 3"
        print(f"no embedded sites under {manager.home} ({hint})")
        return 0
    print(f"{'site':<10} {'region':<10} {'state':<8} {'port':<6} data directory")
    for site in sites:
        state = "running" if manager.is_running(site) else "stopped"
        print(f"{site.site_id:<10} {site.region:<10} {state:<8} {site.port:<6} {site.pgdata}")
    note = manager.relocation_note(sites)
    if note:
        print(note)
    return 0


def cmd_init(args: argparse.Namespace) -> int:
    for info in target_sites(args):
        site_id = args.site_id or info.site_id
        if not site_id:
            raise UsageError(f"{info.safe_dsn}: give --site-id (the connection has no site_id extra)")
        with at_site(site_id):
            # a migration may rewrite a large table: no statement timeout; kept by a crash right after
            conn = made_durable(info.connect(Purpose.BULK))
            try:
                before = schema.current_version(conn)
                result = schema.init_site(conn, site_id, args.region or info.region)  # None: keep the recorded one
                refreshed = site_roles.reapply(conn) if result.applied else []  # new tables for existing roles
            finally:
                conn.close()
        change = f"upgraded {before} → {result.version}" if result.applied else f"up to date (v{result.version})"
        print(
            f"{site_id}: lr schema {change}" + (f"; grants refreshed for {', '.join(refreshed)}" if refreshed else "")
        )
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    with embedded_tooling(args):
        from airflow_provider_lr.embedded import demo
    return demo.run(site_manager(args), sink_count=args.sinks)


def add_sites(sub: argparse._SubParsersAction) -> None:
    """``lr sites up|down|list``."""
    sites = sub.add_parser("sites", help="embedded PostgreSQL sites for local use").add_subparsers(
        dest="sites_command", required=True
    )
    up = sites.add_parser("up", help="start N sites (one PostgreSQL server and data directory each)")
    up.add_argument(
        "--count",
        type=positive_int,
        default=None,
        help="start this many sites, site-a, site-b, ... (past 26: site-1, site-2, ...; at most 64), "
        "making those not made yet (default: the sites made before)",
    )
    up.add_argument("--ids", type=site_ids_text, help="comma-separated site ids instead of site-a, site-b, ...")
    up.set_defaults(func=cmd_sites_up)
    down = sites.add_parser("down", help="stop sites")
    down.add_argument("--ids", type=site_ids_text, help="comma-separated site ids (default: every embedded site)")
    down.add_argument("--remove", action="store_true", help="also delete their data")
    down.set_defaults(func=cmd_sites_down)
    sites.add_parser("list", help="list sites and whether they run").set_defaults(func=cmd_sites_list)


def add_init(sub: argparse._SubParsersAction) -> None:
    """``lr init``."""
    init = sub.add_parser("init", help="install or upgrade the lr schema on sites")
    init.add_argument("--site", action="append", help="DSN or Airflow connection id (default: all embedded sites)")
    init.add_argument(
        "--site-id", type=site_id_text, help="site id to record (default: the connection's site_id extra)"
    )
    init.add_argument(
        "--region",
        type=region_text,
        help="region to record (default: the connection's region extra, else the one recorded)",
    )
    init.set_defaults(func=cmd_init)


def add_demo(sub: argparse._SubParsersAction) -> None:
    """``lr demo``."""
    demo = sub.add_parser("demo", help="run the end-to-end demo on embedded sites")
    demo.add_argument("--sinks", type=positive_int, default=2, help="how many sink sites (default 2)")
    demo.set_defaults(func=cmd_demo)
