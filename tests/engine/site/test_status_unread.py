"""What ``lr status --json`` and ``lr metrics`` say of a part they did not read, or that does not apply."""

from __future__ import annotations

from airflow_provider_lr.engine.site import metrics, status, status_parts
from tests.support.session import apply, replicator
from tests.support.tables import site_status, sync


def test_status_json_gives_null_for_the_parts_it_did_not_read_and_metrics_no_held_back_of_a_sink_only_site(
    lr_sites, monkeypatch
):
    """The source's sessions and members locked by another session (VACUUM FULL, an admin's LOCK):
    ``--json`` gave ``[]`` for its sessions, members and what holds its log back (and ``{}`` for
    its durable position), "none" to a script, though ``unread`` said they were not read; the
    trim mark, not read, was already null. Now every part not read is null, the rest as read. A
    sink-only site has no log to hold back: ``lr metrics`` exported ``lr_log_held_back 0`` for it."""
    source, sink, _ = lr_sites
    topo = apply(lr_sites)
    sync(replicator(topo, lr_sites))
    found = {s.site_id: site_status(s) for s in lr_sites}
    out = metrics.exposition(metrics.status_registry(lambda: found))
    assert 'lr_log_held_back{site="site-a"} 0.0' in out, out
    assert 'lr_log_held_back{site="site-b"}' not in out and 'lr_log_held_back{site="site-c"}' not in out, out
    said = status.sites_as_dict(found)["sites"]
    assert said["site-a"]["held_back_by"] == [] and said["site-b"]["members"] == [], said  # read: none

    monkeypatch.setattr(status_parts, "STATUS_LOCK_WAIT", "200ms")
    admin = source.connect()
    try:
        with admin.cursor() as cur:
            cur.execute("LOCK TABLE lr.replication_status, lr.replicator_members IN ACCESS EXCLUSIVE MODE")
        conn = source.connect()
        locked = status.site_status(conn, source.site_id)  # as `lr status` reads it (its site named)
        conn.close()
    finally:
        admin.rollback()
        admin.close()
    said = status.sites_as_dict({"site-a": locked, "site-b": found["site-b"]})["sites"]
    assert [line.split(status_parts.NOT_READ)[0] for line in said["site-a"]["unread"]] == [
        "sessions",
        "members",
        status_parts.DIVERGED,
    ]
    for part in ("sessions", "members", "held_back_by", "durable", "receive_queues", "diverged"):
        assert said["site-a"][part] is None, (part, said["site-a"])
    assert said["site-a"]["trim_mark"] is not None and said["site-a"]["tables"] == [], said["site-a"]
    assert said["site-b"]["unread"] == [] and len(said["site-b"]["sessions"]) == 1, said["site-b"]


def test_status_says_no_refused_writes_for_a_read_only_login_set_on_the_role_in_this_database(lr_sites):
    """A read-only monitoring login made so for this database alone (``ALTER ROLE ... IN DATABASE ...
    SET default_transaction_read_only``: that login's own, as ``ALTER ROLE ... SET`` is) runs
    ``lr status``: the site takes lr's writes, so status says nothing of refused writes. Before, that
    setting (source ``database user``) was read as the server's or the database's: "refuses writes",
    degraded, while every session ran."""
    from psycopg2 import sql

    from tests.engine.site.test_roles import Roles, connect_as

    source = lr_sites[0]
    roles = Roles(lr_sites)
    monitor = roles.name("monitor")
    roles.grant(source, "replicator", monitor)
    try:
        admin = source.connect()
        admin.autocommit = True
        with admin.cursor() as cur:
            cur.execute(
                sql.SQL("ALTER ROLE {} IN DATABASE {} SET default_transaction_read_only = on").format(
                    sql.Identifier(monitor), sql.Identifier(source.dbname)
                )
            )
        admin.close()
        conn = connect_as(source, monitor)
        try:
            with conn.cursor() as cur:  # the login's own setting is in force for it
                cur.execute("SHOW default_transaction_read_only")
                assert cur.fetchone()[0] == "on"
                assert status_parts.refuses_writes(cur) is None
        finally:
            conn.close()
        admin = source.connect()  # the owner's login, on the same database: writes taken
        try:
            with admin.cursor() as cur:
                cur.execute("SHOW default_transaction_read_only")
                assert cur.fetchone()[0] == "off"
        finally:
            admin.close()
    finally:
        roles.drop()  # its settings go with the role
