"""What the ``lr`` commands share: the sites they act on, the topology file and its check, one
site's error named by the site, and the argument types."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypeVar

import psycopg2
from psycopg2 import errorcodes

from airflow_provider_lr.engine import vocabulary
from airflow_provider_lr.engine.db import conninfo, reach
from airflow_provider_lr.engine.db.timeouts import failure
from airflow_provider_lr.engine.db.topology_schema import (
    SITE_RULES,
    TEXT_RULES,
    holds_password,
    valid_region,
    valid_site_id,
)
from airflow_provider_lr.engine.errors import (
    ConfigurationError,
    InputError,
    LRError,
    listing,
    one_line,
    shown,
    without_statement,
)
from airflow_provider_lr.engine.site import status_parts, topology
from airflow_provider_lr.engine.store import topology as topologies

T = TypeVar("T")

if TYPE_CHECKING:
    from airflow_provider_lr.embedded.sites import SiteManager


@contextmanager
def environ_set(name: str, value: str) -> Iterator[None]:
    """``$name`` is ``value`` within the block, as it was after it (unset if it was)."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


class UsageError(LRError):
    """Options that do not go together, or one missing that the others need: exit 2, as argparse's
    own usage errors (they exited 1, like a site's refusal, so a script could not tell them apart)."""


@contextmanager
def embedded_tooling(args: argparse.Namespace, hint: str = "") -> Iterator[None]:
    """Import the embedded tooling (``lr sites``, ``lr demo``) only in the commands that use it: it
    is the ``[embedded]`` extra, which an Airflow worker does not install; without it, say so."""
    try:
        yield
    except ModuleNotFoundError as exc:  # the embedded package's own message names the extra to install
        raise LRError(f"{args.command}: {exc}{hint}") from exc


def site_manager(args: argparse.Namespace, hint: str = "") -> SiteManager:
    with embedded_tooling(args, hint):
        from airflow_provider_lr.embedded.sites import SiteManager
    return SiteManager(args.home)


PASSWORD_IN_ARGV = (
    "lr: warning: a password given in --site is seen by every local user (`ps`, /proc) while lr runs: "
    "give it in PGPASSWORD or ~/.pgpass, or name a connection (AIRFLOW_CONN_<ID>, $LR_CONNECTIONS_FILE)"
)


def target_sites(args: argparse.Namespace) -> list[conninfo.ConnInfo]:
    """The sites ``--site`` names (DSNs, connection ids), or the embedded ones. A DSN that cannot be
    parsed, or a connection id that names nothing, is the user's input: a usage error (exit 2, one
    line) before any site is reached, as every other bad argument is; a server that refuses or does
    not answer is not (exit 1)."""
    if args.site:
        if any(holds_password(s) for s in args.site):  # the command line is public on the machine
            print(PASSWORD_IN_ARGV, file=sys.stderr)
        try:
            return [conninfo.resolve(s).check() for s in args.site]
        except ConfigurationError as exc:
            raise UsageError(f"--site: {exc}") from None
    sites = site_manager(args, hint=" (or name the sites with --site)").sites()
    if not sites:
        raise LRError("no --site given and no embedded sites (lr sites up --count 3)")
    return [s.conninfo() for s in sites]


def load_topology(args: argparse.Namespace) -> topologies.Topology:
    """The topology file named by ``--topology`` (or ``$LR_TOPOLOGY``, or the shipped one). One that
    is missing, unreadable or malformed is the user's input: a usage error (exit 2, the line naming
    file, line and key), told apart from a site's refusal (exit 1) as every other bad argument is."""
    try:
        return topologies.load(args.topology)
    except ConfigurationError as exc:
        raise UsageError(str(exc)) from exc


def connector(topo: topologies.Topology) -> Callable[[str], psycopg2.extensions.connection]:
    """Connects to a site of ``topo`` by its id (what the engine's multi-site calls take)."""
    return lambda site_id: topologies.site_conninfo(topo, site_id).connect()


def unreachable(topo: topologies.Topology, site_id: str) -> str | None:
    """Why ``site_id`` did not answer earlier in this command (``reach``: a connect that timed out,
    a call cut), or None: it was not found so."""
    return reach.known(reach.key(topologies.site_conninfo(topo, site_id).params))


def named(topo: topologies.Topology, sites: Iterable[str | None] = (), clients: Iterable[str | None] = ()) -> None:
    """A site or client name the topology does not know is a usage error (exit 2, before any site
    is reached), listing the ones it knows: it was a site's refusal (exit 1), or a silent no-op."""
    for name in sites:
        if name is not None and name not in topo.sites:
            raise UsageError(f"unknown site {shown(name)}; the topology knows {listing(sorted(topo.sites))}")
    known = sorted({k.client for k in topo.sessions()})
    for name in clients:
        if name is not None and name not in known:
            raise UsageError(f"unknown client {shown(name)}; the topology replicates {listing(known) or 'none'}")


