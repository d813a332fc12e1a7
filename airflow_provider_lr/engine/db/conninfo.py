"""How lr finds a site's PostgreSQL: a DSN, or an Airflow connection (env var or connections file).

It is also the one place lr connects (``tests/test_connect_owner.py`` fails on a
``psycopg2.connect`` anywhere else): every connection gets the keepalives, timeouts and call
deadline of its ``Purpose`` (``timeouts.py``), from the topology's settings where the caller has
a topology, else the defaults; the DSN's own parameters win.

This module reads Airflow's connection *formats* (``AIRFLOW_CONN_<ID>`` as URI or JSON, and the
local-filesystem connections file) without importing Airflow, so the CLI, Spark executors and the
engine resolve connections the same way the Airflow hook does.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import psycopg2
import psycopg2.extensions

from airflow_provider_lr.engine.db import orphans, reach
from airflow_provider_lr.engine.db.timeouts import (
    DEADLINES,
    DEFAULT,
    BoundedConnection,
    Purpose,
    Timeouts,
    deadline_for,
)
from airflow_provider_lr.engine.errors import (
    SHOWN_CHARS,
    ConfigurationError,
    InputError,
    SiteUnreachableError,
    mask_secrets,
    one_line,
    shown,
)
from airflow_provider_lr.paths import home_unset_hint, lr_home

log = logging.getLogger(__name__)

CONNECTIONS_FILE_ENV = "LR_CONNECTIONS_FILE"
# Connection extras that describe the site rather than libpq options.
SITE_EXTRAS = ("site_id", "region")
# libpq parameters whose value must be a whole number (libpq says so only as it connects).
_INTEGER_OPTIONS = (
    "connect_timeout",
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_count",
    "tcp_user_timeout",
)
# libpq options with a fixed set of values (libpq 17's; a value an older libpq lacks is still
# refused by it at the connect): any other value fails every connect before the network, so it
# is the connection's mistake, said before any site is reached (``check``).
_CHOICES = {
    "sslmode": ("disable", "allow", "prefer", "require", "verify-ca", "verify-full"),
    "gssencmode": ("disable", "prefer", "require"),
    "channel_binding": ("disable", "prefer", "require"),
    "target_session_attrs": ("any", "read-write", "read-only", "primary", "standby", "prefer-standby"),
    "load_balance_hosts": ("disable", "random"),
    "sslnegotiation": ("postgres", "direct"),
    "sslcertmode": ("disable", "allow", "require"),
}
# libpq parameters never shown: masked in ``safe_dsn``.
_SECRET_PARAMS = ("password", "sslpassword")


@dataclass(frozen=True)
class ConnInfo:
    """libpq connection parameters of one site plus its lr identity (from the connection extras)."""

    params: Mapping[str, Any]
    site_id: str | None = None
    region: str | None = None
    conn_id: str | None = field(default=None, compare=False)
    timeouts: Timeouts = field(default=DEFAULT, compare=False)  # the topology's, where there is one

    @property
    def dsn(self) -> str:
        """A libpq keyword/value string (password included: never log it, use ``safe_dsn``)."""
        return psycopg2.extensions.make_dsn(**{k: v for k, v in self.params.items() if v is not None})

    @property
    def safe_dsn(self) -> str:
        """The DSN with the password masked, for messages and logs."""
        shown = {k: ("***" if k in _SECRET_PARAMS else v) for k, v in self.params.items() if v is not None}
        return psycopg2.extensions.make_dsn(**shown)

    def check(self) -> ConnInfo:
        """``ConfigurationError`` when libpq cannot take these parameters, whatever the server: an
        option it does not know (an extra meant for something else), a port that is not a number.
        Found before any connect (``lr init --site`` took them as a server's refusal, or showed
        psycopg2's ``ProgrammingError``); a value libpq checks only as it connects is found there."""
        name = f"connection {self.conn_id!r}" if self.conn_id else "the connection"
        try:
            psycopg2.extensions.parse_dsn(self.dsn)
        except psycopg2.ProgrammingError as exc:  # (its safe_dsn cannot be made either)
            reason = re.sub(r'after "[^"]*"', "after a word", one_line(exc).removeprefix("invalid dsn: "))
            raise ConfigurationError(f"{name} is not valid: {reason}") from None
        dbname = self.params.get("dbname")
        if isinstance(dbname, str) and ("=" in dbname or _URI.match(dbname)):
            # libpq reads such a dbname as a connection string of its own, by its own rules: a
            # password's unescaped ``@`` then made the rest of it the host its errors quote
            raise ConfigurationError(
                f"{name}: its database name holds a connection string (libpq would read it as one, "
                "password and all): give its host, port, user, password and database as the "
                "connection's own parameters"
            )
        port = self.params.get("port")
        if port is not None and not all(
            not p.strip() or (p.strip().isdigit() and 0 < int(p) < 65536) for p in str(port).split(",")
        ):
            raise ConfigurationError(
                f"{name} ({self.safe_dsn}) has an invalid port {port!r}: give a number from 1 to 65535"
            )
        for option in _INTEGER_OPTIONS:
            value = self.params.get(option)
            if value is not None and not re.fullmatch(r"\s*-?\d+\s*", str(value)):
                raise ConfigurationError(f"{name} ({self.safe_dsn}) has an invalid {option} {value!r}: give a number")
        for option, choices in _CHOICES.items():
            value = self.params.get(option)
            if value is not None and str(value) not in choices:
                raise ConfigurationError(
                    f"{name} ({self.safe_dsn}) has an invalid {option} {value!r}: give one of {', '.join(choices)}"
                )
        return self

    def with_timeouts(self, timeouts: Timeouts) -> ConnInfo:
        return replace(self, timeouts=timeouts)

    def params_for(self, purpose: Purpose) -> dict[str, Any]:
        """The libpq parameters of a connection for ``purpose``: the DSN's, plus the bounds it sets none of."""
        return self.timeouts.libpq_params(purpose, self.params)

    def dsn_for(self, purpose: Purpose) -> str:
        """A DSN with the bounds of ``purpose`` written in, for a process that connects later (a Spark
        task, the lease keeper): ``connect_dsn`` there keeps them (password included: never log it)."""
        return psycopg2.extensions.make_dsn(**self.params_for(purpose))

    def connect(self, purpose: Purpose = Purpose.SESSION, **overrides: Any) -> psycopg2.extensions.connection:
        """A connection for ``purpose``, bounded (``timeouts.py``); ``SiteUnreachableError`` when the
        server cannot be reached now (retry), ``ConfigurationError`` when these parameters can never
        work (fix them). A server found unreachable earlier in the command is not waited for again
        (``reach``)."""
        where = f"site {self.site_id!r}" if self.site_id else "site"
        self.check()
        server = reach.key(self.params)
        earlier = reach.known(server)
        if earlier is not None:
            raise SiteUnreachableError(
                f"cannot connect to {where} ({self.safe_dsn}): it did not answer earlier in this command "
                f"({earlier}); not waited for again"
            )
        params = self.params_for(purpose)
        if DEADLINES.hurried is not None and params.get("connect_timeout"):  # the process is leaving (``hurry``):
            # a connect (a lease released at a site no call was waiting on) waits no longer than a call
            params["connect_timeout"] = max(2, min(int(params["connect_timeout"]), math.ceil(DEADLINES.hurried)))
        started = time.monotonic()
        try:
            conn = psycopg2.connect(
                psycopg2.extensions.make_dsn(**params), connection_factory=BoundedConnection, **overrides
            )
        except psycopg2.OperationalError as exc:
            reason = one_line(exc)
            if misconfigured(exc):
                raise ConfigurationError(
                    f"cannot connect to {where} ({self.safe_dsn}): {reason}; check the "
                    "connection's host, database, user, password and options"
                ) from exc
            if reach.silent(reason, time.monotonic() - started, params.get("connect_timeout")):
                reach.lost(server, f"connect: {reason}")  # waited on a silent server: not again
            raise SiteUnreachableError(
                f"cannot connect to {where} ({self.safe_dsn}): {reason}; {reach.advice(reason)}"
            ) from exc
        conn.server = server
        conn.opened()  # what other threads and messages ask of it later, noted on this thread
        conn.deadline_s = deadline_for(self.timeouts, purpose, self.params)
        conn.site = self.site_id or self.conn_id
        if purpose is not Purpose.APPLICATION:
            catalog_first(conn)
        if purpose is Purpose.SESSION:  # a heartbeat asks the same server while the connection is lifted
            conn.reopen = lambda: self.connect(Purpose.SESSION)
        elif purpose is Purpose.BULK:  # no deadline (a COPY takes as long as its data), a heartbeat instead:
            # a stopped server or a stalled link is found out as on a lifted session connection (on a
            # Unix socket nothing else would: no TCP bound applies there)
            conn.stall_deadline_s = self.timeouts.deadline_s(Purpose.SESSION)
            conn.reopen = lambda: self.connect(Purpose.SESSION)
        orphans.reap(conn)  # backends of calls lr cut there, if any
        return conn


# lr's own connections search pg_catalog alone (as PostgreSQL's replication workers do): no function
# or operator of another schema can then stand in for a built-in, not even one of other argument
# types that a better match would pick wherever it is on the path. lr names every other object with
# its schema. The site's path (without pg_catalog, which PostgreSQL then searches first by itself)
# is kept on the connection for the application code lr runs there (a full-sync provider). The
# statement itself runs with the site's path: every name in it is qualified.
_CATALOG_ONLY = """
SELECT pg_catalog.array_to_string(ARRAY(
    SELECT pg_catalog.quote_ident(s.name) FROM pg_catalog.unnest(pg_catalog.current_schemas(false))
    WITH ORDINALITY s(name, n) WHERE s.name OPERATOR(pg_catalog.<>) 'pg_catalog' ORDER BY s.n), ', '),
    pg_catalog.set_config('search_path', 'pg_catalog', false)"""


def catalog_first(conn: psycopg2.extensions.connection) -> None:
    """Built-ins in lr's statements resolve to PostgreSQL's own on ``conn``: a site whose search_path
    names a schema holding a function or operator named like one could otherwise have it stand in
    (a ``jsonb_array_elements`` that returns nothing skipped every change a sink applied, silently;
    an ``unnest(text[])`` beats ``pg_catalog.unnest(anyarray)`` wherever it is on the path). The
    search_path becomes ``pg_catalog`` alone; ``conn.site_path`` keeps the site's (``site_path``).
    The application's connections keep their path: its statements run there."""
    if conn.info.parameter_status("search_path") == "pg_catalog":  # reported at connect (PostgreSQL 18+)
        conn.site_path = ""
        return
    with conn.cursor() as cur:
        cur.execute(_CATALOG_ONLY)
        conn.site_path = cur.fetchone()[0]
    conn.commit()


@contextmanager
def site_path(conn: psycopg2.extensions.connection) -> Iterator[None]:
    """Inside a transaction of ``conn``: the application's code run in the block (a full-sync provider)
    resolves its names through the site's search_path, as on a connection of its own, where one of
    lr's searches pg_catalog alone (``catalog_first``); lr's statements after it, pg_catalog again.
    A connection lr did not open (the application's) keeps its path throughout."""
    path = getattr(conn, "site_path", None)
    if path is None:
        yield
        return
    with conn.cursor() as cur:
        cur.execute("SELECT pg_catalog.set_config('search_path', %s, true)", (path,))
    yield
    with conn.cursor() as cur:
        cur.execute("SELECT pg_catalog.set_config('search_path', 'pg_catalog', true)")


def connect_dsn(
    dsn: str, purpose: Purpose = Purpose.SESSION, timeouts: Timeouts | None = None, **overrides: Any
) -> psycopg2.extensions.connection:
    """``from_dsn(dsn).connect(purpose)``: for code handed a DSN (Spark tasks, bulk plans)."""
    info = from_dsn(dsn)
    return (info.with_timeouts(timeouts) if timeouts else info).connect(purpose, **overrides)


# What a failed connect says when retrying cannot help: the server answered and refused these
# parameters (SQLSTATE class 28 and 3D000 when libpq passes them on), or the host name is unknown.
_MISCONFIGURED_SQLSTATES = ("28000", "28P01", "3D000")
_MISCONFIGURED_TEXT = (
    "authentication failed",
    "no password supplied",
    "does not exist",
    "no pg_hba.conf entry",
    "could not translate host name",
    "invalid connection option",
    "invalid integer value",
    "invalid value for parameter",  # the server's, for an option libpq passes on (replication, options' -c)
)
# libpq's 'invalid <option> value: "..."' (sslmode, target_session_attrs, require_auth, ...): refused
# before the network, at every try (was "is the server up?", and lr sync retried it for ever)
_INVALID_OPTION_VALUE = re.compile(r'invalid [a-z_]+ value: "')


def misconfigured(exc: psycopg2.OperationalError) -> bool:
    """True when a failed connect is the parameters' fault, not the server's state."""
    if getattr(exc, "pgcode", None) in _MISCONFIGURED_SQLSTATES:
        return True
    text = str(exc).lower()
    return any(marker in text for marker in _MISCONFIGURED_TEXT) or _INVALID_OPTION_VALUE.search(text) is not None


def _json(text: str, where: str) -> Any:
    """``text`` parsed as JSON; ``ConfigurationError`` naming ``where`` it came from when it is not."""
    try:
        return json.loads(text)
    except ValueError as exc:
        raise InputError(f"{where} is not valid JSON: {exc}") from None
    except RecursionError:
        raise InputError(f"{where} is not valid JSON: nested too deeply") from None


def from_airflow_dict(conn: Mapping[str, Any], conn_id: str | None = None) -> ConnInfo:
    """Build from Airflow's JSON connection form (``conn_type``, ``host``, ``login``, ``extra`` …);
    ``ConfigurationError`` when it is not that form."""
    name = f"connection {conn_id!r}" if conn_id else "the connection"
    if not isinstance(conn, Mapping):
        raise ConfigurationError(
            f"{name} must be a JSON object (conn_type, host, port, login, password, schema, extra) or a URI, "
            f"not {type(conn).__name__}"
        )
    extra = conn.get("extra") or {}
    if isinstance(extra, str):
        extra = _json(extra, f"the extra of {name}") if extra.strip() else {}
    if not isinstance(extra, Mapping):
        raise ConfigurationError(f"the extra of {name} must be a JSON object, not {type(extra).__name__}")
    params: dict[str, Any] = {
        "host": conn.get("host") or None,
        "port": conn.get("port") or None,
        "user": conn.get("login") or None,
        "password": conn.get("password") or None,
        "dbname": conn.get("schema") or None,
    }
    for key, value in extra.items():
        if key not in SITE_EXTRAS:
            params[key] = value
    return ConnInfo(params, site_id=extra.get("site_id"), region=extra.get("region"), conn_id=conn_id)


# A connection string given as a URI (``scheme://``); anything else is libpq's key=value form.
_URI = re.compile(r"\s*[A-Za-z][A-Za-z0-9+.-]*://")


def _password_cut(parts: Any) -> bool:
    """An ``@`` after the URI's authority: in its path or fragment, or in a query parameter's name.
    A password holding an unescaped ``/``, ``?`` or ``#`` ends the authority there, and the rest of
    it became the database name or an option (``postgresql://u:p/ss@h/db``: host ``p``... quoted
    in every message after)."""
    names = (pair.partition("=")[0] for pair in parts.query.split("&"))
    return "@" in parts.path or "@" in parts.fragment or any("@" in n for n in names)


def from_uri(uri: str, conn_id: str | None = None) -> ConnInfo:
    """Build from a ``postgresql://`` / ``postgres://`` / ``lr-site://`` URI (Airflow's URI form)."""
    parts = urlsplit(uri)
    if _password_cut(parts):  # the URI is not quoted back: which part is the password is unknown
        raise ConfigurationError(
            f"{f'connection {conn_id!r}' if conn_id else 'the URI given'} is not a valid URI: an '@' follows its host, "
            "so its password (or user) holds a '/', '?', '#' or '@' left as is: percent-encode them "
            "(%2F, %3F, %23, %40), or give the password in PGPASSWORD or ~/.pgpass"
        )
    name = f"connection {conn_id or mask_secrets(uri)!r}"  # a URI's password is never quoted
    query = dict(parse_qsl(parts.query))
    if "__extra__" in query:
        extra = _json(query.pop("__extra__"), f"the __extra__ of {name}")
        if not isinstance(extra, Mapping):
            raise ConfigurationError(f"the __extra__ of {name} must be a JSON object")
        query.update(extra)
    try:
        port = parts.port
    except ValueError:
        raise ConfigurationError(f"{name} has an invalid port: give a number from 1 to 65535") from None
    return from_airflow_dict(
        {
            "host": unquote(parts.hostname or "") or None,
            "port": port,
            "login": unquote(parts.username or "") or None,
            "password": unquote(parts.password or "") or None,
            "schema": unquote(parts.path.lstrip("/")) or None,
            "extra": query,
        },
        conn_id,
    )


def from_dsn(dsn: str) -> ConnInfo:
    """Build from a libpq DSN, either ``key=value`` pairs or a URI."""
    if _URI.match(dsn):  # (``dbname='postgresql://...'`` is key=value: ``check`` refuses it)
        return from_uri(dsn)
    try:
        return ConnInfo(psycopg2.extensions.parse_dsn(dsn))
    except psycopg2.ProgrammingError as exc:
        # libpq quotes the word it stumbled on, which may be a piece of a password: left out
        reason = re.sub(r'after "[^"]*"', "after a word", one_line(exc).removeprefix("invalid dsn: "))
        raise ConfigurationError(
            f"the DSN given is not valid ({reason}): write key=value pairs, a value with spaces in single "
            "quotes, or a postgresql:// URI"
        ) from None


def connections_file() -> Path:
    """The Airflow-format connections file lr writes for embedded sites and reads back."""
    explicit = os.environ.get(CONNECTIONS_FILE_ENV)
    if explicit:
        return Path(explicit)
    return lr_home() / "connections.json"


def load_connections_file(path: Path | None = None) -> dict[str, ConnInfo]:
    path = path or connections_file()
    if not path.exists():
        return {}
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"connections file {path} cannot be read: {exc}") from None
    raw = _json(text, f"connections file {path}")
    if not isinstance(raw, Mapping):  # the user's file, as a malformed topology: exit 2 in the CLI
        raise InputError(
            f"connections file {path} must be a JSON object of connection id -> connection, not {type(raw).__name__}"
        )
    known = {
        conn_id: from_uri(value, conn_id) if isinstance(value, str) else from_airflow_dict(value, conn_id)
        for conn_id, value in raw.items()
    }
    _warn_if_others_can_read(path, known)
    return known


