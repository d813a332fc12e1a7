"""lr init: versioned migrations install the schema, re-run as a no-op, and upgrade in place."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from airflow_provider_lr.engine.db import conninfo, schema
from airflow_provider_lr.engine.db.timeouts import Purpose
from airflow_provider_lr.engine.errors import SchemaError
from airflow_provider_lr.engine.session.runner import record_error
from airflow_provider_lr.engine.store import topology as topologies
from airflow_provider_lr.engine.vocabulary import SessionKey
from tests.conftest import TestSite, create_database, drop_database
from tests.support.session import apply_to, topology_doc


def copy_shipped(directory: Path) -> int:
    """Copy the shipped migrations into ``directory``; returns the next free version."""
    shipped = schema.available_migrations()
    for migration in shipped:
        (directory / f"V{migration.version:04d}__{migration.name}.sql").write_text(migration.sql)
    return shipped[-1].version + 1


def tables(site) -> set[str]:
    return {r[0] for r in site.query("SELECT tablename FROM pg_tables WHERE schemaname = 'lr'")}


def test_fresh_database_gets_every_shipped_migration_whatever_its_encoding(sites):
    """``lr init`` of a LATIN1 database, connected as lr connects (its client encoding UTF8): the
    server converts each migration's whole text, comments too, to the database's encoding, and
    V0041's comment held a euro sign LATIN1 has not (lr init failed: UntranslatableCharacter).
    Then lr's own text there, escaped where LATIN1 lacks a character."""
    site = TestSite(sites[0].server, f"{sites[0].dbname}_latin1")
    create_database(site.server, site.dbname, encoding="LATIN1")
    try:
        conn = conninfo.from_dsn(site.dsn).connect(Purpose.BULK)
        assert schema.current_version(conn) == 0
        result = schema.init_site(conn, "site-a", "eu")
        latest = schema.available_migrations()[-1].version
        assert result.applied == list(range(1, latest + 1))
        assert schema.current_version(conn) == latest
        assert schema.site_identity(conn) == ("site-a", "eu")
        assert {"schema_migrations", "site_info", "registry"} <= tables(site)
        assert schema.init_site(conn, "site-a").applied == []  # the checksums are the shipped files'
        assert all(m.sent.isascii() for m in schema.available_migrations()), "any database takes them"
        # lr's own text there: a session's last error holding characters LATIN1 lacks (a sink's
        # message, lr's ellipsis) was refused by the server, so lr status never said the error
        apply_to([site], topologies.from_document(topology_doc([site, sites[1]])))
        record_error(conn, SessionKey("site-a", "site-b", "policy"), "the sink said: нет € …")
        said = site.query("SELECT last_error FROM lr.source_sessions")
        assert said == [("the sink said: \\u043d\\u0435\\u0442 \\u20ac \\u2026",)], said
        conn.close()
    finally:
        drop_database(site.server, site.dbname)


def test_rerun_is_a_noop(sites):
    site = sites[0]
    conn = site.connect()
    schema.init_site(conn, "site-a")
    before = site.query("SELECT version, applied_at FROM lr.schema_migrations ORDER BY version")
    again = schema.init_site(conn, "site-a")
    assert again.applied == []
    assert site.query("SELECT version, applied_at FROM lr.schema_migrations ORDER BY version") == before
    conn.close()


def test_newer_version_upgrades_in_place_keeping_data(sites, tmp_path: Path):
    site = sites[0]
    conn = site.connect()
    schema.migrate(conn, target=1)
    assert schema.current_version(conn) == 1
    site.query("INSERT INTO lr.site_info (site_id) VALUES ('site-a')")

    # A release later adds a migration: the shipped ones plus one more.
    nxt = copy_shipped(tmp_path)
    (tmp_path / f"V{nxt:04d}__add_note.sql").write_text("ALTER TABLE lr.site_info ADD COLUMN note text DEFAULT 'x';")
    result = schema.migrate(conn, migrations=schema.available_migrations(tmp_path))
    assert result.applied == list(range(2, nxt + 1))
    assert site.query("SELECT site_id, note FROM lr.site_info") == [("site-a", "x")]
    conn.close()


def test_edited_migration_is_refused(sites, tmp_path: Path):
    conn = sites[0].connect()
    schema.migrate(conn)
    copy_shipped(tmp_path)
    first = sorted(tmp_path.glob("V0001__*.sql"))[0]
    first.write_text(first.read_text() + "\n-- edited\n")
    with pytest.raises(SchemaError, match="differs from the one shipped"):
        schema.migrate(conn, migrations=schema.available_migrations(tmp_path))
    conn.close()


def test_site_newer_than_code_is_refused(sites, tmp_path: Path):
    conn = sites[0].connect()
    nxt = copy_shipped(tmp_path)
    (tmp_path / f"V{nxt:04d}__from_the_future.sql").write_text("SELECT 1;")
    schema.migrate(conn, migrations=schema.available_migrations(tmp_path))
    with pytest.raises(SchemaError, match="newer than this lr knows"):
        schema.migrate(conn)  # the code shipped now is one version behind the site
    conn.close()


