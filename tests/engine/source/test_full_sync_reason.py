"""A full sync's reason, the user's text, stored whatever the source database's encoding."""

from __future__ import annotations

import psycopg2

from airflow_provider_lr.engine.db import conninfo, schema
from airflow_provider_lr.engine.db.timeouts import Purpose
from airflow_provider_lr.engine.site import status
from airflow_provider_lr.engine.source import full_sync
from airflow_provider_lr.engine.store import topology as topologies
from airflow_provider_lr.engine.vocabulary import SessionKey
from tests.conftest import TestSite, create_database, drop_database
from tests.support.session import apply_to, topology_doc


def test_a_reason_with_characters_the_source_database_lacks_is_stored_escaped(sites):
    """`lr full-sync --reason 'price in €'` on a LATIN1 source: the server's own error leaked
    (UntranslatableCharacter: 'character with byte sequence 0xe2 0x82 0xac in encoding "UTF8" has no
    equivalent in encoding "LATIN1"'), and on a caller's plain connection (its client encoding the
    database's) psycopg2 could not even encode it. Now the reason is stored as lr stores its own
    text there, each character the site lacks as its escape (``encoding.storable``)."""
    encoding = "LATIN1"
    site = TestSite(sites[0].server, f"{sites[0].dbname}_{encoding.lower()}")
    create_database(site.server, site.dbname, encoding=encoding)
    try:
        conn = conninfo.from_dsn(site.dsn).connect(Purpose.BULK)
        schema.init_site(conn, "site-a", "eu")
        conn.close()
        apply_to([site], topologies.from_document(topology_doc([site, sites[1]])))
        key = SessionKey("site-a", "site-b", "policy")
        made = full_sync.request_for_sessions([key], lambda _: conninfo.from_dsn(site.dsn).connect(), "price in € …")
        plain = psycopg2.connect(site.dsn)  # an engine API caller's: the database's client encoding
        try:
            again = full_sync.request_full_sync(plain, "site-b", "policy", "again: €")
            said = status.render(status.site_status(plain))
        finally:
            plain.close()
        assert made[key].reason == "price in \\u20ac \\u2026" and again.reason == "again: \\u20ac"
        assert again.reason in said, said
    finally:
        drop_database(site.server, site.dbname)


def test_a_long_failure_noted_on_a_request_is_cut_to_fit_the_bound_the_database_keeps(lr_sites):
    """A request's note is bounded by the database (64 KiB, V0046, against a writer's own SQL);
    lr's own notes (a failure's text, which may quote a long error) are cut to ``NOTE_CHARS`` so that
    closing the request never fails on that bound."""
    source = lr_sites[0]
    apply_to(lr_sites, topologies.from_document(topology_doc(lr_sites)))
    conn = source.connect()
    try:
        request = full_sync.request_full_sync(conn, "site-b", "policy", "test")
        assert full_sync.finish_request(conn, request.request_id, "cancelled", "failed: " + "x" * 100_000)
        assert (
            full_sync.get_request(conn, request.request_id).note == ("failed: " + "x" * 100_000)[: full_sync.NOTE_CHARS]
        )
    finally:
        conn.close()
