"""Least-privilege roles (docs/security.md), enforced by the database: every scenario here runs
UNDER the roles `lr roles grant` makes, against real servers.

* a writer of client alpha transmits as alpha only, cannot touch commit positions or the trim mark,
  and cannot read the shared log;
* a consumer of alpha reads and acknowledges alpha's receive queues only (and its dead letters),
  and RoutingQueueSubscriber works for alpha with only that role;
* a replicator runs full replication cycles, full syncs (its providers or a writer's), the
  in-process fan-out (COPY under row-level security) and the trim;
* `lr init` on an installed site needs no CREATE on the database.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import psycopg2
import psycopg2.errors
import pytest
from psycopg2.extras import execute_values

from airflow_provider_lr import cli
from airflow_provider_lr.client import LRMessageWithDestinations, RoutingQueueClient
from airflow_provider_lr.engine.db import schema
from airflow_provider_lr.engine.db.conninfo import ConnInfo
from airflow_provider_lr.engine.errors import (
    ConfigurationError,
    DeliveryTimeout,
    SchemaError,
    TableError,
    TransmitError,
)
from airflow_provider_lr.engine.sink import receive
from airflow_provider_lr.engine.site import roles, status, topology
from airflow_provider_lr.engine.source import full_sync, trim
from airflow_provider_lr.engine.store import topology as topologies
from airflow_provider_lr.engine.tables import registry
from airflow_provider_lr.proto import lr_pb2
from airflow_provider_lr.subscriber import RoutingQueueSubscriber
from tests.support.session import Streaming, apply, queue, replicator, wait_for
from tests.support.tables import federate

DENIED = psycopg2.errors.InsufficientPrivilege  # privileges and row-level security violations alike
_names = itertools.count(1)


# --- roles on the test servers --------------------------------------------------------------
class Roles:
    """Creates uniquely named login roles on the test servers (roles are per server, not per
    database) and drops them afterwards."""

    def __init__(self, sites) -> None:
        self.sites = sites
        self.made: list[str] = []

    def name(self, what: str) -> str:
        role = f"lrt_{os.getpid()}_{next(_names)}_{what}"
        self.made.append(role)
        return role

    def grant(self, site, kind: str, role: str, clients=(), create: bool = True) -> None:
        conn = site.connect()
        try:
            roles.grant(conn, kind, role, clients, create=create)
        finally:
            conn.close()

    def drop(self) -> None:
        for site in self.sites:
            conn = site.connect()
            conn.autocommit = True
            with conn.cursor() as cur:
                for role in self.made:
                    cur.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,))
                    if cur.fetchone():
                        # CASCADE: what depends on the role's objects without an owner of its own (a cast)
                        cur.execute(psycopg2.sql.SQL("DROP OWNED BY {} CASCADE").format(psycopg2.sql.Identifier(role)))
                        cur.execute(psycopg2.sql.SQL("DROP ROLE {}").format(psycopg2.sql.Identifier(role)))
            conn.close()


@pytest.fixture
def made(sites):
    found = Roles(sites)
    yield found
    found.drop()


def info_as(site, role: str) -> ConnInfo:
    """The site's test database as ``role`` (embedded sites trust loopback connections)."""
    base = site.conninfo
    return ConnInfo({**base.params, "user": role}, site_id=site.site_id, region=site.region)


def connect_as(site, role: str):
    return psycopg2.connect(info_as(site, role).dsn)


def sites_as(lr_sites, role: str) -> list[SimpleNamespace]:
    """What tests.support.session.replicator needs of each site, connecting as ``role``."""
    return [SimpleNamespace(site_id=s.site_id, dsn=info_as(s, role).dsn) for s in lr_sites]


def run_until_idle(repl, cycles: int = 12):
    try:
        reports = repl.run(max_cycles=cycles, until_idle=True, interval=0.01)
    finally:
        repl.close()
    assert not any(r.error for r in reports), reports
    return reports


class Collect:
    """A listener that keeps what it was given."""

    def __init__(self) -> None:
        self.got: list[tuple[str, str, bytes]] = []

    def on_snapshot_sync_start(self, source):
        self.got.append((source, "start", b""))

    def on_snapshot_messages(self, source, payloads):
        self.got += [(source, "snap", p) for p in payloads]
        return True

    def on_snapshot_sync_complete(self, source):
        self.got.append((source, "end", b""))

    def on_log_entry_messages(self, source, payloads):
        self.got += [(source, "log", p) for p in payloads]
        return True

    def logs(self) -> list[bytes]:
        return [p for _, kind, p in self.got if kind == "log"]


CLIENTS = ["alpha", "beta"]


@pytest.fixture
def world(lr_sites, made):
    """site-a -> site-b, site-c for alpha and beta; a replicator on every site, writers of alpha
    and beta on the source, consumers of alpha and beta on site-b; an application table the
    writers change and the replicator's providers read; every session through its first full
    sync, run by the replicator role."""
    topo = apply(lr_sites, [{"source": "site-a", "sinks": ["site-b", "site-c"], "clients": CLIENTS}])
    source, sink = lr_sites[0], lr_sites[1]
    w = SimpleNamespace(topo=topo, source=source, sink=sink, sites=lr_sites)
    w.replicator = made.name("repl")
    for site in lr_sites:
        made.grant(site, "replicator", w.replicator)
    w.writer = {c: made.name(f"w_{c}") for c in CLIENTS}
    w.consumer = {c: made.name(f"c_{c}") for c in CLIENTS}
    for client in CLIENTS:
        made.grant(source, "writer", w.writer[client], [client])
        made.grant(sink, "consumer", w.consumer[client], [client])
    source.query("CREATE TABLE app_state (client text, k text, v bigint NOT NULL, PRIMARY KEY (client, k))")
    for writer in w.writer.values():
        source.query(f'GRANT SELECT, INSERT, UPDATE ON app_state TO "{writer}"')
    source.query(f'GRANT SELECT ON app_state TO "{w.replicator}"')  # its providers read the application's data
    run_until_idle(replicator(topo, sites_as(lr_sites, w.replicator), providers={c: provider(c) for c in CLIENTS}))
    return w


def provider(client: str):
    def supply(ctx) -> None:
        with ctx.conn.cursor() as cur:
            cur.execute("SELECT k, v FROM app_state WHERE client = %s ORDER BY k", (client,))
            for k, v in cur.fetchall():
                ctx.transmit(f"{k}={v}".encode())

    return supply


def put(conn, client: RoutingQueueClient, key: str, value: int, destinations=("site-b", "site-c")) -> None:
    """An application transaction: change a row and transmit the change."""
    with conn.cursor() as cur:
        cur.execute(
            "INSERT INTO app_state VALUES (%s, %s, %s) ON CONFLICT (client, k) DO UPDATE SET v = EXCLUDED.v",
            (client.client_name, key, value),
        )
    client.transmit_log_entry_message(f"{key}={value}".encode(), list(destinations))
    conn.commit()