def check_topology(topo: topologies.Topology, sites: Iterable[str] | None = None, also: Iterable[str] = ()) -> None:
    """Refuse a topology file that the reachable ``sites`` (default: all) do not run (a stale file
    after a failover, an edited one not applied), naming the file and the ids the sites hold."""
    topology.check_sites(topo, connector(topo), None if sites is None else set(sites), set(also))


def database_error(exc: psycopg2.Error) -> str:
    """A site's refusal as one line: what the bound that fired means, the error, its detail; not the
    statement's text (psycopg's LINE and caret parts), which may hold values."""
    return without_statement(failure(exc))


@contextmanager
def at_site(site_id: str) -> Iterator[None]:
    """An error of one site's step names the site (when its message does not already); a site's
    refusal too (``lr trim`` on a site without the lr schema said which fix, not on which site)."""
    try:
        yield
    except LRError as exc:
        if site_id in str(exc):
            raise
        raise (InputError if isinstance(exc, InputError) else LRError)(f"{site_id}: {one_line(exc)}") from exc
    except psycopg2.Error as exc:
        raise LRError(f"{site_id}: {database_error(exc)}") from exc


def read_site(topo: topologies.Topology, site_id: str, read: Callable[[psycopg2.extensions.connection], T]) -> T | str:
    """What ``read`` returned of a site of ``topo``, or why not as one line (``read_connected``)."""
    return read_connected(lambda: connector(topo)(site_id), topo.conn_id(site_id), read)


def read_connected(
    connect: Callable[[], psycopg2.extensions.connection],
    conn_id: str,
    read: Callable[[psycopg2.extensions.connection], T],
) -> T | str:
    """What ``read`` returned of the site ``connect`` reaches, or why not as one line: ``UNREACHABLE``
    (not connected), ``UNREADABLE`` (an error; a lock another session holds names its table and pid),
    or ``status_parts.Refused`` (its login lacks the grant: said so, naming ``conn_id``; it was
    called unreachable). Every command that reads sites one by one says them so."""
    try:
        conn = connect()
    except Exception as exc:
        return f"UNREACHABLE ({one_line(exc)})"
    try:
        return read(conn)
    except psycopg2.Error as exc:
        if exc.pgcode == errorcodes.INSUFFICIENT_PRIVILEGE:  # reached, and refused: not unreachable
            return status_parts.refused(conn_id, exc, conn.info.user)
        if exc.pgcode == errorcodes.LOCK_NOT_AVAILABLE and not conn.closed:
            conn.rollback()
            return f"UNREADABLE ({status_parts.locked_by(conn)})"
        return f"UNREADABLE ({database_error(exc)})"
    except LRError as exc:
        cause = exc.__cause__  # a refusal lr said in its own words (the schema version's read)
        if isinstance(cause, psycopg2.Error) and cause.pgcode == errorcodes.INSUFFICIENT_PRIVILEGE:
            return status_parts.refused(conn_id, cause, conn.info.user)
        return f"UNREADABLE ({one_line(exc)})"
    finally:
        conn.close()


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return value


def nonnegative_seconds(text: str) -> float:
    """A finite, non-negative number of seconds."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (0 or more)")
    return seconds


def reason_text(text: str) -> str:
    """A full sync's ``--reason`` (``vocabulary.checked_reason``): a usage error (exit 2) otherwise."""
    try:
        return vocabulary.checked_reason(text)
    except LRError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def site_id_text(text: str) -> str:
    """``--site-id``: a usage error (exit 2) before any site is reached; it was said after connecting,
    as a site's refusal (exit 1)."""
    if not valid_site_id(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a site id: {SITE_RULES}")
    return text


def site_ids_text(text: str) -> list[str]:
    """``--ids a,b``: each a site id, none twice (``a,a`` was taken as ``a``, silently); a usage error
    (exit 2) before any site is started or stopped."""
    ids = text.split(",")
    for site_id in ids:
        if not valid_site_id(site_id):
            raise argparse.ArgumentTypeError(f"{site_id!r} is not a site id: {SITE_RULES}")
    twice = sorted({s for s in ids if ids.count(s) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"{', '.join(map(repr, twice))} given twice")
    return ids


def region_text(text: str) -> str:
    """``--region``: one line of text (a newline in it was recorded, and printed as a line of its own)."""
    if not valid_region(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a region: {TEXT_RULES}")
    return text


def listen_address(text: str) -> str:
    """``HOST:PORT`` (host optional: 127.0.0.1) with a port from 0 to 65535: a malformed one is a
    usage error (exit 2) before anything starts; one that cannot be bound is said when binding."""
    port = text.rpartition(":")[2]
    if not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT with a port from 0 to 65535")
    return text


def with_topology(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """A command that reads the topology file takes ``--topology``."""
    p.add_argument("--topology", help="topology YAML (default $LR_TOPOLOGY or include/topology.yaml)")
    return p
