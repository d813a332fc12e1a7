"""Least-privilege roles on a site (docs/security.md), enforced by the database.

Three kinds, beside the owner of the ``lr`` schema (who installs it and applies the topology):

* ``replicator`` — runs every session of the site, as source and as sink: reads the shared log,
  keeps the session metadata, writes every client's receive queues, trims the log;
* ``writer`` of a client — transmits as that client only (``RoutingQueueClient``, and supplies
  that client's full syncs); it cannot read the shared log, nor touch commit positions or the trim;
* ``consumer`` of a client — reads and acknowledges that client's receive queues and dead
  letters only (``RoutingQueueSubscriber``, the relay, the bulk apply).

``PRIVILEGES`` lists the table, column and sequence privileges of each kind; migration V0006's
row-level security policies restrict writers and consumers to their clients' rows, reading
``lr.role_grants`` (which ``grant`` fills). A grant is the GRANT statements plus that row, in one
transaction; ``revoke`` deletes rows and resets the role's privileges on the schema to what its
remaining grants need. Every statement is built with ``psycopg2.sql`` (role names are quoted
identifiers, values literals), so ``render`` prints exactly what runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

import psycopg2.errors
import psycopg2.extensions
from psycopg2 import sql

from airflow_provider_lr.engine.db.local_settings import on_callers_connection
from airflow_provider_lr.engine.db.topology_schema import valid_client_name
from airflow_provider_lr.engine.errors import ConfigurationError, SchemaError, is_control, listing, one_line, shown
from airflow_provider_lr.engine.store.topology import applied_document
from airflow_provider_lr.engine.vocabulary import SCHEMA_LOCK_KEY

KINDS = ("replicator", "writer", "consumer")
ROLES_SCHEMA_VERSION = 6  # lr.role_grants and the policies
MAX_ROLE_NAME_BYTES = 63  # NAMEDATALEN - 1: PostgreSQL would truncate a longer name silently


@dataclass(frozen=True)
class Privilege:
    """``GRANT <privileges> ON <kind> lr.<object> ...`` for each object; ``privileges`` is fixed
    text from this module (``SELECT, UPDATE (delivered)``), never user input."""

    privileges: str
    objects: tuple[str, ...]
    kind: str = "TABLE"  # or "SEQUENCE"


# Every kind: find the site and its version (lr init's read path, site_identity), and its own grants
# (the row-level security policies read lr.role_grants as the caller).
COMMON = (Privilege("SELECT", ("schema_migrations", "site_info", "role_grants")),)

PRIVILEGES: dict[str, tuple[Privilege, ...]] = {
    "replicator": (
        # source: the topology, the log (read; trim deletes; full-sync data from providers inserts,
        # stream 2 only by policy), commit positions (read; trim deletes), sessions, requests
        Privilege("SELECT", ("topology", "remote_sites", "clients", "shared_log", "replication_status")),
        Privilege("SELECT, INSERT, DELETE", ("log_entries",)),
        Privilege("SELECT, DELETE", ("log_commits",)),
        Privilege("SELECT, UPDATE", ("log_trim", "source_sessions")),
        Privilege("SELECT, INSERT, UPDATE", ("full_sync_requests",)),
        # the replicator processes sharing the sessions (members: join, beat, forget the dead, leave)
        Privilege("SELECT, INSERT, UPDATE, DELETE", ("replicator_members",)),
        Privilege("USAGE", ("replicator_member_lock_seq",), "SEQUENCE"),
        Privilege("SELECT", ("commit_position_seq",), "SEQUENCE"),  # the read barrier notes its value
        Privilege("USAGE", ("log_entry_id_seq",), "SEQUENCE"),  # entry ids of provider-supplied data
        # sink: session metadata, every client's receive queue, its registration, Spark staging
        Privilege("SELECT, INSERT, UPDATE", ("sink_sessions", "registry")),
        Privilege("SELECT, INSERT, UPDATE, DELETE", ("receive_queue", "spark_staging", "spark_staged_ranges")),
        Privilege("SELECT", ("receive_dead_letters",)),  # counted by status
        # federated tables at a sink: each session's tables, Spark ranges written, the origin ledger
        # (the tables themselves are the application's: grant them to the replicator, docs/tables.md)
        Privilege("SELECT, INSERT, UPDATE, DELETE", ("sink_tables", "sink_table_ranges", "table_row_origin")),
        Privilege("SELECT, DELETE", ("delivery_guards",)),  # status reads them; stale ones expire
    ),
    "writer": (
        # its client's id, the sinks it replicates to (the topology's payload limit)
        Privilege("SELECT", ("clients", "remote_sites", "topology")),
        Privilege("SELECT (sink_site_id, client_name, acked_position)", ("source_sessions",)),
        # an entry: tx and entry_id always take their defaults; client_id is checked by policy
        Privilege("INSERT (stream, tag_ids, client_id, message)", ("log_entries",)),
        Privilege("USAGE", ("log_entry_id_seq",), "SEQUENCE"),
        # supplying its client's full syncs (serve_full_sync_requests): the barrier, the request
        Privilege("SELECT", ("commit_position_seq",), "SEQUENCE"),
        Privilege(
            "SELECT, UPDATE (status, supplied_at, supplied_tx, base_position, base_snapshot, base_upto, entries, note)",
            ("full_sync_requests",),
        ),
        # waiting for its transmits to be safe (docs/delivery.md): the sinks' acknowledged positions
        # (above) and a guard while it waits; its commit position through lr.commit_position_of
        Privilege("SELECT, INSERT, DELETE", ("delivery_guards",)),
    ),
    "consumer": (
        Privilege("SELECT", ("registry",)),  # discovery of its queues
        Privilege("SELECT, DELETE, UPDATE (delivered)", ("receive_queue",)),
        Privilege("SELECT, INSERT, DELETE", ("receive_dead_letters",)),
    ),
}


@dataclass(frozen=True)
class RoleGrant:
    """One row of ``lr.role_grants`` as the owner sees it."""

    role_name: str  # the role's name now (or when granted, if it was dropped)
    kind: str
    client_name: str  # '' for a replicator
    granted_at: datetime
    exists: bool  # the role still exists

    def describe(self) -> str:
        what = self.kind if self.kind == "replicator" else f"{self.kind} of {self.client_name}"
        return f"{self.role_name}: {what}" + ("" if self.exists else " (role dropped)")


@dataclass(frozen=True)
class Statement:
    """One statement of a plan; ``shown`` is what is printed when it differs (a password masked)."""

    query: sql.Composable
    shown: sql.Composable | None = None


# --- validation ---------------------------------------------------------------------------------
def check_request(kind: str, role: str, clients: Sequence[str]) -> list[str]:
    """The clients of a grant or revoke, validated with the kind and the role name (clear errors)."""
    if kind not in KINDS:
        raise ConfigurationError(f"unknown role kind {kind!r}; one of {', '.join(KINDS)}")
    if not role or len(role.encode()) > MAX_ROLE_NAME_BYTES or any(map(is_control, role)):
        raise ConfigurationError(
            f"invalid role name {shown(role)}: 1 to {MAX_ROLE_NAME_BYTES} bytes, no control characters (a newline "
            "would break every line lr prints about the role)"
        )
    unique = list(dict.fromkeys(clients))
    if kind == "replicator":
        if unique:
            raise ConfigurationError("a replicator serves every client of the site: give no --client")
        return [""]
    if not unique:
        raise ConfigurationError(f"a {kind} is the {kind} of a client: give --client NAME")
    bad = [c for c in unique if not valid_client_name(c)]  # a pattern's '$' let "policy\n" through
    if bad:
        raise ConfigurationError(
            f"invalid client name(s) {', '.join(map(shown, bad))}: letters, digits, '-' or '_', at most 63"
        )
    return unique


def _require_roles_schema(conn: psycopg2.extensions.connection) -> None:
    from airflow_provider_lr.engine.db.schema import current_version  # schema imports nothing of this

    version = current_version(conn)
    if version < ROLES_SCHEMA_VERSION:
        raise SchemaError(
            f"site {_where(conn)} is at lr schema version {version}; roles need version {ROLES_SCHEMA_VERSION} "
            "(run `lr init` on it first)"
        )


def _require_clients_here(cur: psycopg2.extensions.cursor, kind: str, clients: Sequence[str]) -> None:
    """Refuse clients the topology applied to this site does not make it the source (a writer) or a
    sink (a consumer) of, naming those it does."""
    document = applied_document(cur)
    if document is None:
        raise ConfigurationError(
            f"no topology is applied on site {_where(cur.connection)}: apply it first (`lr topology apply`), "
            f"so that the {kind}'s client(s) can be checked"
        )
    cur.execute("SELECT site_id FROM lr.site_info")
    here = cur.fetchone()[0]
    writer = kind == "writer"
    known = sorted(
        {
            c
            for r in document.get("replication") or []
            for c in r.get("clients", [])
            if (here == r.get("source") if writer else here in r.get("sinks", []))
        }
    )
    unknown = [c for c in clients if c not in known]
    if unknown:
        role = "the source" if writer else "a sink"
        raise ConfigurationError(
            f"client(s) {listing(unknown)}: site {here!r} is not {role} of them in the topology applied there "
            f"(it is {role} of {listing(known) if known else 'no client'}); a {kind} is granted where its client "
            f"{'transmits' if writer else 'is received'}"
        )


def _role_state(cur: psycopg2.extensions.cursor, role: str) -> tuple[bool, str | None]:
    """(exists, why the role cannot be restricted or None)."""
    cur.execute(
        """
        SELECT r.rolsuper, r.rolbypassrls,
               EXISTS (SELECT 1 FROM pg_namespace n WHERE n.nspname = 'lr' AND pg_has_role(r.oid, n.nspowner, 'USAGE'))
               OR EXISTS (SELECT 1 FROM pg_class c WHERE c.relnamespace = 'lr'::regnamespace
                          AND pg_has_role(r.oid, c.relowner, 'USAGE'))
        FROM pg_roles r WHERE r.rolname = %s
        """,
        (role,),
    )
    row = cur.fetchone()
    if row is None:
        return False, None
    superuser, bypassrls, owner = row
    if superuser:
        return True, "is a superuser"
    if owner:
        return True, "owns the lr schema or its tables (or is a member of their owner)"
    if bypassrls:
        return True, "has BYPASSRLS"
    return True, None


# --- plans --------------------------------------------------------------------------------------
def _role_oid(role: str) -> sql.Composable:
    return sql.SQL("(SELECT oid FROM pg_roles WHERE rolname = {})").format(sql.Literal(role))


# lr's SECURITY DEFINER functions run as the owner. The trigger functions take what they write from the
# trigger's arguments (a federated table's capture: its client and table_id). PostgreSQL lets every role
# EXECUTE a new function, so a role with USAGE on lr could attach one to a table of its own (a temporary
# one will do) and write as the owner: a writer of one client forging another client's table changes.
# Only the owner attaches them (``lr tables open``, the migrations), and a trigger fires without
# EXECUTE. The others read a source's state for a writer's waits, for any client named (another
# client's sinks not holding its tables, its failover notes, any transaction's commit position). So
# EXECUTE on every one is taken from PUBLIC before any role gets USAGE on lr, and the kinds that wait
# on deliveries (writer, replicator) are given the reads back (``_DEFINER_READS``).
_OWNERS_DEFINERS_ONLY = Statement(
    sql.SQL(
        "DO $$ DECLARE f regprocedure; BEGIN FOR f IN SELECT oid FROM pg_catalog.pg_proc "
        "WHERE pronamespace = 'lr'::regnamespace AND prosecdef LOOP "
        "EXECUTE pg_catalog.format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f); END LOOP; END $$"
    )
)
_DEFINER_KINDS = ("writer", "replicator")


def _definer_reads(role: str) -> list[Statement]:
    """EXECUTE on lr's SECURITY DEFINER functions that are not triggers, for ``role``: whatever the
    schema's version has (the role's name passes through a setting, never into the block's text)."""
    return [
        Statement(sql.SQL("SELECT pg_catalog.set_config('lr.grantee', {}, true)").format(sql.Literal(role))),
        Statement(
            sql.SQL(
                "DO $$ DECLARE f regprocedure; BEGIN FOR f IN SELECT oid FROM pg_catalog.pg_proc "
                "WHERE pronamespace = 'lr'::regnamespace AND prosecdef AND prorettype <> 'trigger'::regtype LOOP "
                "EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION %s TO %I', f, "
                "pg_catalog.current_setting('lr.grantee')); END LOOP; END $$"
            )
        ),
    ]