# --- writer ---------------------------------------------------------------------------------
def test_writer_transmits_only_as_its_client(world):
    source = world.source
    conn = connect_as(source, world.writer["alpha"])
    alpha = RoutingQueueClient(conn, "alpha")
    put(conn, alpha, "k1", 1)
    alpha.transmit_log_entry_messages([LRMessageWithDestinations(f"m{i}".encode(), ["site-b"]) for i in range(5)])
    conn.commit()  # a multi-row insert passes the same check

    beta = RoutingQueueClient(conn, "beta")  # the client API as another client: refused, naming the grant
    with pytest.raises(TransmitError, match="may not transmit as client 'beta' .* holds writer of alpha"):
        beta.transmit_log_entry_message(b"forged", ["site-b"])
    conn.rollback()
    beta_id, alpha_id = (
        source.query("SELECT client_id FROM lr.clients WHERE client_name = %s", (c,))[0][0] for c in ("beta", "alpha")
    )
    with conn.cursor() as cur:
        with pytest.raises(DENIED, match="row-level security"):
            execute_values(
                cur,
                "INSERT INTO lr.log_entries (stream, tag_ids, client_id, message) VALUES %s",
                [(1, [1], alpha_id, b"ok"), (1, [1], beta_id, b"forged")],
            )
        conn.rollback()
        # tx and entry_id always take their defaults: no collision with another transaction's entry
        with pytest.raises(DENIED, match="permission denied"):
            cur.execute(
                "INSERT INTO lr.log_entries (tx, entry_id, stream, tag_ids, client_id, message) "
                "VALUES (pg_current_xact_id(), 1, 1, '{1}', %s, '\\x00')",
                (alpha_id,),
            )
        conn.rollback()
    conn.close()
    written = source.query(
        "SELECT e.client_id, count(*) FROM lr.log_entries e JOIN lr.log_commits c ON c.tx = e.tx "
        "WHERE e.stream = 1 GROUP BY 1"
    )
    assert written == [(alpha_id, 6)]  # committed, with commit positions drawn by the owner's trigger


def test_writer_cannot_forge_commit_positions_change_the_trim_or_read_the_log(world):
    source = world.source
    conn = connect_as(source, world.writer["alpha"])
    refused = [
        "INSERT INTO lr.log_commits (position, tx) VALUES ((SELECT last_value + 1 FROM lr.commit_position_seq), "
        "pg_current_xact_id())",
        "INSERT INTO lr.log_commits (position, tx) VALUES (1000000, '1')",
        "UPDATE lr.log_trim SET trim_mark = 1000000",
        "SELECT nextval('lr.commit_position_seq')",
        "SELECT setval('lr.commit_position_seq', 1000000)",
        "SELECT setval('lr.log_entry_id_seq', 1)",
        "SELECT count(*) FROM lr.log_entries",
        "SELECT count(*) FROM lr.log_commits",
        "SELECT count(*) FROM lr.shared_log",
        "DELETE FROM lr.log_entries",
        "UPDATE lr.source_sessions SET acked_position = 0",
        "INSERT INTO lr.clients (client_name) VALUES ('gamma')",
        "INSERT INTO lr.role_grants (role_oid, role_name, kind, client_name) "
        "SELECT oid, rolname, 'writer', 'beta' FROM pg_roles WHERE rolname = current_user",
        "SELECT count(*) FROM lr.receive_queue",
        # the owner's trigger functions on a table of its own: the capture wrote beta's table changes as the owner
        *(
            "CREATE TEMP TABLE forged (k int PRIMARY KEY); CREATE TRIGGER forge AFTER INSERT ON forged "
            f"REFERENCING NEW TABLE AS lr_new FOR EACH STATEMENT EXECUTE FUNCTION lr.{function}"
            for function in ("capture_table_changes('beta', '1')", "assign_commit_position()", "note_consumed()")
        ),
    ]
    for statement in refused:
        try:
            with conn.cursor() as cur, pytest.raises(DENIED):
                cur.execute(statement)
        finally:  # a statement let through fails the test without holding its locks past it
            conn.rollback()
    # an entry bigger than every reader's budget (16 MiB and its envelope), by its own SQL: a 200 MB
    # one took a streaming replicator of every client to 2.4 GB; the client's own limit is kept
    for stream in (1, 2, 3):
        try:
            with conn.cursor() as cur, pytest.raises(psycopg2.errors.CheckViolation, match="message_bounded"):
                cur.execute(
                    "INSERT INTO lr.log_entries (stream, tag_ids, client_id, message) SELECT %s, '{1}', client_id, "
                    "convert_to(repeat('x', 17825793), 'SQL_ASCII') FROM lr.clients WHERE client_name = 'alpha'",
                    (stream,),
                )
        finally:
            conn.rollback()
    RoutingQueueClient(conn, "alpha").transmit_log_entry_message(b"x" * (16 << 20), ["site-b", "site-c"])
    conn.rollback()
    # what the issue reproduced: a forged position made the next application commit fail
    before = source.query("SELECT count(*) FROM lr.log_commits")[0][0]
    put(conn, RoutingQueueClient(conn, "alpha"), "after", 1)
    put(conn, RoutingQueueClient(conn, "alpha"), "again", 2)
    conn.close()
    assert source.query("SELECT trim_mark FROM lr.log_trim") == [(0,)]
    positions = [p for (p,) in source.query("SELECT position FROM lr.log_commits ORDER BY 1")]
    assert len(positions) == before + 2 and positions == list(range(1, before + 3))
    # the trigger lr attached still fires for the writer: its federated table's changes are captured
    source.query("CREATE TABLE alpha_rows (k int PRIMARY KEY)")
    source.query(f'GRANT INSERT ON alpha_rows TO "{world.writer["alpha"]}"')
    federate(source, "public.alpha_rows", "alpha")
    conn = connect_as(source, world.writer["alpha"])
    with conn.cursor() as cur:
        cur.execute("INSERT INTO alpha_rows VALUES (1)")
    conn.commit()
    conn.close()
    assert source.query(
        "SELECT c.client_name FROM lr.log_entries e JOIN lr.clients c USING (client_id) WHERE e.stream = 3"
    ) == [("alpha",)]


