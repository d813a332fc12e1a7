"""The public engine functions an application may call on a connection of its own (not one lr
opened): whatever that connection's search_path puts before pg_catalog, lr's statements there call
PostgreSQL's built-ins, the caller's path is set back after, a connection in autocommit mode gets
whole transactions, and a failed or closed one is refused at once (``local_settings.catalog_path``)."""

from __future__ import annotations

import psycopg2
import psycopg2.extensions
import pytest

from airflow_provider_lr.client import LRMessageWithDestinations, RoutingQueueClient
from airflow_provider_lr.engine.db import schema
from airflow_provider_lr.engine.errors import ConfigurationError, TransmitError
from airflow_provider_lr.engine.site import roles, status, topology
from airflow_provider_lr.engine.source import full_sync, trim
from airflow_provider_lr.engine.tables import registry
from tests.guarantees.test_table_fidelity_streaming import lookalikes
from tests.support.session import apply, queue, replicator
from tests.support.tables import sync

PATH = "lookalike,pg_catalog,public"
# same-type operators the statements of these functions name, besides the shared list's
EXTRA = (
    ("<=", "bigint", "bigint"),
    ("<=", "bigint", "integer"),
    ("=", "uuid", "uuid"),
    ("<", "timestamptz", "timestamptz"),
)


def _plant(site) -> None:
    made = [lookalikes("lookalike", same=True)]
    for n, (op, left, right) in enumerate(EXTRA):
        made.append(
            f"CREATE FUNCTION lookalike.extra{n}({left}, {right}) RETURNS boolean LANGUAGE plpgsql "
            f"AS $$ BEGIN RAISE EXCEPTION 'lookalike operator {op}({left}, {right}) called'; END $$; "
            f"CREATE OPERATOR lookalike.{op} (LEFTARG = {left}, RIGHTARG = {right}, FUNCTION = lookalike.extra{n})"
        )
    site.query("; ".join(made))


def _callers(site) -> psycopg2.extensions.connection:
    return psycopg2.connect(site.dsn, options=f"-c search_path={PATH}")


def _path(conn: psycopg2.extensions.connection) -> str:
    with conn.cursor() as cur:
        cur.execute("SHOW search_path")
        found = cur.fetchone()[0]
    conn.rollback()
    return found


def test_every_public_engine_function_on_a_callers_connection_calls_no_lookalike_and_sets_its_path_back(lr_sites):
    """Before, only ``request_full_sync``, ``open_table`` and ``site_status`` were guarded: the other
    full-sync calls (``sessions_requested``, ``open_request``, ``outcome``...), the trims (whose
    ``<=`` of positions decides what is deleted), the tables' listings, a topology's apply, ``lr
    init``'s ``init_site`` and the roles' grants called the caller's ``lookalike`` operators."""
    source = lr_sites[0]
    topo = apply(lr_sites)
    RoutingQueueClient(conn := source.connect(), "policy").transmit_log_entry_message(b"x", ["site-b"])
    conn.commit()
    conn.close()
    _plant(source)
    writer = f"lrt_{source.dbname}_writer"
    source.query(f'CREATE ROLE "{writer}" LOGIN')
    conn = _callers(source)
    try:
        request = full_sync.request_full_sync(conn, "site-b", "policy", "asked by the application")
        calls = {
            "open_request": lambda: full_sync.open_request(conn, "site-b", "policy"),
            "sessions_requested": lambda: full_sync.sessions_requested(conn, forced_only=False),
            "get_request": lambda: full_sync.get_request(conn, request.request_id),
            "outcome": lambda: full_sync.outcome(conn, request.request_id),
            "finish_request": lambda: full_sync.finish_request(conn, request.request_id, "cancelled", "test"),
            "trim_mark": lambda: trim.trim_mark(conn),
            "safe_trim": lambda: trim.safe_trim(conn),
            "retention_trim": lambda: trim.retention_trim(conn, 3600),
            "trim": lambda: trim.trim(conn, 0),
            "list_tables": lambda: registry.list_tables(conn),
            "list_copies": lambda: registry.list_copies(conn),
            "site_status": lambda: status.site_status(conn),
            "apply_to_site": lambda: topology.apply_to_site(conn, topo, "site-a"),
            "init_site": lambda: schema.init_site(conn, "site-a"),
            "grant": lambda: roles.grant(conn, "writer", writer, ["policy"]),
            "list_grants": lambda: roles.list_grants(conn),
            "revoke": lambda: roles.revoke(conn, "writer", writer, ["policy"]),
        }
        failed = {}
        for name, call in calls.items():
            try:
                call()
            except psycopg2.Error as exc:
                conn.rollback()
                failed[name] = str(exc).splitlines()[0]
            assert _path(conn) == PATH, name
        assert failed == {}
        assert full_sync.sessions_requested(conn, forced_only=False) == set()  # finish_request closed it
        assert conn.info.transaction_status == psycopg2.extensions.TRANSACTION_STATUS_IDLE
    finally:
        conn.close()


