"""Install and upgrade the ``lr`` schema on a site from the versioned SQL files in ``include/migrations``.

Migrations are named ``V<4 digits>__<name>.sql`` and applied in order, all in one transaction under
an advisory lock, so two ``lr init`` racing on one site cannot interleave and a failure leaves the
site as it was. Each applied version is recorded with its checksum: re-running is a no-op, an edited
migration or a site newer than this code is refused with a clear error.
"""

from __future__ import annotations

import functools
import hashlib
import re
import time
import weakref
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg2.errors
import psycopg2.extensions

from airflow_provider_lr.engine.db.local_settings import on_callers_connection
from airflow_provider_lr.engine.db.topology_schema import TEXT_RULES, valid_region, valid_site_id
from airflow_provider_lr.engine.errors import SchemaError
from airflow_provider_lr.engine.vocabulary import SCHEMA_LOCK_KEY

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

# Package data mapped from include/migrations (setup.cfg): found the same way in a source checkout,
# an editable install and a wheel, with no guess at where the files were put.
MIGRATIONS_PACKAGE = "airflow_provider_lr.migrations"
_NAME = re.compile(r"^V(\d{4})__([a-z0-9_]+)\.sql$")

# Created only when missing: ``CREATE ... IF NOT EXISTS`` checks its privilege (CREATE on the
# database, on the schema) before it looks whether the object exists.
_CREATE_SCHEMA = "CREATE SCHEMA lr"
_CREATE_MIGRATIONS = """
CREATE TABLE lr.schema_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    checksum   text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)
"""


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()

    @property
    def sent(self) -> str:
        """The SQL as run: a whole-line comment's characters outside ASCII as ``?``. The server
        converts a statement's whole text to the database's encoding, comments too: a LATIN1
        database refused V0041 for a comment's euro sign (``lr init`` failed there), and a released
        migration's text may not change (its checksum)."""
        return _COMMENT_LINE.sub(lambda m: _NON_ASCII.sub("?", m.group(0)), self.sql)


_COMMENT_LINE = re.compile(r"^[ \t]*--.*$", re.MULTILINE)
_NON_ASCII = re.compile(r"[^\x00-\x7f]")


@dataclass(frozen=True)
class MigrationResult:
    applied: list[int]
    version: int


def available_migrations(directory: Path | Traversable | None = None) -> list[Migration]:
    """The migrations shipped with this code (or those in ``directory``), in version order (gaps and
    duplicates refused)."""
    directory = directory or resources.files(MIGRATIONS_PACKAGE)
    found: list[Migration] = []
    for path in sorted((p for p in directory.iterdir() if p.name.endswith(".sql")), key=lambda p: p.name):
        match = _NAME.match(path.name)
        if not match:
            raise SchemaError(f"badly named migration {path} (expected V0001__name.sql)")
        found.append(Migration(int(match.group(1)), match.group(2), path.read_text(encoding="utf-8")))
    for expected, migration in enumerate(found, start=1):
        if migration.version != expected:
            raise SchemaError(f"migrations in {directory} must be numbered 1..N without gaps; got {migration.version}")
    if not found:
        raise SchemaError(f"no migrations found in {directory}")
    return found


def current_version(conn: psycopg2.extensions.connection) -> int:
    """The site's schema version, 0 when lr was never installed there."""
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT pg_catalog.to_regclass('lr.schema_migrations') IS NOT NULL")
            if not cur.fetchone()[0]:
                return 0
            cur.execute("SELECT coalesce(pg_catalog.max(version), 0) FROM lr.schema_migrations")
            return cur.fetchone()[0]
    except psycopg2.errors.InsufficientPrivilege as exc:
        conn.rollback()
        raise SchemaError(
            _privilege_message(
                conn,
                exc,
                "read the lr schema version",
                "the owner of the lr schema gives a role what it needs with `lr roles grant` (docs/security.md)",
            )
        ) from exc


@functools.cache
def latest_version() -> int:
    """The newest migration shipped with this code (read once per process)."""
    return available_migrations()[-1].version


# The oldest lr schema lr's work on a site other than the stream runs on: the session cycles, the
# bulk movers (tee, Spark, snapshot transfer, table snapshots), the replicator members, a failover,
# a topology apply. V0020: a lease taken from a dead member reads lr.replicator_members. A migration
# that adds or changes something they use raises it; one only the stream uses (V0021 on) does not.
# Between it and the latest, the cycles carry a site the stream refuses (``lr status`` says so).
REPLICATION_SCHEMA = 20