def test_writer_waits_until_its_transmit_is_safe_and_guards_only_its_client(world):
    source = world.source
    conn = connect_as(source, world.writer["alpha"])
    alpha = RoutingQueueClient(conn, "alpha")
    with conn.cursor() as cur:
        cur.execute("INSERT INTO app_state VALUES ('alpha', 'w', 1)")
    ticket = alpha.transmit_log_entry_message(b"w=1", ["site-b"])
    conn.commit()
    with pytest.raises(DeliveryTimeout, match=r"not acknowledged by \['site-b'\]"):
        alpha.wait_until_safe(ticket, timeout=0.3)  # as the writer: position, acks and its guard
    run_until_idle(
        replicator(world.topo, sites_as(world.sites, world.replicator), providers={c: provider(c) for c in CLIENTS})
    )
    assert alpha.wait_until_safe(ticket, timeout=10).safe_on == ["site-b"]
    with conn.cursor() as cur:
        with pytest.raises(DENIED, match="row-level security"):
            cur.execute(
                "INSERT INTO lr.delivery_guards (guard_id, client_name, position, destinations, expires_at) "
                "VALUES (gen_random_uuid(), 'beta', 1, '{site-b}', now())"
            )
    conn.rollback()
    # the reads its waits make answer about its own client only: another's sessions and failover
    # notes are not a writer's to see (before, any client's could be asked for)
    with conn.cursor() as cur:
        cur.execute("SELECT lr.sinks_lacking_tables('alpha', NULL), lr.unreplicated_note('alpha', 1)")
        assert cur.fetchall() == []  # every sink holds alpha's (no) tables; no note
    conn.rollback()
    for call in ("lr.sinks_lacking_tables('beta', NULL)", "lr.unreplicated_note('beta', 1)"):
        try:
            with conn.cursor() as cur, pytest.raises(DENIED, match="may not read .* of client beta"):
                cur.execute(f"SELECT {call}")
        finally:
            conn.rollback()
    # nor another client's transactions: a commit position is told for a transaction with an entry of
    # alpha's (a beta writer's reads as one that wrote nothing); before, any transaction id was answered,
    # and a writer learned which of other applications' transactions wrote to the log, and their order
    other = connect_as(source, world.writer["beta"])
    beta_ticket = RoutingQueueClient(other, "beta").transmit_log_entry_message(b"b=1", ["site-b"])
    other.commit()
    other.close()
    position_of = "SELECT lr.commit_position_of(%s::text::xid8)"
    assert source.query(position_of, (str(beta_ticket.tx),))[0][0] is not None  # the owner sees it
    with conn.cursor() as cur:
        cur.execute(position_of, (str(ticket.tx),))
        assert cur.fetchone()[0] is not None
        cur.execute(position_of, (str(beta_ticket.tx),))
        assert cur.fetchone() == (None,)
    conn.rollback()
    conn.close()


def test_writer_supplies_only_its_clients_full_syncs(world, made):
    source = world.source
    admin = source.connect()
    for client in CLIENTS:  # forced full syncs of both clients, to site-b, nobody serving them yet
        full_sync.request_full_sync(admin, "site-b", client, "test", forced=True)
    admin.close()
    conn = connect_as(source, world.writer["alpha"])
    with conn.cursor() as cur:
        cur.execute("SELECT DISTINCT client_name FROM lr.full_sync_requests")
        assert cur.fetchall() == [("alpha",)]
        cur.execute("UPDATE lr.full_sync_requests SET note = 'x' WHERE client_name = 'beta'")
        assert cur.rowcount == 0
    conn.rollback()
    for statement in (
        "UPDATE lr.full_sync_requests SET status = 'applied' WHERE status = 'pending'",
        "UPDATE lr.full_sync_requests SET client_name = 'beta'",
        "INSERT INTO lr.full_sync_requests (request_id, sink_site_id, client_name, data_deadline) "
        "VALUES (gen_random_uuid(), 'site-b', 'alpha', now())",
    ):
        with conn.cursor() as cur, pytest.raises(DENIED):  # only pending or supplied, its clients, no new ones
            cur.execute(statement)
        conn.rollback()
    served = RoutingQueueClient(conn, "alpha").serve_full_sync_requests(lambda ctx: ctx.transmit(b"alpha-state"))
    conn.close()
    assert len(served) == 1
    rows = source.query("SELECT client_name, status FROM lr.full_sync_requests WHERE forced ORDER BY 1")
    assert rows == [("alpha", "supplied"), ("beta", "pending")]
    # the replicator (no providers) carries the writer-supplied full sync to the sink
    repl = replicator(
        world.topo,
        sites_as(world.sites, world.replicator),
        sessions=[k for k in world.topo.sessions() if k.client == "alpha" and k.sink == "site-b"],
    )
    run_until_idle(repl)
    assert ("snap", "alpha-state") in queue(world.sink, "site-a", "alpha")
    # a writer of alpha points its request at beta's supply (a transaction lr.commit_position_of
    # finds): alpha's sink queue, which alpha's consumers read, received beta's full-sync payloads
    beta = connect_as(source, world.writer["beta"])
    assert len(RoutingQueueClient(beta, "beta").serve_full_sync_requests(lambda ctx: ctx.transmit(b"beta-secret"))) == 1
    beta.close()
    admin = source.connect()
    full_sync.request_full_sync(admin, "site-b", "alpha", "test", forced=True)
    admin.close()
    (supply,) = source.query(
        "SELECT supplied_tx::text, base_position, base_snapshot, base_upto, entries FROM lr.full_sync_requests "
        "WHERE client_name = 'beta' AND status = 'supplied'"
    )
    conn = connect_as(source, world.writer["alpha"])
    with conn.cursor() as cur:
        cur.execute(
            "UPDATE lr.full_sync_requests SET status = 'supplied', supplied_at = now(), supplied_tx = %s::xid8, "
            "base_position = %s, base_snapshot = %s, base_upto = %s, entries = %s "
            "WHERE client_name = 'alpha' AND status = 'pending'",
            supply,
        )
        assert cur.rowcount == 1
    conn.commit()
    conn.close()
    repl = replicator(
        world.topo,
        sites_as(world.sites, world.replicator),
        sessions=[k for k in world.topo.sessions() if k.client == "alpha" and k.sink == "site-b"],
    )
    try:
        repl.run(max_cycles=4, until_idle=True, interval=0.01)
    finally:
        repl.close()
    assert not [p for _, p in queue(world.sink, "site-a", "alpha", visible_only=False) if "beta" in p]


def test_a_group_role_holds_the_grant_for_its_members(lr_sites, made):
    apply(lr_sites, [{"source": "site-a", "sinks": ["site-b"], "clients": CLIENTS}])
    source = lr_sites[0]
    group, login = made.name("group"), made.name("login")
    source.query(f'CREATE ROLE "{group}" NOLOGIN')
    made.grant(source, "writer", group, ["alpha"], create=False)
    source.query(f'CREATE ROLE "{login}" LOGIN IN ROLE "{group}"')
    conn = connect_as(source, login)
    RoutingQueueClient(conn, "alpha").transmit_log_entry_message(b"as a member", ["site-b"])
    conn.commit()
    with pytest.raises(TransmitError, match="may not transmit as client 'beta' .* holds writer of alpha"):
        RoutingQueueClient(conn, "beta").transmit_log_entry_message(b"no", ["site-b"])  # the group's grant, named
    conn.close()
    assert source.query("SELECT count(*) FROM lr.log_commits") == [(1,)]


