"""A grant counts for a login that can act with it: one whose privileges it inherits, or one it may
SET ROLE to, as the row-level security policies count it. On PostgreSQL 16 and later a membership may
carry neither (``WITH INHERIT FALSE, SET FALSE``: what a CREATEROLE role that is not a superuser holds
in every role it creates). lr's reads for a writer's waits (``lr.commit_position_of``,
``lr.sinks_lacking_tables``, ``lr.unreplicated_note``, SECURITY DEFINER) counted any membership:
a writer of alpha holding such a membership in a writer of beta, refused every row of beta by the
policies, read which of beta's transactions wrote to the log, and their order (V0047)."""

from __future__ import annotations

import psycopg2.errors
import pytest

from airflow_provider_lr.client import RoutingQueueClient
from tests.engine.site.test_roles import connect_as, made  # noqa: F401 (fixture)
from tests.support.session import apply

DENIED = psycopg2.errors.InsufficientPrivilege


def test_a_membership_that_can_neither_inherit_nor_set_role_reads_nothing_of_that_client(lr_sites, made):
    source = lr_sites[0]
    if int(source.query("SHOW server_version_num")[0][0]) < 160000:
        pytest.skip("memberships without INHERIT and SET are PostgreSQL 16's")
    apply(lr_sites, [{"source": "site-a", "sinks": ["site-b"], "clients": ["alpha", "beta"]}])
    beta, admin, setter = made.name("w_beta"), made.name("w_alpha_admin"), made.name("w_alpha_set")
    made.grant(source, "writer", beta, ["beta"])
    for login in (admin, setter):
        made.grant(source, "writer", login, ["alpha"])
    source.query(f'GRANT "{beta}" TO "{admin}" WITH INHERIT FALSE, SET FALSE, ADMIN TRUE')
    source.query(f'GRANT "{beta}" TO "{setter}" WITH INHERIT FALSE, SET TRUE')
    conn = connect_as(source, beta)
    ticket = RoutingQueueClient(conn, "beta").transmit_log_entry_message(b"b", ["site-b"])
    conn.commit()
    conn.close()
    position_of = "SELECT lr.commit_position_of(%s::text::xid8)"

    conn = connect_as(source, admin)  # may administer beta's writer, not act as it
    with conn.cursor() as cur:
        with pytest.raises(DENIED, match="row-level security"):  # the policies: not beta's writer
            cur.execute(
                "INSERT INTO lr.log_entries (stream, tag_ids, client_id, message) "
                "SELECT 1, '{1}', client_id, '\\x00' FROM lr.clients WHERE client_name = 'beta'"
            )
        conn.rollback()
        cur.execute(position_of, (str(ticket.tx),))
        assert cur.fetchone() == (None,)  # before: beta's commit position
        for call in ("lr.sinks_lacking_tables('beta', NULL)", "lr.unreplicated_note('beta', 1)"):
            try:
                with pytest.raises(DENIED, match="may not read .* of client beta"):
                    cur.execute(f"SELECT {call}")
            finally:
                conn.rollback()
        cur.execute("SELECT lr.sinks_lacking_tables('alpha', NULL)")  # its own client's, as before
    conn.close()

    conn = connect_as(source, setter)  # may SET ROLE to beta's writer: it reads what beta's writer does
    with conn.cursor() as cur:
        cur.execute(position_of, (str(ticket.tx),))
        assert cur.fetchone()[0] is not None
        cur.execute("SELECT lr.unreplicated_note('beta', 1)")
    conn.close()
