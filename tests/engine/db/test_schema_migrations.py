"""lr init: versioned migrations install the schema, re-run as a no-op, and upgrade in place."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from airflow_provider_lr.engine.db import conninfo, schema
from airflow_provider_lr.engine.errors import SchemaError


def copy_shipped(directory: Path) -> int:
    """Copy the shipped migrations into ``directory``; returns the next free version."""
    shipped = schema.available_migrations()
    for migration in shipped:
        (directory / f"V{migration.version:04d}__{migration.name}.sql").write_text(migration.sql)
    return shipped[-1].version + 1


def tables(site) -> set[str]:
    return {r[0] for r in site.query("SELECT tablename FROM pg_tables WHERE schemaname = 'lr'")}


def test_fresh_database_gets_every_shipped_migration(sites):
    site = sites[0]
    conn = site.connect()
    assert schema.current_version(conn) == 0
    result = schema.init_site(conn, "site-a", "eu")
    latest = schema.available_migrations()[-1].version
    assert result.applied == list(range(1, latest + 1))
    assert schema.current_version(conn) == latest
    assert schema.site_identity(conn) == ("site-a", "eu")
    assert {"schema_migrations", "site_info", "registry"} <= tables(site)
    conn.close()


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


def test_lr_installs_on_a_latin1_database_and_a_site_that_took_v41_as_released_upgrades(sites):
    """A server's encoding other than UTF8 cannot take every character: the statement of a migration
    with one (V0041's comment named the euro sign) failed `lr init` there. Every migration is ASCII;
    V0041's text changed in its comment only, so the checksum it was released with is still its own."""
    assert [m.name for m in schema.available_migrations() if not m.sql.isascii()] == []
    server, name = sites[0].server, f"{sites[0].dbname}_latin1"
    admin = sites[0].connect()
    admin.autocommit = True
    with admin.cursor() as cur:
        cur.execute(f"CREATE DATABASE {name} ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0")
    try:
        conn = conninfo.from_dsn(server.dsn(name)).connect()  # as lr init connects: client_encoding UTF8
        schema.init_site(conn, "site-a")
        with conn.cursor() as cur:  # a site migrated with V0041 as released: its init is a no-op
            cur.execute("UPDATE lr.schema_migrations SET checksum = %s WHERE version = 41", schema._RELEASED_AS[41])
        conn.commit()
        assert schema.init_site(conn, "site-a").applied == []
        conn.close()
    finally:
        with admin.cursor() as cur:
            cur.execute(f"DROP DATABASE {name} WITH (FORCE)")
        admin.close()


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