# A connection's site found at a version (versions only grow: a later check that needs no more
# than it is not read again): the check costs one read per connection, not per cycle.
_checked: weakref.WeakKeyDictionary[psycopg2.extensions.connection, int] = weakref.WeakKeyDictionary()


def require_current(conn: psycopg2.extensions.connection, what: str, oldest: int | None = None) -> None:
    """Refuse a site whose lr schema is older than ``oldest`` (default: this lr's latest migration),
    for ``what`` needs it (a replicator upgraded before its sites were: ``lr init`` migrates them);
    a site without lr is told so. Read once per connection that passes; a transaction it opened to
    read is ended, the caller's is left open."""
    need = latest_version() if oldest is None else oldest
    if _checked.get(conn, 0) >= need:
        return
    opened = not conn.autocommit and conn.info.transaction_status == psycopg2.extensions.TRANSACTION_STATUS_IDLE
    have = current_version(conn)
    if opened:
        conn.rollback()
    if have == 0:
        raise SchemaError(_not_installed(conn))
    if have < need:
        latest = latest_version()
        needs = "needs it" if need == latest else f"needs version {need} or later"
        raise SchemaError(
            f"site {_where(conn)} has lr schema version {have}, older than this lr's {latest}: {what} {needs}; "
            "run `lr init` on the site as the owner of the lr schema"
        )
    _checked[conn] = have


def at_least(conn: psycopg2.extensions.connection, version: int) -> bool:
    """Whether the site's lr schema is at ``version`` or later: what a mover that runs on older sites
    too adds only where the site has it (read once per connection that has it; a transaction it
    opened to read is ended)."""
    if _checked.get(conn, 0) >= version:
        return True
    opened = not conn.autocommit and conn.info.transaction_status == psycopg2.extensions.TRANSACTION_STATUS_IDLE
    have = current_version(conn)
    if opened:
        conn.rollback()
    _checked[conn] = max(have, _checked.get(conn, 0))
    return have >= version


def behind(version: int) -> str | None:
    """What a site at ``version`` misses of this lr, or this lr of it, as ``lr status`` says it (None:
    it is current)."""
    latest = latest_version()
    if version > latest:  # `lr init` refuses it; status called the site healthy and said nothing
        return (
            f"lr schema v{version} is newer than this lr's v{latest}: upgrade airflow-provider-lr where lr "
            "runs (this lr may misread what the newer schema records)"
        )
    if version == latest:
        return None
    refused = (
        "lr replicates nothing with it"
        if version < REPLICATION_SCHEMA
        else "its sessions are not streamed (the session cycles carry them)"
    )
    if version == 0:  # never initialised, not old: what a new user who skipped `lr init` meets
        return f"no lr schema: {refused}; run `lr init` on the site"
    return (
        f"lr schema v{version} is older than this lr's v{latest}: {refused}; run `lr init` on the site as "
        "the owner of the lr schema"
    )


MIGRATION_LOCK_TRY = "1s"  # one try's wait for a table's lock (the ALTERs of lr's tables)
MIGRATION_STEP_ASIDE_S = 0.5  # between tries: the transactions queued behind the upgrade go first
MIGRATION_PATIENCE_S = 60.0  # the tries' whole wait when the connection sets no lock_timeout


def migrate(
    conn: psycopg2.extensions.connection, target: int | None = None, migrations: list[Migration] | None = None
) -> MigrationResult:
    """Bring the site to ``target`` (default: latest) and commit; returns what was applied.

    Needs only what the pending migrations need: with nothing to apply, reading
    ``lr.schema_migrations`` is all it does (no lock, no DDL); the schema and the migrations table
    are created only when missing (creating the schema needs CREATE on the database).

    A migration altering a table lr's writers and streams use (V0046: lr.log_entries, ACCESS
    EXCLUSIVE) waits for the transactions open on it; every transmit and stream read then queued
    behind the upgrade for as long (lr init's lock_timeout, 60 s). It now waits in short tries
    (``MIGRATION_LOCK_TRY``), rolled back and stepping aside between them, for the connection's
    lock_timeout in all; then it is refused naming the transactions holding lr's tables."""
    migrations = migrations if migrations is not None else available_migrations()
    latest = migrations[-1].version
    target = latest if target is None else target
    if not 0 < target <= latest:
        raise SchemaError(f"target schema version {target} is not between 1 and {latest}")
    deadline: float | None = None  # set at the first try that timed out (rolled back)
    while True:
        try:
            return _migrate_once(conn, target, migrations)
        except psycopg2.errors.LockNotAvailable:
            deadline = time.monotonic() + _patience(conn) if deadline is None else deadline
            if time.monotonic() >= deadline:
                raise SchemaError(_busy_message(conn, target)) from None
            time.sleep(MIGRATION_STEP_ASIDE_S)