def grant_statements(kind: str, role: str, clients: Sequence[str]) -> list[Statement]:
    """The GRANTs a kind needs and the ``lr.role_grants`` rows (idempotent: granting twice is a no-op)."""
    who = sql.Identifier(role)
    out = [_OWNERS_DEFINERS_ONLY, Statement(sql.SQL("GRANT USAGE ON SCHEMA lr TO {}").format(who))]
    if kind in _DEFINER_KINDS:
        out += _definer_reads(role)
    for p in (*COMMON, *PRIVILEGES[kind]):
        objects = sql.SQL(", ").join(sql.Identifier("lr", name) for name in p.objects)
        target = sql.SQL("SEQUENCE ") if p.kind == "SEQUENCE" else sql.SQL("TABLE ")
        out.append(Statement(sql.SQL("GRANT {} ON {}{} TO {}").format(sql.SQL(p.privileges), target, objects, who)))
    for client in clients:
        out.append(
            Statement(
                sql.SQL(
                    "INSERT INTO lr.role_grants (role_oid, role_name, kind, client_name) "
                    "SELECT oid, rolname, {}, {} FROM pg_roles WHERE rolname = {} ON CONFLICT DO NOTHING"
                ).format(sql.Literal(kind), sql.Literal(client), sql.Literal(role))
            )
        )
    return out