# Connections files already warned of (``_warn_if_others_can_read``): once per file and mode.
_WARNED: set[tuple[str, int]] = set()


def _warn_if_others_can_read(path: Path, known: Mapping[str, ConnInfo]) -> None:
    """A connections file holding a password that its group or others may read or write is said
    once (libpq ignores such a ``.pgpass``, ssh such a key): lr still reads it, as Airflow does."""
    if os.name != "posix" or not any(info.params.get(p) for info in known.values() for p in _SECRET_PARAMS):
        return
    try:
        mode = path.stat().st_mode & 0o777
    except OSError:
        return
    if not mode & 0o077 or (str(path), mode) in _WARNED:
        return
    _WARNED.add((str(path), mode))
    log.warning(
        "connections file %s holds passwords and others than its owner may read or change it (mode %04o): chmod 600 %s",
        path,
        mode,
        path,
    )


# Other places a connection id is found, asked last (``add_lookup``); None: not there.
_LOOKUPS: list[Callable[[str], ConnInfo | None]] = []


def add_lookup(lookup: Callable[[str], ConnInfo | None]) -> None:
    """Ask ``lookup`` for a connection id neither ``AIRFLOW_CONN_<ID>`` nor the connections file
    holds (None: not there; ``ConfigurationError``: that place could not be read, said in the
    unknown connection's error). The ``lr`` command adds Airflow's own connections (its metadata
    database and secrets backends: a connection made in the UI), which the engine cannot import."""
    if lookup not in _LOOKUPS:
        _LOOKUPS.append(lookup)


