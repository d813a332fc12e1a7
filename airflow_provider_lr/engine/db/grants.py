"""What lr's grants let the role of a connection do (docs/security.md), read as row-level security
reads it, so that a role shown none of a client's rows is told which grant it lacks instead of
getting a policy violation (a transmit) or no rows at all, for ever (a subscriber).

On an application's connection, with its search_path: every function and operator is named with its
schema (docs/security.md)."""

from __future__ import annotations

from dataclasses import dataclass

import psycopg2.extensions

# lr's schema, the table and lr.role_grants readable by the caller: else the site's own refusal comes
# later (no lr, a schema too old, no USAGE), and there is nothing to say here
_READABLE = (
    "SELECT pg_catalog.has_schema_privilege(n.oid, 'USAGE') AND pg_catalog.to_regclass(%s) IS NOT NULL "
    "AND pg_catalog.has_table_privilege(pg_catalog.to_regclass('lr.role_grants'), 'SELECT') "
    "FROM pg_catalog.pg_namespace n WHERE n.nspname OPERATOR(pg_catalog.=) 'lr'"
)
# The owner of the table and a role that bypasses row-level security see every row; any other the rows
# its grants give it (lr.role_grants shows a role its own grants, and those of the roles it inherits)
_HELD = """
SELECT current_user::pg_catalog.text,
       pg_catalog.pg_has_role(c.relowner, 'USAGE') OR r.rolsuper OR r.rolbypassrls
       OR EXISTS (SELECT FROM lr.role_grants g WHERE g.kind OPERATOR(pg_catalog.=) ANY (%s::pg_catalog.text[])
                  AND (g.kind OPERATOR(pg_catalog.=) 'replicator' OR g.client_name OPERATOR(pg_catalog.=) %s)),
       (SELECT pg_catalog.string_agg(CASE WHEN g.client_name OPERATOR(pg_catalog.=) '' THEN g.kind
                                          ELSE pg_catalog.concat(g.kind, ' of ', g.client_name) END,
                                     ', ' ORDER BY g.kind, g.client_name) FROM lr.role_grants g)
FROM pg_catalog.pg_class c, pg_catalog.pg_roles r
WHERE c.oid OPERATOR(pg_catalog.=) pg_catalog.to_regclass(%s) AND r.rolname OPERATOR(pg_catalog.=) current_user
"""


@dataclass(frozen=True)
class Held:
    role: str  # current_user
    may: bool  # one of the kinds asked for covers the client (or the role sees every row)
    grants: str  # what it holds, for a message ('consumer of alpha, writer of beta'), or ''

    def refusal(self, doing: str, kind: str, client: str, where: str, outcome: str) -> str:
        """'role ... may not <doing> on site <where> (it holds ...)<outcome>; the owner grants it: ...'."""
        return (
            f"role {self.role!r} may not {doing} on site {where} (it holds {self.grants or 'no grant of lr'} there)"
            f"{outcome}; "
            f"the owner of the lr schema grants it: lr roles grant {kind} --client {client} --role {self.role} "
            "--site <this site> (docs/security.md)"
        )


def held(
    conn: psycopg2.extensions.connection, table: str, kinds: tuple[str, ...], client: str, guarded: bool = True
) -> Held | None:
    """Whether the connection's role may see ``client``'s rows of ``table`` (``lr.receive_queue``) through
    one of ``kinds``; None where that cannot be read (no lr, no grants table, no USAGE). ``guarded=False``:
    the caller knows the site's schema holds both and the role reads them (one round trip, not two).
    Reads only; ends the transaction it began (none on an autocommit connection or one already in a
    transaction)."""
    idle = not conn.autocommit and conn.info.transaction_status == psycopg2.extensions.TRANSACTION_STATUS_IDLE
    try:
        with conn.cursor() as cur:
            if guarded:
                cur.execute(_READABLE, (table,))
                readable = cur.fetchone()
                if not readable or not readable[0]:
                    return None
            cur.execute(_HELD, (list(kinds), client, table))
            role, may, grants = cur.fetchone()
    finally:
        if idle:
            conn.rollback()
    return Held(role, bool(may), grants or "")