# a function that makes its caller's login a superuser when it runs as one (quietly when not)
_ESCALATE = """CREATE FUNCTION app.{name}({arg}) RETURNS text LANGUAGE plpgsql AS $$
BEGIN
    BEGIN
        EXECUTE pg_catalog.format('ALTER ROLE %I SUPERUSER', session_user);
    EXCEPTION WHEN insufficient_privilege THEN NULL;
    END;
    RETURN 'forged';
END $$"""


def test_an_application_owning_a_federated_table_cannot_run_its_casts_as_lrs_owner(lr_sites, made):
    """The capture trigger runs as lr's owner (SECURITY DEFINER: it writes the log). It carried a
    composite, array or json-castable column as its text through a cast, and the role that owns the
    table owns its column types and may make its own cast from them to text: the cast ran as lr's
    owner (a superuser on embedded sites), and one INSERT made the application's role a superuser.
    The capture now prints such a column with its type's output function, which no role but a
    superuser defines: the values travel as the types print them, the casts are not called."""
    apply(lr_sites, [{"source": "site-a", "sinks": ["site-b"], "clients": ["alpha"]}])
    source = lr_sites[0]
    app = made.name("app")
    source.query(f'CREATE ROLE "{app}" LOGIN')
    source.query(f'CREATE SCHEMA app AUTHORIZATION "{app}"')
    conn = connect_as(source, app)
    with conn.cursor() as cur:
        cur.execute("CREATE TABLE app.t (id int PRIMARY KEY, v text)")
    conn.commit()
    federate(source, "app.t", "alpha")
    with conn.cursor() as cur:  # the application's own types, casts and columns, after the open
        cur.execute("CREATE TYPE app.pair AS (x int); CREATE TYPE app.mood AS ENUM ('calm')")
        for name, arg in (("pair_text", "app.pair"), ("pairs_text", "app.pair[]"), ("mood_text", "app.mood")):
            cur.execute(_ESCALATE.format(name=name, arg=arg))
            cur.execute(f"CREATE CAST ({arg} AS text) WITH FUNCTION app.{name}({arg})")
        cur.execute("CREATE FUNCTION app.mood_json(app.mood) RETURNS json LANGUAGE sql AS $$ SELECT '1'::json $$")
        cur.execute("CREATE CAST (app.mood AS json) WITH FUNCTION app.mood_json(app.mood)")  # carried as text
        cur.execute("ALTER TABLE app.t ADD COLUMN p app.pair, ADD COLUMN ps app.pair[], ADD COLUMN m app.mood")
        cur.execute("INSERT INTO app.t VALUES (1, 'a', ROW(1), ARRAY[ROW(2)::app.pair], 'calm')")
    conn.commit()
    conn.close()
    assert source.query("SELECT rolsuper FROM pg_roles WHERE rolname = %s", (app,)) == [(False,)]
    (message,) = source.query("SELECT convert_from(message, 'UTF8')::jsonb FROM lr.log_entries WHERE stream = 3")[0]
    assert message["rows"] == [{"id": 1, "v": "a", "p": "(1)", "ps": "{(2)}", "m": "calm"}], message


# --- consumer ---------------------------------------------------------------------
def replicate(world, **settings) -> None:
    run_until_idle(
        replicator(
            world.topo, sites_as(world.sites, world.replicator), providers={c: provider(c) for c in CLIENTS}, **settings
        )
    )


def cycles_failing(world) -> list:
    """A few cycles as the replicator, some sessions failing: their reports."""
    repl = replicator(world.topo, sites_as(world.sites, world.replicator), providers={c: provider(c) for c in CLIENTS})
    try:
        return repl.run(max_cycles=3, until_idle=True, interval=0.01)
    finally:
        repl.close()


def transmit_both(world, n: int = 3, start: int = 0) -> None:
    for client in CLIENTS:
        conn = connect_as(world.source, world.writer[client])
        sender = RoutingQueueClient(conn, client)
        for i in range(start, n):
            put(conn, sender, f"{client}{i}", i)
        conn.close()


def test_consumer_reads_and_acknowledges_only_its_clients_queues(world):
    transmit_both(world)
    replicate(world)
    sink = world.sink
    beta_rows = sink.query("SELECT count(*) FROM lr.receive_queue WHERE client_name = 'beta'")[0][0]
    assert beta_rows > 0

    alpha = RoutingQueueSubscriber(info_as(sink, world.consumer["alpha"]), client_name="alpha")
    listener = Collect()
    assert alpha.poll(listener) > 0
    assert listener.logs() == [b"alpha0=0", b"alpha1=1", b"alpha2=2"]
    assert alpha.sources() == ["site-a"]
    alpha.close()

    as_beta = RoutingQueueSubscriber(info_as(sink, world.consumer["alpha"]), client_name="beta")
    nothing = Collect()
    for step in (as_beta.sources, lambda: as_beta.poll(nothing)):  # refused, naming the grant (test_role_refusals)
        with pytest.raises(ConfigurationError, match="may not consume the receive queues of client 'beta'"):
            step()
    conn = connect_as(sink, world.consumer["alpha"])  # its own SQL: row-level security shows it nothing of beta's
    report = receive.ReceiveQueueReader(conn).deliver(nothing, "beta", sources=["site-a"])  # named explicitly
    assert report.delivered == 0 and nothing.got == []
    with conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM lr.receive_queue WHERE client_name = 'beta'")
        assert cur.fetchone()[0] == 0
        cur.execute("DELETE FROM lr.receive_queue WHERE client_name = 'beta'")
        assert cur.rowcount == 0
        cur.execute("UPDATE lr.receive_queue SET delivered = 1 WHERE client_name = 'beta'")
        assert cur.rowcount == 0
        cur.execute("SELECT count(*) FROM lr.registry WHERE client_name = 'beta'")
        assert cur.fetchone()[0] == 0
    conn.commit()
    for statement in (
        "UPDATE lr.receive_queue SET visible = true",
        "UPDATE lr.receive_queue SET client_name = 'x'",
        "INSERT INTO lr.receive_queue (source_site_id, client_name, kind, source_position, "
        "source_entry_id, visible, message) VALUES ('site-a', 'alpha', 1, 1, 1, true, '\\x00')",
        "SELECT count(*) FROM lr.sink_sessions",
        "SELECT count(*) FROM lr.topology",
        "DELETE FROM lr.registry",
    ):
        with conn.cursor() as cur, pytest.raises(DENIED):
            cur.execute(statement)
        conn.rollback()
    conn.close()
    assert sink.query("SELECT count(*) FROM lr.receive_queue WHERE client_name = 'beta'")[0][0] == beta_rows

    beta = RoutingQueueSubscriber(info_as(sink, world.consumer["beta"]), client_name="beta")
    theirs = Collect()
    assert beta.poll(theirs) > 0
    assert theirs.logs() == [b"beta0=0", b"beta1=1", b"beta2=2"]
    beta.close()