def resolve(target: str) -> ConnInfo:
    """Resolve a DSN, an ``AIRFLOW_CONN_<ID>`` connection id, or an id from the connections file."""
    if not isinstance(target, str):  # an open connection, say: lr opens (and bounds) its own
        raise ConfigurationError(
            f"a site is given as a DSN, an Airflow connection id or an lr site id (a string), "
            f"not a {type(target).__name__}: lr opens its own connections to it"
        )
    if not target.strip():  # was "unknown site or connection '': ... set AIRFLOW_CONN_, ..."
        raise ConfigurationError(
            f"the site or connection given is empty ({target!r}): give a DSN, an Airflow connection id or an lr site id"
        )
    if "=" in target or "://" in target:
        return from_dsn(target)
    env = os.environ.get(f"AIRFLOW_CONN_{target.upper()}")
    if env:
        env = env.strip()
        if env.startswith("{"):
            return from_airflow_dict(_json(env, f"AIRFLOW_CONN_{target.upper()}"), target)
        return from_uri(env, target)
    known = load_connections_file()
    if target in known:
        return known[target]
    by_site = [info for info in known.values() if info.site_id == target]
    if len(by_site) == 1:
        return by_site[0]
    asked = ""
    for lookup in _LOOKUPS:
        try:
            found = lookup(target)
        except ConfigurationError as exc:  # that place could not be read: said beside where else to put it
            asked = f"; {one_line(exc)}"
            continue
        if found is not None:
            return found
    unset = "" if os.environ.get(CONNECTIONS_FILE_ENV) else home_unset_hint(connections_file())
    env = f"AIRFLOW_CONN_{target.upper()}" if len(target) <= SHOWN_CHARS else "AIRFLOW_CONN_<ID>"
    raise ConfigurationError(
        f"unknown site or connection {shown(target)}: give a DSN, set {env}, "
        f"add it to {connections_file()} (`lr sites up` writes embedded sites there), or create it "
        f"in Airflow (read when Airflow is installed here and $AIRFLOW_HOME is set){asked}"
        + (f"; {unset}" if unset else "")
    )