def _patience(conn: psycopg2.extensions.connection) -> float:
    """The connection's lock_timeout in seconds (``MIGRATION_PATIENCE_S`` when it has none)."""
    with conn.cursor() as cur:
        cur.execute("SELECT extract(epoch FROM current_setting('lock_timeout')::interval)")
        seconds = float(cur.fetchone()[0])
    conn.rollback()
    return seconds if seconds > 0 else MIGRATION_PATIENCE_S


def _busy_message(conn: psycopg2.extensions.connection, target: int) -> str:
    """Who holds lr's tables (the oldest transactions first): what the upgrade waited for."""
    with conn.cursor() as cur:
        cur.execute(
            "SELECT string_agg(format('pid %s (%s, %s, open %s s)', a.pid, coalesce(nullif(a.application_name, ''),"
            " 'no application_name'), a.state, extract(epoch FROM now() - a.xact_start)::bigint), '; ' "
            "ORDER BY a.xact_start) FROM pg_stat_activity a WHERE a.pid <> pg_backend_pid() AND a.pid IN ("
            "SELECT l.pid FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
            "WHERE l.granted AND c.relnamespace = to_regnamespace('lr'))"
        )
        holders = cur.fetchone()[0] or "none now"
    conn.rollback()
    return (
        f"lr schema upgrade to v{target} on site {_where(conn)} waited {_patience(conn):.0f} s in short tries for "
        f"lr's tables, which open transactions held throughout (holding them now: {holders}); nothing was "
        "changed; end those transactions (a long one is often an idle application's) and run `lr init` again"
    )


def _migrate_once(conn: psycopg2.extensions.connection, target: int, migrations: list[Migration]) -> MigrationResult:
    applied: list[int] = []
    try:
        with conn.cursor() as cur:
            done = _applied_versions(conn, cur)
            pending = _pending(conn, done, migrations, target)
            if pending:
                cur.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK_KEY,))
                cur.execute("SELECT to_regnamespace('lr') IS NULL")
                if cur.fetchone()[0]:
                    cur.execute(_CREATE_SCHEMA)
                cur.execute("SELECT to_regclass('lr.schema_migrations') IS NULL")
                if cur.fetchone()[0]:
                    cur.execute(_CREATE_MIGRATIONS)
                done = _applied_versions(conn, cur)  # another init may have applied them meanwhile
                pending = _pending(conn, done, migrations, target)
                cur.execute(f"SET LOCAL lock_timeout = '{MIGRATION_LOCK_TRY}'")  # the DDL's tries (migrate)
            for migration in pending:
                cur.execute(migration.sent)
                cur.execute(
                    "INSERT INTO lr.schema_migrations (version, name, checksum) VALUES (%s, %s, %s)",
                    (migration.version, migration.name, migration.checksum),
                )
                applied.append(migration.version)
        conn.commit()
    except psycopg2.errors.InsufficientPrivilege as exc:
        conn.rollback()
        raise SchemaError(_privilege_message(conn, exc, "install or upgrade the lr schema")) from exc
    except BaseException:
        conn.rollback()
        raise
    return MigrationResult(applied, max([*done, *applied], default=0))


def _applied_versions(conn: psycopg2.extensions.connection, cur: psycopg2.extensions.cursor) -> dict[int, str]:
    """version -> checksum of the migrations recorded on the site ({} when lr was never installed)."""
    cur.execute("SELECT to_regclass('lr.schema_migrations') IS NOT NULL")
    if not cur.fetchone()[0]:
        return {}
    cur.execute("SELECT version, checksum FROM lr.schema_migrations ORDER BY version")
    return dict(cur.fetchall())


