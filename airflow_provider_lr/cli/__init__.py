"""The ``lr`` command line: local sites, schema install, replication without Airflow, status, demo.

One module per command group (its commands and their arguments); ``main`` is the console entry point
(``lr = airflow_provider_lr.cli:main`` in setup.cfg), ``python -m airflow_provider_lr.cli`` runs it too."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import NoReturn

import psycopg2

from airflow_provider_lr.cli import airflow_connections, failover, full_sync, replication, roles, sites, status, tables
from airflow_provider_lr.cli.common import UsageError, database_error, environ_set
from airflow_provider_lr.engine.db import conninfo, reach
from airflow_provider_lr.engine.errors import InputError, LRError, mask_secrets, one_line
from airflow_provider_lr.paths import LR_HOME_ENV, lr_home


class _Parser(argparse.ArgumentParser):
    """argparse quotes the arguments it refuses (``unrecognized arguments: --site host=... password=...``):
    a password among them is masked. Its subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        super().error(mask_secrets(message))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="lr", description="Log replication between PostgreSQL sites.")
    parser.add_argument("--home", default=None, help=f"state directory (default $LR_HOME or {lr_home()})")
    sub = parser.add_subparsers(dest="command", required=True)
    # in the order `lr --help` lists them
    sites.add_sites(sub)
    sites.add_init(sub)
    replication.add_topology(sub)
    replication.add_sync(sub)
    full_sync.add_full_sync(sub)
    failover.add_failover(sub)
    status.add_status(sub)
    replication.add_trim(sub)
    roles.add_roles(sub)
    tables.add_tables(sub)
    sites.add_demo(sub)
    _describe(parser)
    return parser


def _describe(parser: argparse.ArgumentParser) -> None:
    """Each command's ``--help`` opens with the line ``lr --help`` (or its group's) gives it: it
    printed only usage and options, and what the command does was one level up."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            said = {choice.dest: choice.help for choice in action._choices_actions}
            for name, child in action.choices.items():
                child.description = child.description or said.get(name)
                _describe(child)


@contextmanager
def _home(home: str | None) -> Iterator[None]:
    """``--home`` is the state directory of the whole command: the connections file, the topology a
    failover writes, the sites. It was given to the sites' commands only, so ``lr --home DIR status``
    looked for the connections in ./.lr. Set as ``$LR_HOME`` while the command runs."""
    if not home:
        yield
        return
    with environ_set(LR_HOME_ENV, str(Path(home).resolve())):
        yield


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # progress of long work (full-sync transfers) and per-session failures, on stderr
    logging.basicConfig(level=logging.WARNING, format="lr: %(message)s")
    logging.getLogger("airflow_provider_lr").setLevel(logging.INFO)
    conninfo.add_lookup(airflow_connections.airflow_connection)  # a site's conn_id made in Airflow
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        # a site that made the command wait once is not waited for again; `lr sync` runs for long
        # (a site comes back) and remembers only once it stops (``DEADLINES.hurry``)
        with _home(args.home), nullcontext() if args.command == "sync" else reach.remembered():
            return func(args)
    except (UsageError, InputError) as exc:
        print(f"lr: {one_line(exc)}", file=sys.stderr)
        return 2
    except LRError as exc:
        print(f"lr: {one_line(exc)}", file=sys.stderr)
        return 1
    except psycopg2.Error as exc:  # a site refused a step (a lock an application holds): said, no traceback
        site = getattr(getattr(exc.cursor, "connection", None), "site", None)
        print(f"lr: {f'{site}: ' if site else ''}{database_error(exc)}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `lr status | head`: the reader went away; stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