def test_consumer_dead_letters_are_its_own(world):
    sink = world.sink
    bad = b"\xff\xfe not a RoutingTableEntryMsg"
    for client in CLIENTS:  # a malformed entry at the head of each client's queue
        sink.query(
            "INSERT INTO lr.receive_queue (source_site_id, client_name, kind, source_position, "
            "source_entry_id, visible, message) VALUES ('site-a', %s, %s, 1, 1, true, %s)",
            (client, lr_pb2.LOG_ENTRY_SYNC, bad),
        )
    for client in CLIENTS:
        sub = RoutingQueueSubscriber(info_as(sink, world.consumer[client]), client_name=client)
        sub.poll(Collect())
        assert sub.stats.dead_letters == 1
        sub.close()
    conn = connect_as(sink, world.consumer["alpha"])
    with conn.cursor() as cur:
        cur.execute("SELECT client_name FROM lr.receive_dead_letters")
        assert cur.fetchall() == [("alpha",)]
        cur.execute("DELETE FROM lr.receive_dead_letters WHERE client_name = 'beta'")
        assert cur.rowcount == 0
        with pytest.raises(DENIED, match="row-level security"):
            cur.execute(
                "INSERT INTO lr.receive_dead_letters (seq, source_site_id, client_name, kind, message, error) "
                "VALUES (-1, 'site-a', 'beta', 1, '\\x00', 'forged')"
            )
    conn.rollback()
    with conn.cursor() as cur:
        cur.execute("DELETE FROM lr.receive_dead_letters")  # its own
        assert cur.rowcount == 1
    conn.commit()
    # lr's SECURITY DEFINER reads of a source's state, for a writer's waits: every role with USAGE on
    # lr could call them, for any client (another client's sinks not holding its tables, its failover
    # notes, any transaction's position); a consumer needs none of them
    for call in (
        "lr.commit_position_of('1')",
        "lr.sinks_lacking_tables('beta', NULL)",
        "lr.unreplicated_note('beta', 1)",
    ):
        try:
            with conn.cursor() as cur, pytest.raises(DENIED, match="permission denied for function"):
                cur.execute(f"SELECT {call}")
        finally:
            conn.rollback()
    conn.close()
    assert sink.query("SELECT client_name FROM lr.receive_dead_letters") == [("beta",)]