def test_failing_migration_leaves_the_site_untouched(sites, tmp_path: Path):
    nxt = copy_shipped(tmp_path)
    (tmp_path / f"V{nxt:04d}__broken.sql").write_text("CREATE TABLE lr.ok (x int); SELECT no_such_function();")
    conn = sites[0].connect()
    with pytest.raises(Exception, match="no_such_function"):
        schema.migrate(conn, migrations=schema.available_migrations(tmp_path))
    assert schema.current_version(conn) == 0
    assert sites[0].query("SELECT to_regnamespace('lr') IS NULL") == [(True,)]
    conn.close()


def test_concurrent_inits_apply_each_migration_once(sites):
    site = sites[0]
    errors: list[BaseException] = []

    def init() -> None:
        try:
            conn = site.connect()
            schema.init_site(conn, "site-a")
            conn.close()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=init) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    versions = [r[0] for r in site.query("SELECT version FROM lr.schema_migrations ORDER BY version")]
    assert versions == [m.version for m in schema.available_migrations()]


def test_site_cannot_be_renamed_and_ids_are_checked(sites):
    conn = sites[0].connect()
    schema.init_site(conn, "site-a")
    with pytest.raises(SchemaError, match="refusing to rename"):
        schema.init_site(conn, "site-z")
    with pytest.raises(SchemaError, match="invalid site id"):
        schema.init_site(conn, 'bad"; drop table x; --')
    conn.close()


def test_site_identity_on_uninitialised_database_says_what_to_do(sites):
    conn = sites[0].connect()
    with pytest.raises(SchemaError, match="run `lr init`"):
        schema.site_identity(conn)
    conn.close()


def test_an_upgrade_waiting_behind_an_open_transaction_does_not_stall_the_logs_readers_and_writers(
    sites, tmp_path: Path
):
    """``lr init`` upgrading a site while ``lr sync`` streams and writers write: a migration that
    alters lr.log_entries (V0046: ACCESS EXCLUSIVE, briefly) queued behind one open transaction on
    it (an application's, a stream's read) for lr init's whole lock_timeout (60 s), and every
    transmit and stream read queued behind the upgrade for as long. Now the upgrade waits in short
    tries and steps aside between them; it applies once the transaction ends."""
    site = sites[0]
    schema.migrate(site.connect())
    nxt = copy_shipped(tmp_path)
    (tmp_path / f"V{nxt:04d}__log_checked.sql").write_text(
        "ALTER TABLE lr.log_entries ADD CONSTRAINT log_checked CHECK (true) NOT VALID;"
    )
    holder = site.connect()
    holder.cursor().execute("SELECT count(*) FROM lr.log_entries")  # open: an application's transaction
    upgrading = conninfo.from_dsn(site.dsn).connect(Purpose.BULK)  # as lr init connects
    outcome: list[object] = []

    def init() -> None:
        try:
            outcome.append(schema.migrate(upgrading, migrations=schema.available_migrations(tmp_path)))
        except BaseException as exc:  # reported below
            outcome.append(exc)

    thread = threading.Thread(target=init)
    thread.start()
    reader = site.connect()
    reader.autocommit = True
    try:
        waiting = "SELECT count(*) FROM pg_locks WHERE relation = 'lr.log_entries'::regclass AND NOT granted"
        deadline = time.monotonic() + 15
        while site.query(waiting) == [(0,)]:
            assert time.monotonic() < deadline, "the upgrade never asked for the log's lock"
        with reader.cursor() as cur:
            cur.execute("SET statement_timeout = '6s'")
            started = time.monotonic()
            cur.execute("SELECT count(*) FROM lr.log_entries")  # a transmit's or the stream's turn
            assert time.monotonic() - started < 5, "the log's reader waited out the upgrade"
    finally:
        holder.rollback()
        holder.close()
        thread.join(60)
        reader.close()
    assert len(outcome) == 1 and not isinstance(outcome[0], BaseException), outcome
    assert site.query("SELECT max(version) FROM lr.schema_migrations") == [(nxt,)]
    upgrading.close()


def test_an_upgrade_that_cannot_get_the_logs_lock_is_refused_naming_the_open_transaction(sites, tmp_path: Path):
    """The short tries end at the connection's lock_timeout: a clear refusal naming the transaction
    that held the log throughout (before: 'canceling statement due to lock timeout'), nothing applied."""
    site = sites[0]
    schema.migrate(site.connect())
    nxt = copy_shipped(tmp_path)
    (tmp_path / f"V{nxt:04d}__log_checked.sql").write_text(
        "ALTER TABLE lr.log_entries ADD CONSTRAINT log_checked CHECK (true) NOT VALID;"
    )
    holder = site.connect()
    holder.cursor().execute("SET application_name = 'idle_app'; SELECT count(*) FROM lr.log_entries")
    upgrading = site.connect()
    upgrading.cursor().execute("SET lock_timeout = '2s'")
    upgrading.commit()
    try:
        with pytest.raises(SchemaError, match=r"held throughout .*idle_app, idle in transaction.*run `lr init` again"):
            schema.migrate(upgrading, migrations=schema.available_migrations(tmp_path))
    finally:
        holder.rollback()
        holder.close()
    assert schema.current_version(upgrading) == nxt - 1
    upgrading.close()