def test_a_full_sync_request_on_an_autocommit_connection_is_one_transaction_and_autocommit_stays(lr_sites):
    """A new request cancels the session's open one and records itself, all or nothing. On a
    connection in autocommit mode each statement committed on its own: a request whose insert failed
    had cancelled its predecessor anyway (the session left with no open request), and its
    ``search_path = pg_catalog`` local to a transaction lasted one statement."""
    source = lr_sites[0]
    apply(lr_sites)
    conn = _callers(source)
    conn.autocommit = True
    try:
        first = full_sync.request_full_sync(conn, "site-b", "policy", "first")
        source.query(  # the request's insert fails after the cancel of its predecessor
            "CREATE FUNCTION public.refuse_second() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN IF NEW.reason = 'second' THEN RAISE EXCEPTION 'refused for the test'; END IF; RETURN NEW; END $$"
        )
        source.query(
            "CREATE TRIGGER refuse_second BEFORE INSERT ON lr.full_sync_requests "
            "FOR EACH ROW EXECUTE FUNCTION public.refuse_second()"
        )
        with pytest.raises(psycopg2.Error, match="refused for the test"):
            full_sync.request_full_sync(conn, "site-b", "policy", "second")
        source.query("DROP TRIGGER refuse_second ON lr.full_sync_requests")
        assert conn.autocommit is True and _path(conn) == PATH
        still = full_sync.open_request(conn, "site-b", "policy")
        assert still is not None and still.request_id == first.request_id
        _plant(source)
        second = full_sync.request_full_sync(conn, "site-b", "policy", "second")
        assert full_sync.get_request(conn, first.request_id).status == "cancelled"
        assert full_sync.open_request(conn, "site-b", "policy").request_id == second.request_id
    finally:
        conn.close()


def test_a_failed_or_closed_connection_is_refused_at_once_naming_the_call(lr_sites):
    """Before: PostgreSQL's "current transaction is aborted, commands ignored until end of
    transaction block" or psycopg2's "connection already closed", from whichever statement came first."""
    source = lr_sites[0]
    apply(lr_sites)
    conn = source.connect()
    client = RoutingQueueClient(conn, "policy")
    with conn.cursor() as cur, pytest.raises(psycopg2.Error):
        cur.execute("SELECT 1 / 0")
    with pytest.raises(ConfigurationError, match="request_full_sync: the connection's transaction has already failed"):
        full_sync.request_full_sync(conn, "site-b", "policy", "why")
    with pytest.raises(TransmitError, match="transaction has already failed .*: roll it back"):
        client.transmit_log_entry_message(b"lost?", ["site-b"])
    with pytest.raises(TransmitError, match="transaction has already failed"):
        RoutingQueueClient(conn, "policy")
    conn.rollback()
    assert full_sync.sessions_requested(conn) == set()  # nothing was done
    conn.close()
    with pytest.raises(ConfigurationError, match="trim_mark: the connection is closed"):
        trim.trim_mark(conn)
    with pytest.raises(TransmitError, match="connection is closed"):
        client.transmit_log_entry_messages([LRMessageWithDestinations(b"lost?", ["site-b"])])


def test_a_client_on_an_autocommit_connection_supplies_full_syncs_the_sinks_apply(lr_sites):
    """A full sync's supply is one transaction: its markers, the provider's messages and the request
    marked supplied with that transaction's id. On a connection in autocommit mode each statement
    was a transaction of its own: the request named the transaction of its UPDATE, no sink found
    data there, every apply failed and each new supply failed the same way, for good. Now the supply
    takes the connection out of autocommit mode meanwhile (and sets it back): the sinks apply it."""
    source, sink_b, sink_c = lr_sites
    topo = apply(lr_sites)
    repl = replicator(topo, lr_sites)
    sync(repl, cycles=2)  # each session asks its client for a full sync
    conn = _callers(source)
    conn.autocommit = True
    try:
        served = RoutingQueueClient(conn, "policy").serve_full_sync_requests(lambda ctx: ctx.transmit(b"state"))
        assert len(served) == 2 and conn.autocommit is True and _path(conn) == PATH
    finally:
        conn.close()
    sync(repl)
    for sink in (sink_b, sink_c):
        assert queue(sink) == [("start", ""), ("snap", "state"), ("end", "")], sink.site_id


def test_many_messages_transmitted_on_an_autocommit_connection_are_one_transaction_the_ticket_names(lr_sites):
    """On a connection in autocommit mode, 2,500 messages (three statements of 1,000 rows) were
    three transactions: the ticket named the last only, and a failure in a later statement kept
    the earlier ones. Now they are one, as on any other connection."""
    source = lr_sites[0]
    apply(lr_sites)
    conn = source.connect()
    conn.autocommit = True
    try:
        many = [LRMessageWithDestinations(b"m%d" % i, ["site-b"]) for i in range(2500)]
        ticket = RoutingQueueClient(conn, "policy").transmit_log_entry_messages(many)
        assert conn.autocommit is True
    finally:
        conn.close()
    assert source.query("SELECT count(*), array_agg(DISTINCT tx::text) FROM lr.log_entries") == [
        (2500, [str(ticket.tx)])
    ]