def test_subscriber_run_follows_arrivals_with_only_the_consumer_role(world):
    sub = RoutingQueueSubscriber(info_as(world.sink, world.consumer["alpha"]), client_name="alpha", poll_interval=0.5)
    listener, stop = Collect(), threading.Event()
    thread = threading.Thread(target=sub.run, args=(listener, stop))
    thread.start()
    try:
        transmit_both(world, 2)
        replicate(world)
        deadline = time.monotonic() + 20
        while len(listener.logs()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        thread.join(10)
    assert listener.logs() == [b"alpha0=0", b"alpha1=1"]
    assert sub.stats.failures == 0


# --- replicator -----------------------------------------------------------------------------
def test_replicator_runs_cycles_full_syncs_status_and_trim(world):
    source, sink = world.source, world.sink
    first = queue(sink, "site-a", "alpha")
    assert first[0] == ("start", "") and first[-1] == ("end", "")  # the first contact's full sync

    transmit_both(world)
    replicate(world)
    for client in CLIENTS:
        logs = [p for kind, p in queue(sink, "site-a", client) if kind == "log"]
        assert logs == [f"{client}{i}={i}" for i in range(3)]
        for other in world.sites[2:]:
            assert [p for k, p in queue(other, "site-a", client) if k == "log"] == logs

    conn = connect_as(source, world.replicator)  # lr full-sync, as the replicator
    full_sync.request_full_sync(conn, "site-b", "alpha", "operator asked", forced=True)
    replicate(world)
    snap = [p for kind, p in queue(sink, "site-a", "alpha") if kind == "snap"]
    assert sorted(snap) == [f"alpha{i}={i}" for i in range(3)]  # the provider read the application's table

    assert status.site_status(conn, "site-a").site_id == "site-a"  # lr status works as the replicator
    result = trim.safe_trim(conn)
    assert result is not None and result.entries_removed > 0
    conn.close()
    rows = source.query("SELECT state, last_error FROM lr.source_sessions")
    assert rows and all(r == ("IN_LOG_ENTRY_SYNC", None) for r in rows)
    with pytest.raises(DENIED):  # but it does not change the topology or the site
        conn = connect_as(source, world.replicator)
        try:
            with conn.cursor() as cur:
                cur.execute("UPDATE lr.topology SET topology_config_id = 'x'")
        finally:
            conn.close()
    # nor fail over: lr_failover over replicator logins (the DAGs' connections docs/security.md
    # advises) logged only `permission denied for table failovers`; the refusal now says who asked
    # and that a failover runs as the owner, and nothing was done
    from airflow_provider_lr.engine.db.explained import failure
    from airflow_provider_lr.engine.site import failover

    with pytest.raises(DENIED) as refused:
        failover.promote(
            failover.FailoverRequest("site-a", "site-b", reason="drill"),
            lambda site_id: connect_as(next(s for s in world.sites if s.site_id == site_id), world.replicator),
            topology=world.topo,
        )
    said = failure(refused.value)
    assert (
        f"role '{world.replicator}' lacks a privilege this step needs on " in said and "a failover, a rejoin" in said
    ), said
    assert "owner of the lr schema" in said and sink.query("SELECT count(*) FROM lr.failovers") == [(0,)]
    # an application's writer login given to lr sync / lr trim / lr status was told only which steps
    # need the owner, not that these need a replicator
    conn = connect_as(source, world.writer["alpha"])
    with pytest.raises(DENIED) as refused:
        trim.safe_trim(conn)
    conn.close()
    said = failure(refused.value)
    assert f"role '{world.writer['alpha']}' lacks a privilege" in said, said
    assert "`lr sync`, `lr status`, `lr trim`, `lr full-sync` and the DAGs run as a replicator" in said, said
    # a federated table whose row-level security applies to the replicator: PostgreSQL filtered its
    # snapshot read silently (the sinks got none of its rows, said synced); the session now fails
    # naming the policy to add, and goes on once it is there
    for site in world.sites:
        site.query("CREATE TABLE guarded (id int PRIMARY KEY)")
        site.query(f'GRANT SELECT, INSERT, UPDATE, DELETE ON guarded TO "{world.replicator}"')
    source.query("INSERT INTO guarded SELECT generate_series(1, 5); ALTER TABLE guarded ENABLE ROW LEVEL SECURITY")
    federate(source, "public.guarded", "alpha")
    reports = cycles_failing(world)
    assert any("row-level security applies to" in (r.error or "") for r in reports), reports
    assert sink.query("SELECT count(*) FROM guarded") == [(0,)]
    source.query(f'CREATE POLICY lr_snapshot ON guarded FOR SELECT TO "{world.replicator}" USING (true)')
    replicate(world)
    assert [s.query("SELECT count(*) FROM guarded") for s in world.sites[1:]] == [[(5,)], [(5,)]]
    # at a sink, row-level security that hides rows from the replicator's deletes: PostgreSQL skipped
    # them silently (the sink kept rows the source deleted, said synced); the batch is refused now
    sink.query(
        "ALTER TABLE guarded ENABLE ROW LEVEL SECURITY; "
        + "; ".join(
            f'CREATE POLICY lr_{c} ON guarded FOR {c} TO "{world.replicator}" USING (true)'
            for c in ("SELECT", "UPDATE")
        )
        + f'; CREATE POLICY lr_insert ON guarded FOR INSERT TO "{world.replicator}" WITH CHECK (true)'
    )
    source.query("DELETE FROM guarded WHERE id <= 2")
    reports = cycles_failing(world)
    assert any("row-level security of the sink's table public.guarded" in (r.error or "") for r in reports), reports
    sink.query("ALTER TABLE guarded DISABLE ROW LEVEL SECURITY")
    replicate(world)
    assert [s.query("SELECT id FROM guarded ORDER BY id") for s in world.sites[1:]] == [[(3,), (4,), (5,)]] * 2


def test_replicator_role_streams(world):
    """``lr sync``'s streaming mode needs nothing the replicator role lacks: the commit-position
    probe, the one-statement final prefix, lazy acks and lease renewals, fenced sink writes (the
    first of a session, which registers its queue, and the one-round-trip ones after it)."""
    from airflow_provider_lr.engine.session.settings import StreamSettings

    def arrived(count: int) -> bool:
        return all(
            len([p for k, p in queue(sink, "site-a", c) if k == "log"]) >= count
            for sink in world.sites[1:]
            for c in CLIENTS
        )

    repl = replicator(world.topo, sites_as(world.sites, world.replicator), providers={c: provider(c) for c in CLIENTS})
    with Streaming(repl, StreamSettings(check_interval=0.2, ack_interval=0.05)) as streaming:
        streamer = streaming.streamer
        streaming.streaming()
        assert not streamer.ends, streamer.ends
        transmit_both(world)
        wait_for(lambda: streamer.ends or arrived(3), 30, "the entries")
        transmit_both(world, 6, start=3)
        wait_for(lambda: streamer.ends or arrived(6), 30, "the next entries")
    assert [e.reason for e in streamer.ends] == ["stopped"] * len(repl.sessions)  # no hand-back, no error
    for sink in world.sites[1:]:
        for client in CLIENTS:
            assert [p for k, p in queue(sink, "site-a", client) if k == "log"] == [f"{client}{i}={i}" for i in range(6)]


def test_replicator_fanout_copies_under_row_level_security(world, tmp_path: Path, monkeypatch):
    """The in-process tee COPYs into lr.receive_queue, which PostgreSQL refuses under row-level
    security: a replicator role's rows go through a temporary table, in order."""
    conns = {}
    for site in world.sites:
        raw = site.server.airflow_conn(site.dbname)
        conns[site.site_id] = {**raw, "login": world.replicator}
    path = tmp_path / "connections.json"
    path.write_text(json.dumps(conns))
    monkeypatch.setenv("LR_CONNECTIONS_FILE", str(path))
    conn = connect_as(world.source, world.writer["alpha"])
    sender = RoutingQueueClient(conn, "alpha")
    for t in range(8):
        sender.transmit_log_entry_messages(
            [LRMessageWithDestinations(f"bulk{t}-{i}".encode(), ["site-b", "site-c"]) for i in range(100)]
        )
        conn.commit()
    conn.close()
    repl = replicator(world.topo, sites_as(world.sites, world.replicator), tee_min_backlog=100)
    run_until_idle(repl)
    assert sum(repl.teed.values()) == 1600
    for sink in world.sites[1:]:
        logs = [p for kind, p in queue(sink, "site-a", "alpha") if kind == "log"]
        assert logs == [f"bulk{t}-{i}" for t in range(8) for i in range(100)]


# --- lr init --------------------------------------------------------------------------------
def test_lr_init_on_an_installed_site_needs_no_create_on_the_database(world, made, capsys):
    source = world.source
    for role in (world.replicator, world.writer["alpha"], world.writer["beta"]):
        assert source.query("SELECT has_database_privilege(%s, current_database(), 'CREATE')", (role,)) == [(False,)]
        assert cli.main(["init", "--site", info_as(source, role).dsn, "--site-id", "site-a"]) == 0
        assert "site-a: lr schema up to date" in capsys.readouterr().out
    stranger = made.name("stranger")
    source.query(f'CREATE ROLE "{stranger}" LOGIN')
    assert cli.main(["init", "--site", info_as(source, stranger).dsn, "--site-id", "site-a"]) == 1
    assert "may not read the lr schema version" in capsys.readouterr().err  # a clear error, no traceback
    # a role that may read but not write the identity gets a clear error, nothing changes
    assert (
        cli.main(
            ["init", "--site", info_as(source, world.replicator).dsn, "--site-id", "site-a", "--region", "elsewhere"]
        )
        == 1
    )
    assert "may not record the site identity" in capsys.readouterr().err
    assert source.query("SELECT region FROM lr.site_info") == [(source.region,)]


def test_an_owner_without_create_on_the_database_installs_into_its_schema(sites, made, caplog):
    site = sites[0]
    owner, writer = made.name("owner"), made.name("writer")
    site.query(f'CREATE ROLE "{owner}" LOGIN')
    site.query(f'CREATE SCHEMA lr AUTHORIZATION "{owner}"')  # what a DBA hands over
    conn = connect_as(site, owner)
    result = schema.init_site(conn, site.site_id, site.region)
    assert result.applied == [m.version for m in schema.available_migrations()]
    assert schema.init_site(conn, site.site_id).applied == []
    topo = topologies.from_document(
        {
            "sites": [{"id": s.site_id} for s in sites[:2]],
            "replication": [{"source": site.site_id, "sinks": [sites[1].site_id], "clients": ["alpha"]}],
        }
    )
    topology.apply_to_site(conn, topo, site.site_id)  # the owner applies the topology
    site.query(f'CREATE ROLE "{writer}" LOGIN')
    roles.grant(conn, "writer", writer, ["alpha"])  # the owner grants (no superuser involved)
    with pytest.raises(ConfigurationError, match="owns the lr schema"):
        roles.grant(conn, "writer", owner, ["alpha"])
    conn.close()
    wconn = connect_as(site, writer)
    RoutingQueueClient(wconn, "alpha").transmit_log_entry_message(b"x", [sites[1].site_id])
    wconn.commit()
    wconn.close()
    assert site.query("SELECT count(*) FROM lr.log_commits") == [(1,)]
    assert site.query("SELECT has_database_privilege(%s, current_database(), 'CREATE')", (owner,)) == [(False,)]
    # the application's table with a DEFERRABLE key: for a key two rows hold between statements the
    # capture reads it as lr's owner; an owner that may not read it made every UPDATE and DELETE of
    # the application fail once the table was open (it opened, with TRIGGER only)
    site.query(f'CREATE SCHEMA app AUTHORIZATION "{writer}"')
    wconn = connect_as(site, writer)
    wconn.autocommit = True
    with wconn.cursor() as cur:
        cur.execute("CREATE TABLE app.d (id int PRIMARY KEY DEFERRABLE INITIALLY DEFERRED, v text)")
        cur.execute(f'GRANT USAGE ON SCHEMA app TO "{owner}"; GRANT TRIGGER ON app.d TO "{owner}"')
        cur.execute("INSERT INTO app.d VALUES (1, 'a'), (2, 'b')")
    conn = connect_as(site, owner)
    with pytest.raises(TableError, match=f"DEFERRABLE.*GRANT SELECT ON app.d TO {owner}"):
        registry.open_table(conn, "app.d", "alpha", True)
    with wconn.cursor() as cur:
        cur.execute(f'GRANT SELECT ON app.d TO "{owner}"')
    with caplog.at_level(logging.WARNING, logger="airflow_provider_lr"):
        registry.open_table(conn, "app.d", "alpha", True)
    # opened, but only the table's owner may make its triggers fire for a writer in the replica role: said
    (said,) = [r.getMessage() for r in caplog.records if "session_replication_role" in r.getMessage()]
    assert "app.d: " in said and 'ALTER TABLE "app"."d" ENABLE ALWAYS TRIGGER "lr_capture_insert"' in said, said
    with wconn.cursor() as cur:  # key 1 held by two rows between the statements
        cur.execute("BEGIN; UPDATE app.d SET id = 3 WHERE id = 1; UPDATE app.d SET id = 1 WHERE id = 2; COMMIT")
    # row-level security enabled after the open would run the application's policy as lr's owner:
    # the capture refuses to read under it (the write fails), and the open says so
    with wconn.cursor() as cur:
        cur.execute("CREATE TABLE app.seen (who text); GRANT INSERT ON app.seen TO PUBLIC")
        cur.execute(
            "CREATE FUNCTION app.watch() RETURNS boolean LANGUAGE plpgsql AS "
            "$$ BEGIN INSERT INTO app.seen VALUES (current_user); RETURN true; END $$"
        )
        cur.execute("ALTER TABLE app.d ENABLE ROW LEVEL SECURITY; CREATE POLICY p ON app.d USING (app.watch())")
        with pytest.raises(psycopg2.Error, match="row-level security"):
            cur.execute("UPDATE app.d SET v = 'c' WHERE id = 3")
    assert site.query("SELECT who FROM app.seen") == []
    with pytest.raises(TableError, match=f"row-level security applies to {owner}"):
        registry.open_table(conn, "app.d", "alpha", True)
    conn.close()
    wconn.close()


# --- lr roles -------------------------------------------------------------------------------
def test_lr_roles_grant_print_list_revoke(lr_sites, made, capsys, monkeypatch):
    site = lr_sites[1]
    dsn = site.dsn
    role = made.name("early")
    assert cli.main(["roles", "grant", "writer", "--client", "alpha", "--role", role, "--site", dsn]) == 1
    assert "no topology is applied on site" in capsys.readouterr().err  # its clients cannot be checked yet
    # site-b receives alpha and beta from site-a and is the source of alpha for site-c
    apply(
        lr_sites,
        [
            {"source": "site-a", "sinks": ["site-b"], "clients": ["alpha", "beta"]},
            {"source": "site-b", "sinks": ["site-c"], "clients": ["alpha"]},
        ],
    )
    role = made.name('odd "name" x')  # quoted as an identifier everywhere
    monkeypatch.setenv("LR_TEST_PASSWORD", "s3cret'; DROP TABLE x; --")
    assert (
        cli.main(
            [
                "roles",
                "grant",
                "consumer",
                "--client",
                "alpha",
                "--role",
                role,
                "--site",
                dsn,
                "--create",
                "--password-env",
                "LR_TEST_PASSWORD",
                "--print",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "CREATE ROLE" in printed and "PASSWORD '***'" in printed and "s3cret" not in printed
    assert 'odd ""name"" x"' in printed
    assert site.query("SELECT count(*) FROM pg_roles WHERE rolname = %s", (role,)) == [(0,)]  # --print changed nothing

    assert (
        cli.main(
            [
                "roles",
                "grant",
                "consumer",
                "--client",
                "alpha",
                "--client",
                "beta",
                "--role",
                role,
                "--site",
                dsn,
                "--create",
                "--password-env",
                "LR_TEST_PASSWORD",
            ]
        )
        == 0
    )
    assert cli.main(["roles", "grant", "writer", "--client", "alpha", "--role", role, "--site", dsn]) == 0
    capsys.readouterr()
    assert cli.main(["roles", "list", "--site", dsn]) == 0
    listed = capsys.readouterr().out
    assert f"{role}: consumer of alpha" in listed and f"{role}: consumer of beta" in listed
    assert f"{role}: writer of alpha" in listed

    assert cli.main(["roles", "revoke", "writer", "--client", "alpha", "--role", role, "--site", dsn]) == 0
    assert cli.main(["roles", "revoke", "consumer", "--client", "beta", "--role", role, "--site", dsn]) == 0
    grants = site.query("SELECT kind, client_name FROM lr.role_grants WHERE role_name = %s", (role,))
    assert grants == [("consumer", "alpha")]
    privileges = site.query(
        "SELECT has_table_privilege(%(r)s, 'lr.receive_queue', 'DELETE'), "
        "has_table_privilege(%(r)s, 'lr.log_entries', 'INSERT') OR "
        "has_any_column_privilege(%(r)s, 'lr.log_entries', 'INSERT')",
        {"r": role},
    )
    assert privileges == [(True, False)]  # the consumer's rights stay, the writer's are gone

    capsys.readouterr()
    for argv, message in [
        (["roles", "grant", "writer", "--role", role, "--site", dsn], "give --client"),
        (["roles", "grant", "replicator", "--client", "x", "--role", role, "--site", dsn], "give no --client"),
        (["roles", "grant", "writer", "--client", "bad name;", "--role", role, "--site", dsn], "invalid client"),
        (["roles", "grant", "writer", "--client", "alpha", "--role", "postgres", "--site", dsn], "is a superuser"),
        (
            ["roles", "grant", "writer", "--client", "alpha", "--role", "lrt_nobody_here", "--site", dsn],
            "pass --create",
        ),
        # a misspelt client, and one the site receives but does not transmit: granted, the
        # application would be refused at its first transmit with nothing said here
        (
            ["roles", "grant", "writer", "--client", "aplha", "--role", role, "--site", dsn],
            "client(s) aplha: site 'site-b' is not the source of them in the topology applied there "
            "(it is the source of alpha)",
        ),
        (["roles", "grant", "writer", "--client", "beta", "--role", role, "--site", dsn], "not the source of them"),
        (
            ["roles", "grant", "consumer", "--client", "gamma", "--role", role, "--site", dsn],
            "not a sink of them in the topology applied there (it is a sink of alpha, beta)",
        ),
        # a revoke of what the role does not hold said it was revoked
        (
            ["roles", "revoke", "consumer", "--client", "beta", "--role", role, "--site", dsn],
            "holds no consumer of beta on site",
        ),
        (["roles", "revoke", "replicator", "--role", role, "--site", dsn], "holds no replicator on site"),
    ]:
        usage = message in ("give --client", "give no --client", "invalid client")  # before any site
        assert cli.main(argv) == (2 if usage else 1), argv
        assert message in capsys.readouterr().err


def test_lr_roles_grant_create_needs_a_password_or_says_it_has_none(lr_sites, made, capsys, monkeypatch):
    """`--create` without `--password-env` made a LOGIN role with no password, silently."""
    site = lr_sites[0]
    apply(lr_sites, [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}])
    role = made.name("writer")
    assert (
        cli.main(["roles", "grant", "writer", "--client", "policy", "--role", role, "--site", site.dsn, "--create"])
        == 2  # a usage error
    )
    assert "give its password with --password-env VAR" in capsys.readouterr().err
    assert site.query("SELECT count(*) FROM pg_roles WHERE rolname = %s", (role,)) == [(0,)]
    monkeypatch.setenv("LR_TEST_PASSWORD", "pw")
    assert (
        cli.main(
            [
                "roles",
                "grant",
                "writer",
                "--client",
                "policy",
                "--role",
                role,
                "--site",
                site.dsn,
                "--create",
                "--password-env",
                "LR_TEST_PASSWORD",
                "--no-password",
            ]
        )
        == 2
    )
    assert (
        cli.main(
            [
                "roles",
                "grant",
                "writer",
                "--client",
                "policy",
                "--role",
                role,
                "--site",
                site.dsn,
                "--create",
                "--no-password",
            ]
        )
        == 0
    )
    assert site.query("SELECT rolcanlogin, rolpassword IS NULL FROM pg_authid WHERE rolname = %s", (role,)) == [
        (True, True)
    ]


def test_lr_roles_list_reads_the_sites_it_reaches(lr_sites, capsys):
    down = "host=127.0.0.1 port=1 user=postgres dbname=postgres connect_timeout=2"
    assert cli.main(["roles", "list", "--site", lr_sites[0].dsn, "--site", down]) == 2
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith(": no roles granted") and "UNREACHABLE (cannot connect to site" in out[1]
    assert len(out) == 2  # the error on one line


@pytest.mark.parametrize("name", ["a\nsite-b: replicator granted to evil", "tab\there", "nul\x00", "", "r" * 64])
def test_a_role_name_that_cannot_be_said_on_one_line_is_refused(name):
    """A role name with a newline was granted, and ``lr roles grant`` and ``list`` printed it as two
    lines (one that reads like another grant). Control characters are refused with the rest."""
    with pytest.raises(ConfigurationError, match="invalid role name"):
        roles.check_request("consumer", name, ["alpha"])


@pytest.mark.parametrize("client", ["policy\n", "pólicy", "-policy", "p" * 64])
def test_a_client_name_no_topology_can_hold_is_refused_as_the_topology_refuses_it(client):
    """The grant's own pattern ended in ``$``, which lets a final newline through: ``--client
    'policy\n'`` passed the check. The topology's names are matched whole; so is a grant's."""
    with pytest.raises(ConfigurationError, match="invalid client name"):
        roles.check_request("consumer", "app_sink", [client])


def test_roles_need_the_v6_schema(sites):
    conn = sites[0].connect()
    schema.migrate(conn, target=5)
    with pytest.raises(SchemaError, match="roles need version 6"):
        roles.plan_grant(conn, "replicator", "whoever")
    conn.close()


def test_reapply_restores_what_a_kind_needs(lr_sites, made):
    site = lr_sites[0]
    role = made.name("repl")
    made.grant(site, "replicator", role)
    site.query(f'REVOKE SELECT ON lr.log_commits FROM "{role}"')  # as if a release added a table
    conn = site.connect()
    assert roles.reapply(conn) == [role]
    conn.close()
    assert site.query("SELECT has_table_privilege(%s, 'lr.log_commits', 'SELECT')", (role,)) == [(True,)]


def test_every_security_definer_function_of_lr_pins_its_search_path(lr_sites):
    """A SECURITY DEFINER function runs with its owner's rights: one that resolved names through the
    caller's search_path could be made to run a function or operator any role with CREATE on a schema
    planted there. Each of lr's pins its own (``SET search_path``), and PUBLIC cannot reach them. So
    does every other function of lr (a new migration's too), pg_catalog first."""
    site = lr_sites[0]
    loose = site.query(
        "SELECT p.oid::regprocedure::text FROM pg_catalog.pg_proc p "
        "JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace "
        "WHERE n.nspname = 'lr' AND p.prosecdef AND NOT EXISTS ("
        "  SELECT FROM unnest(coalesce(p.proconfig, '{}')) c WHERE c LIKE 'search_path=%%')"
    )
    definers = site.query(
        "SELECT count(*) FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace "
        "WHERE n.nspname = 'lr' AND p.prosecdef"
    )[0][0]
    assert definers > 0 and loose == [], loose
    # every other function of lr too (a trigger's runs in the application's transaction, with its
    # path): each searches pg_catalog first, or a lookalike of another schema could stand in
    unpinned = site.query(
        "SELECT p.oid::regprocedure::text FROM pg_catalog.pg_proc p "
        "JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = 'lr' AND NOT EXISTS ("
        "  SELECT FROM unnest(coalesce(p.proconfig, '{}')) c WHERE c LIKE 'search\\_path=pg\\_catalog%%')"
    )
    assert unpinned == [], f"lr functions that do not pin search_path = pg_catalog, ...: {unpinned}"
    # and none of them can be reached by a role lr was not asked to grant: PUBLIC may not use the schema
    assert site.query("SELECT pg_catalog.has_schema_privilege('public', 'lr', 'USAGE')") == [(False,)]


def test_two_grants_run_at_once_on_one_site_both_hold(lr_sites, made):
    """``lr roles grant`` of two roles at once on one site (two operators, a deployment granting its
    roles in parallel, ``lr init``'s reapply beside a grant): each GRANT rewrites the same tables'
    privileges, and the server refuses the second writer of a catalog row ('tuple concurrently
    updated'). Now lr's role changes on a site take turns; both grants hold."""
    apply(lr_sites, [{"source": "site-a", "sinks": ["site-b"], "clients": CLIENTS}])
    source = lr_sites[0]
    names = [made.name(f"w{i}") for i in range(4)]
    errors: list[BaseException] = []
    start = threading.Barrier(len(names))

    def grant(role: str) -> None:
        try:
            start.wait(30)
            made.grant(source, "writer", role, ["alpha"])
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=grant, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    granted = source.query("SELECT DISTINCT role_name FROM lr.role_grants WHERE kind = 'writer' ORDER BY 1")
    assert set(names) <= {r[0] for r in granted}