def _reset_statements(role: str) -> list[Statement]:
    who = sql.Identifier(role)
    return [
        Statement(sql.SQL("REVOKE ALL ON ALL TABLES IN SCHEMA lr FROM {}").format(who)),  # column privileges too
        Statement(sql.SQL("REVOKE ALL ON ALL SEQUENCES IN SCHEMA lr FROM {}").format(who)),
        Statement(sql.SQL("REVOKE ALL ON ALL FUNCTIONS IN SCHEMA lr FROM {}").format(who)),
        Statement(sql.SQL("REVOKE ALL ON SCHEMA lr FROM {}").format(who)),
    ]


def _create_statement(conn: psycopg2.extensions.connection, role: str, password: str | None) -> Statement:
    """``CREATE ROLE ... LOGIN``, with the password's verifier, never the password: the server writes a
    failing statement's text to its log (``log_min_error_statement``), and ``log_statement`` logs every
    DDL. The verifier is computed here, by libpq, with the server's ``password_encryption`` (as psql's
    ``\\password`` does); the server stores a verifier as given."""
    query = sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role))
    if password is None:
        return Statement(query)
    if not password:
        raise ConfigurationError(
            f"the password given for role {role!r} is empty (PostgreSQL would make the role without one): set the "
            "variable to the password, or pass --no-password for a role that logs in without one"
        )
    verifier = psycopg2.extensions.encrypt_password(password, role, conn)
    return Statement(query + sql.SQL(" PASSWORD {}").format(sql.Literal(verifier)), query + sql.SQL(" PASSWORD '***'"))