def _pending(
    conn: psycopg2.extensions.connection, done: dict[int, str], migrations: list[Migration], target: int
) -> list[Migration]:
    """The migrations to apply (up to ``target``); refuses a site newer than this code or a
    recorded migration that differs from the shipped one."""
    latest = migrations[-1].version
    newest = max(done, default=0)
    if newest > latest:
        raise SchemaError(
            f"site {_where(conn)} has lr schema version {newest}, newer than this lr knows ({latest}); "
            "upgrade airflow-provider-lr"
        )
    pending = []
    for migration in migrations:
        if migration.version in done:
            if done[migration.version] != migration.checksum:
                raise SchemaError(
                    f"migration V{migration.version:04d} ({migration.name}) on site {_where(conn)} "
                    "differs from the one shipped; migrations must never be edited once released"
                )
        elif migration.version <= target:
            pending.append(migration)
    return pending


_OWNER_HINT = (
    "run `lr init` as the owner of the lr schema (a new install also needs CREATE on the database, "
    "unless the schema exists already)"
)


def _privilege_message(conn: psycopg2.extensions.connection, exc: Exception, what: str, hint: str = _OWNER_HINT) -> str:
    user = conn.get_dsn_parameters().get("user", "?")
    detail = str(getattr(exc, "pgerror", None) or exc).strip().removeprefix("ERROR:").strip()
    return f"role {user!r} may not {what} on site {_where(conn)} ({detail}); {hint}"


@on_callers_connection
def init_site(conn: psycopg2.extensions.connection, site_id: str, region: str | None = None) -> MigrationResult:
    """Install or upgrade the schema and record the site's identity (refuses to rename a site).
    ``region``: None keeps the recorded one ('default' for a new site). On an installed site with
    nothing to change, it only reads (any role granted by ``lr roles`` may run it)."""
    if not valid_site_id(site_id):
        raise SchemaError(
            f"invalid site id {site_id!r}: use 1-63 lowercase letters, digits, '-' or '_', starting with a letter or digit"
        )
    if region is not None and not valid_region(region):
        raise SchemaError(f"invalid region {region!r}: {TEXT_RULES}")
    result = migrate(conn)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT site_id, region FROM lr.site_info")
            row = cur.fetchone()
            if row is None or (region is not None and row[1] != region):  # a write: one init at a time
                cur.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK_KEY,))  # concurrent inits: one inserts
                cur.execute("SELECT site_id, region FROM lr.site_info FOR UPDATE")
                row = cur.fetchone()
            if row is None:
                cur.execute(
                    "INSERT INTO lr.site_info (site_id, region) VALUES (%s, %s)", (site_id, region or "default")
                )
            elif row[0] != site_id:
                conn.rollback()
                raise SchemaError(
                    f"database {_where(conn)} is already lr site {row[0]!r}; refusing to rename it to {site_id!r}"
                )
            elif region is not None and row[1] != region:
                cur.execute("UPDATE lr.site_info SET region = %s", (region,))
        conn.commit()
    except psycopg2.errors.InsufficientPrivilege as exc:
        conn.rollback()
        raise SchemaError(_privilege_message(conn, exc, f"record the site identity {site_id!r} ({region})")) from exc
    except BaseException:
        conn.rollback()
        raise
    return result


def site_identity(conn: psycopg2.extensions.connection) -> tuple[str, str]:
    """(site_id, region) recorded by ``lr init``; a clear error when the site was never initialised."""
    if current_version(conn) == 0:
        raise SchemaError(_not_installed(conn))
    with conn.cursor() as cur:
        cur.execute("SELECT site_id, region FROM lr.site_info")
        row = cur.fetchone()
    if row is None:
        raise SchemaError(f"database {_where(conn)} has the lr schema but no site id; run `lr init --site-id ...`")
    return row[0], row[1]


def _not_installed(conn: psycopg2.extensions.connection) -> str:
    return f"database {_where(conn)} has no lr schema; run `lr init` on it first"


def _where(conn: psycopg2.extensions.connection) -> str:
    params = conn.get_dsn_parameters()
    return f"{params.get('host', '?')}:{params.get('port', '?')}/{params.get('dbname', '?')}"
