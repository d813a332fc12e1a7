"""The ``lr`` command line: local sites, schema install, replication without Airflow, status, demo."""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from airflow_provider_lr.engine import conninfo, schema
from airflow_provider_lr.engine.errors import LRError
from airflow_provider_lr.sites import SiteManager, lr_home


def _manager(args: argparse.Namespace) -> SiteManager:
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
    sites = _manager(args).sites()
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
            result = schema.init_site(conn, site_id, args.region or info.region or "default")
        finally:
            conn.close()
        change = f"upgraded {before} → {result.version}" if result.applied else f"up to date (v{result.version})"
        print(f"{site_id}: lr schema {change}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from airflow_provider_lr import demo

    return demo.run(SiteManager(args.home), sink_count=args.sinks)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lr", description="Log replication between PostgreSQL sites.")
    parser.add_argument("--home", default=None, help=f"state directory (default $LR_HOME or {lr_home()})")
    sub = parser.add_subparsers(dest="command", required=True)

    sites = sub.add_parser("sites", help="embedded PostgreSQL sites for local use").add_subparsers(
        dest="sites_command", required=True
    )
    up = sites.add_parser("up", help="start N sites (one PostgreSQL server and data directory each)")
    up.add_argument("--count", type=int, default=None)
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

    demo = sub.add_parser("demo", help="run the end-to-end demo on embedded sites")
    demo.add_argument("--sinks", type=int, default=2)
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except LRError as exc:
        print(f"lr: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
