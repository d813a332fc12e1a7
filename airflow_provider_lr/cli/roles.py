"""``lr roles grant|revoke|list``: least-privilege roles on each site (docs/security.md)."""

from __future__ import annotations

import argparse
import os

import psycopg2.extensions

from airflow_provider_lr.cli.common import UsageError, at_site, read_connected, target_sites
from airflow_provider_lr.engine.db import conninfo
from airflow_provider_lr.engine.db.durable_commits import made_durable
from airflow_provider_lr.engine.errors import LRError, one_line
from airflow_provider_lr.engine.site import roles as site_roles
from airflow_provider_lr.engine.site import status_parts


def _site_name(info: conninfo.ConnInfo) -> str:
    return info.site_id or info.conn_id or info.safe_dsn


def cmd_roles_change(args: argparse.Namespace) -> int:
    """lr roles grant|revoke: the same plan on every site (``--print``: show it, change nothing)."""
    password = None
    try:  # the kind, role and clients alone: a usage error before any site is reached
        site_roles.check_request(args.kind, args.role, args.client or ())
    except LRError as exc:
        raise UsageError(one_line(exc)) from None
    if getattr(args, "create", False) and not (args.password_env or args.no_password):
        raise UsageError(
            "--create makes a LOGIN role: give its password with --password-env VAR (the variable "
            "that holds it), or pass --no-password for a role that logs in without one"
        )
    if getattr(args, "password_env", None):
        if args.no_password:
            raise UsageError("--password-env and --no-password: give one of them")
        password = os.environ.get(args.password_env)
        if password is None:
            raise UsageError(f"--password-env {args.password_env}: that environment variable is not set")
    for info in target_sites(args):
        with at_site(_site_name(info)):
            _change_roles(args, info, password)
        if not args.dry_run:
            what = args.kind + (f" of {', '.join(args.client)}" if args.client else "")
            done = "granted to" if args.roles_command == "grant" else "revoked from"
            print(f"{_site_name(info)}: {what} {done} {args.role}")
    return 0


def _change_roles(args: argparse.Namespace, info: conninfo.ConnInfo, password: str | None) -> None:
    """One site's grant or revoke (``--print``: its SQL, nothing changed)."""
    conn = made_durable(info.connect())  # the grants kept by a site crashing right after
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
    """Exit 2 when a site could not be reached or read (a lock another session holds on its
    ``lr.role_grants``: said with the pid, after ``lr status``'s short wait), 1 when a site's login
    may not read it (a refusal: it was said unreadable, exit 2); the others are listed all the same."""
    code = 0
    for info in target_sites(args):
        name = _site_name(info)
        found = read_connected(info.connect, info.conn_id or info.safe_dsn, _grants)
        if isinstance(found, str):
            print(f"{name}: {found}")
            code = max(code, 1 if isinstance(found, status_parts.Refused) else 2)
            continue
        print(f"{name}: " + ("no roles granted" if not found else ""))
        for grant in found:
            print(f"  {grant.describe()}")
    return code


def _grants(conn: psycopg2.extensions.connection) -> list[site_roles.RoleGrant]:
    """The site's grants, a lock on its tables waited for as ``lr status`` waits."""
    with status_parts.short_lock_waits(conn):
        return site_roles.list_grants(conn)


def add_roles(sub: argparse._SubParsersAction) -> None:
    """``lr roles grant|revoke|list``."""
    access = sub.add_parser(
        "roles", help="least-privilege roles: replicator, writer or consumer of a client (docs/security.md)"
    ).add_subparsers(dest="roles_command", required=True)
    for name, verb in (("grant", "give"), ("revoke", "take")):
        change = access.add_parser(name, help=f"{verb} a role the rights of a replicator, writer or consumer")
        change.add_argument("kind", choices=site_roles.KINDS, help="what the role does (docs/security.md)")
        change.add_argument("--role", required=True, help="the PostgreSQL role (a login role, or a group of them)")
        change.add_argument("--client", action="append", help="writer/consumer: the client (repeatable)")
        change.add_argument(
            "--site",
            action="append",
            help="DSN or Airflow connection id, as the owner of the lr schema (default: all embedded sites)",
        )
        change.add_argument("--print", dest="dry_run", action="store_true", help="print the SQL, change nothing")
        if name == "grant":
            change.add_argument("--create", action="store_true", help="create the role (LOGIN) where it is missing")
            change.add_argument("--password-env", metavar="VAR", help="--create: its password, from this variable")
            change.add_argument(
                "--no-password",
                action="store_true",
                help="--create: a role without a password (only where the server trusts local "
                "connections, as the embedded sites do)",
            )
        change.set_defaults(func=cmd_roles_change)
    shown = access.add_parser("list", help="the roles granted on each site")
    shown.add_argument("--site", action="append", help="DSN or Airflow connection id (default: all embedded sites)")
    shown.set_defaults(func=cmd_roles_list)