def _current(cur: psycopg2.extensions.cursor, role: str) -> list[tuple[str, str]]:
    """(kind, client) recorded for ``role`` on this site."""
    cur.execute(
        "SELECT g.kind, g.client_name FROM lr.role_grants g JOIN pg_roles r ON r.oid = g.role_oid "
        "WHERE r.rolname = %s ORDER BY 1, 2",
        (role,),
    )
    return [(k, c) for k, c in cur.fetchall()]


def plan_grant(
    conn: psycopg2.extensions.connection,
    kind: str,
    role: str,
    clients: Sequence[str] = (),
    create: bool = False,
    password: str | None = None,
) -> list[Statement]:
    """What ``grant`` would run on this site now (reads only; ends its transaction). A writer's or
    consumer's clients must be ones the topology applied to the site makes it the source, or a
    sink, of: a grant for a misspelt client would succeed and leave the application refused."""
    clients = check_request(kind, role, clients)
    _require_roles_schema(conn)
    try:
        with conn.cursor() as cur:
            if kind != "replicator":
                _require_clients_here(cur, kind, clients)
            exists, refused = _role_state(cur, role)
    finally:
        conn.rollback()
    if refused:
        raise ConfigurationError(
            f"role {role!r} {refused}: row-level security does not apply to it, so it cannot be limited to a "
            f"{kind}'s rights on site {_where(conn)}; create a role of its own for the {kind}"
        )
    if not exists and not create:
        raise ConfigurationError(
            f"role {role!r} does not exist on site {_where(conn)}: create it (CREATE ROLE ... LOGIN PASSWORD ...) "
            "or pass --create --password-env VAR"
        )
    plan = [] if exists else [_create_statement(conn, role, password)]
    return plan + grant_statements(kind, role, clients)


def plan_revoke(
    conn: psycopg2.extensions.connection, kind: str, role: str, clients: Sequence[str] = ()
) -> list[Statement]:
    """What ``revoke`` would run: the rows deleted, the role's privileges on the schema reset, and
    the grants of what it still holds (another kind, other clients) given again."""
    clients = check_request(kind, role, clients)
    _require_roles_schema(conn)
    try:
        with conn.cursor() as cur:
            exists, _ = _role_state(cur, role)
            held = _current(cur, role) if exists else []
    finally:
        conn.rollback()
    if not exists:
        raise ConfigurationError(f"role {role!r} does not exist on site {_where(conn)}")
    absent = [c for c in clients if (kind, c) not in held]
    if absent:
        holds = ", ".join(f"{k} of {c}" if c else k for k, c in held) or "no grant"
        what = kind if clients == [""] else f"{kind} of {listing(absent)}"
        raise ConfigurationError(
            f"role {role!r} holds no {what} on site {_where(conn)} (it holds: {holds}); nothing was revoked"
        )
    plan = [
        Statement(
            sql.SQL("DELETE FROM lr.role_grants WHERE role_oid = {} AND kind = {} AND client_name = ANY ({})").format(
                _role_oid(role), sql.Literal(kind), sql.Literal(list(clients))
            )
        )
    ]
    plan += _reset_statements(role)
    remaining = [(k, c) for k, c in held if not (k == kind and c in clients)]
    for other in KINDS:
        theirs = [c for k, c in remaining if k == other]
        if theirs:
            plan += grant_statements(other, role, theirs)
    return plan


def run(conn: psycopg2.extensions.connection, plan: Iterable[Statement]) -> None:
    """Execute a plan in one transaction (all or nothing); commits. Role changes on a site take
    turns with each other and with ``lr init`` (its advisory lock): two GRANTs of the same table
    at once, as two ``lr roles grant`` or a grant beside ``lr init``'s reapply, failed the second
    in the server's words ('tuple concurrently updated')."""
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK_KEY,))
            for statement in plan:
                cur.execute(statement.query)
        conn.commit()
    except psycopg2.errors.InsufficientPrivilege as exc:
        conn.rollback()
        user = conn.get_dsn_parameters().get("user", "?")
        raise ConfigurationError(
            f"role {user!r} may not change roles on site {_where(conn)} ({one_line(exc)}); run `lr roles` as the "
            "owner of the lr schema (creating a role also needs CREATEROLE)"
        ) from exc
    except BaseException:
        conn.rollback()
        raise


def render(conn: psycopg2.extensions.connection, plan: Iterable[Statement]) -> list[str]:
    """The plan as SQL text, passwords masked."""
    return [(s.shown or s.query).as_string(conn) + ";" for s in plan]


@on_callers_connection
def grant(
    conn: psycopg2.extensions.connection,
    kind: str,
    role: str,
    clients: Sequence[str] = (),
    create: bool = False,
    password: str | None = None,
) -> list[str]:
    """Give ``role`` the rights of ``kind`` (for ``clients``) on this site; returns the SQL run."""
    plan = plan_grant(conn, kind, role, clients, create, password)
    run(conn, plan)
    return render(conn, plan)


@on_callers_connection
def revoke(conn: psycopg2.extensions.connection, kind: str, role: str, clients: Sequence[str] = ()) -> list[str]:
    """Take the rights of ``kind`` (for ``clients``) from ``role`` on this site; returns the SQL run."""
    plan = plan_revoke(conn, kind, role, clients)
    run(conn, plan)
    return render(conn, plan)


@on_callers_connection
def reapply(conn: psycopg2.extensions.connection) -> list[str]:
    """Grant every recorded role again what its kinds need now: after an upgrade whose migrations
    added tables or columns a kind uses (``lr init`` calls it). Returns the roles refreshed."""
    if _version(conn) < ROLES_SCHEMA_VERSION:
        return []
    with conn.cursor() as cur:
        cur.execute(
            "SELECT r.rolname, g.kind, g.client_name FROM lr.role_grants g JOIN pg_roles r ON r.oid = g.role_oid "
            "ORDER BY 1, 2, 3"
        )
        rows = cur.fetchall()
    conn.rollback()
    plan: list[Statement] = []
    for role in sorted({r for r, _, _ in rows}):
        for kind in KINDS:
            clients = [c for r, k, c in rows if r == role and k == kind]
            if clients:
                plan += grant_statements(kind, role, clients)
    if plan:
        run(conn, plan)
    return sorted({r for r, _, _ in rows})


@on_callers_connection
def list_grants(conn: psycopg2.extensions.connection) -> list[RoleGrant]:
    """Every grant recorded on this site (as the owner sees them; another role sees its own)."""
    _require_roles_schema(conn)
    with conn.cursor() as cur:
        cur.execute(
            "SELECT coalesce(r.rolname, g.role_name), g.kind, g.client_name, g.granted_at, r.oid IS NOT NULL "
            "FROM lr.role_grants g LEFT JOIN pg_roles r ON r.oid = g.role_oid ORDER BY 1, 2, 3"
        )
        rows = [RoleGrant(*row) for row in cur.fetchall()]
    conn.rollback()
    return rows


def _version(conn: psycopg2.extensions.connection) -> int:
    from airflow_provider_lr.engine.db.schema import current_version

    version = current_version(conn)
    conn.rollback()
    return version


def _where(conn: psycopg2.extensions.connection) -> str:
    params = conn.get_dsn_parameters()
    return f"{params.get('host', '?')}:{params.get('port', '?')}/{params.get('dbname', '?')}"
