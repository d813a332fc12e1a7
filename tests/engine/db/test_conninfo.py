"""A site is reached the same way from a DSN, an AIRFLOW_CONN_* variable, a connections file or the hook."""

from __future__ import annotations

import json
import os

import psycopg2.extensions
import pytest
from psycopg2 import sql

from airflow_provider_lr import cli
from airflow_provider_lr.client import RoutingQueueClient
from airflow_provider_lr.engine.db import conninfo, schema
from airflow_provider_lr.engine.db.timeouts import Purpose
from airflow_provider_lr.engine.errors import ConfigurationError, SiteUnreachableError, mask_secrets, one_line
from airflow_provider_lr.engine.source import full_sync
from airflow_provider_lr.engine.tables.definition import TableName, read_definition
from tests.support.session import apply


def test_env_connection_json_and_uri_forms(monkeypatch):
    monkeypatch.setenv(
        "AIRFLOW_CONN_LR_EAST",
        json.dumps(
            {
                "conn_type": "lr_site",
                "host": "db.east",
                "port": 6432,
                "login": "lr",
                "password": "p@ss",
                "schema": "app",
                "extra": {"site_id": "east", "region": "eu", "sslmode": "require"},
            }
        ),
    )
    info = conninfo.resolve("lr_east")
    assert (info.site_id, info.region) == ("east", "eu")
    assert info.params["sslmode"] == "require" and info.params["dbname"] == "app"
    assert "p@ss" not in info.safe_dsn and "***" in info.safe_dsn

    monkeypatch.setenv("AIRFLOW_CONN_LR_WEST", "postgresql://lr:p%40ss@db.west:5433/app?site_id=west&region=us")
    west = conninfo.resolve("lr_west")
    assert west.params == {"host": "db.west", "port": 5433, "user": "lr", "password": "p@ss", "dbname": "app"}
    assert west.site_id == "west"


@pytest.mark.parametrize(
    "text",
    [
        "host=h password=SE'KRET dbname=d",  # libpq reads an unquoted value up to the next blank
        r"host=h password=SE\ KRET dbname=d",  # a backslash keeps the blank in the value
        "host=h password='SE KR\\'ET' dbname=d",
        "connection to postgresql://u:SE@KRET@h/db failed",  # an unescaped @ in a URI's password
        "postgresql://u:SE:KR@ET@h:5432/db?sslmode=require",
        "PGPASSWORD=SEKRET psql",
        '{"host": "h", "password": "SE\\"KRET"}',
        'host=h password="SE KRET" dbname=d',  # double quotes, as a user may write them: its tail showed
        "postgresql://u:SE KRET@h/db",  # an unescaped blank in a URI's password: shown whole
        "site a (host=h password=SE)KRET)",
        "site a (host=h password='SE\\' K)RET') said",
        "x [host=h password=SE:KR@ET/],",
        "connection postgresql://u:SE@KR ET@h/db failed",  # an unescaped @ before a blank: only SE was
        'could not translate host name "SE KR@ET@h" to address',  # libpq's own reading of such a URI
        'invalid integer value "SE KR@ET@h" for connection option "port"',
        "postgresql://u@srv:SEKRET@h/db",  # a user@server login, its @ unescaped: the password showed whole
        # a query parameter's name percent-encoded: libpq and lr read it decoded, a password; shown whole
        "unknown site 'postgresql://u@h/db?pass%77ord=SEKRET'",
        "postgresql://u@h/db?sslmode=require&%70assword=SE%26KRET&x=1",
        "postgresql://u@h/db?ssl%70ass%77ord=SEKRET#f",
    ],
)
def test_no_piece_of_a_password_survives_masking(text):
    """A password with a quote, an escaped blank or an unescaped @ left its tail in what lr printed."""
    masked = mask_secrets(text)
    assert "***" in masked and not any(piece in masked for piece in ("SE", "KR", "ET")), masked


@pytest.mark.parametrize(
    "text, shown",
    [
        ("site a (host=h password=SEKRET) refused", "site a (host=h password=***) refused"),
        ("site a (host=h password=SE)KRET): refused", "site a (host=h password=***): refused"),
        ("'host=h password=SEKRET' is not valid", "'host=h password=***' is not valid"),
        ("[host=h password=SEKRET], then", "[host=h password=***], then"),
        ("(host=h password=)", "(host=h password=***)"),
        ("(postgresql://u:SE)KRET@h/db)", "(postgresql://u:***@h/db)"),
        ("host=h password=SEKRET)", "host=h password=***"),  # no parenthesis opened: it may be the password's
    ],
)
def test_masking_keeps_the_parenthesis_or_quote_the_text_closes_after_a_password(text, shown):
    """An unquoted password runs to the next blank: the mask swallowed the ``)`` (or quote, or
    bracket) closing the text around the DSN, and a message read ``(host=h password=***`` then on."""
    assert mask_secrets(text) == shown


def test_unknown_target_names_the_fixes(monkeypatch, tmp_path):
    monkeypatch.setenv("LR_CONNECTIONS_FILE", str(tmp_path / "none.json"))
    with pytest.raises(ConfigurationError, match="AIRFLOW_CONN_NOPE"):
        conninfo.resolve("nope")


def test_a_connections_file_with_passwords_that_others_can_read_is_warned_of_once(monkeypatch, tmp_path, caplog):
    """libpq ignores a .pgpass others can read; lr read such a connections file without a word."""
    path = tmp_path / "connections.json"
    path.write_text(json.dumps({"lr_a": "postgresql://lr:SEKRET@h/app", "lr_b": "postgresql://lr@h/app"}))
    monkeypatch.setenv("LR_CONNECTIONS_FILE", str(path))
    path.chmod(0o644)
    with caplog.at_level("WARNING", logger="airflow_provider_lr.engine.db.conninfo"):
        assert conninfo.resolve("lr_a").params["password"] == "SEKRET"  # still read, as Airflow does
        conninfo.resolve("lr_b")
    warned = [r.getMessage() for r in caplog.records if "connections file" in r.getMessage()]
    assert len(warned) == 1 and f"chmod 600 {path}" in warned[0] and "0644" in warned[0], warned
    assert "SEKRET" not in warned[0]
    caplog.clear()
    path.chmod(0o600)  # the owner's alone: nothing to say; nor of a file without passwords
    conninfo.resolve("lr_a")
    path.write_text(json.dumps({"lr_b": "postgresql://lr@h/app"}))
    path.chmod(0o666)
    conninfo.resolve("lr_b")
    assert not [r for r in caplog.records if "connections file" in r.getMessage()]


@pytest.mark.parametrize("option", ["require_auth=bogus", "sslmode=requier", "gssencmode=sometimes"])
def test_an_option_value_libpq_refuses_is_the_connections_mistake_not_a_server_down(option):
    """libpq refuses it before the network, at every try: it said "is the server up?" (a
    SiteUnreachableError, which lr sync retries for as long as it runs)."""
    with pytest.raises(ConfigurationError, match=option.split("=")[0]):
        conninfo.from_dsn(f"host=127.0.0.1 port=1 {option}").connect()


def test_hook_resolves_env_connection_to_a_real_site(lr_sites, monkeypatch):
    from airflow_provider_lr.hooks.site import LRSiteHook

    site = lr_sites[1]
    monkeypatch.setenv("AIRFLOW_CONN_LR_HOOKED", json.dumps(site.server.airflow_conn(site.dbname)))
    hook = LRSiteHook(lr_conn_id="lr_hooked")
    assert hook.get_conninfo().site_id == site.site_id
    conn = hook.get_conn()
    assert schema.site_identity(conn)[0] == site.site_id
    conn.close()
    ok, message = hook.test_connection()
    assert ok and "lr schema version" in message


def test_lrs_connections_search_pg_catalog_alone_and_a_provider_resolves_through_the_sites_path(lr_sites):
    """lr's own connection searches pg_catalog alone (a lookalike of another schema of the site's path
    cannot stand in for a built-in); a full-sync provider it runs, the application's code, reads its
    table unqualified through the site's path, as on a connection of its own; lr's statements after
    it search pg_catalog again."""
    site = lr_sites[0]
    apply(lr_sites)
    site.query("CREATE SCHEMA app; CREATE TABLE app.things (v text); INSERT INTO app.things VALUES ('thing')")
    site.query(f'ALTER DATABASE "{site.dbname}" SET search_path = app, pg_catalog, public')
    conn = conninfo.from_dsn(site.dsn).connect()
    seen = []

    def provider(ctx) -> None:
        with ctx.conn.cursor() as cur:
            cur.execute("SELECT v FROM things")  # the application's own name, unqualified
            seen.extend(cur.fetchall())
            cur.execute("SHOW search_path")
            seen.extend(cur.fetchall())
        ctx.transmit(b"thing")

    try:
        assert conn.site_path == "app, public"
        full_sync.request_full_sync(conn, "site-b", "policy", "a test")
        conn.commit()
        assert RoutingQueueClient(conn, "policy").serve_full_sync_requests(provider) != []
        assert seen == [("thing",), ("app, public",)]
        with conn.cursor() as cur:
            cur.execute("SHOW search_path")
            assert cur.fetchone() == ("pg_catalog",)
    finally:
        conn.close()


def test_lrs_connections_read_names_as_every_site_prints_them_whatever_the_sites_defaults(sites):
    """A site whose default is ``quote_all_identifiers = on`` prints ``"text"`` where the others print
    ``text``, and one whose sessions take ``LATIN1`` cannot send a column named ``✓``: lr's
    connections set the one off and talk UTF8 (a DSN's ``client_encoding`` too, which is the
    application's), so a federated table's shape read from that site's catalog (compared with another
    site's) is as every site prints it; the application's connections keep the site's settings."""
    site = sites[0]
    site.query('CREATE TABLE public.quoted_types (id int PRIMARY KEY, t text, "✓" int)')
    site.query(f'ALTER DATABASE "{site.dbname}" SET quote_all_identifiers = on')
    site.query(f"ALTER DATABASE \"{site.dbname}\" SET client_encoding = 'LATIN1'")
    site.query(f'ALTER DATABASE "{site.dbname}" SET xmloption = document')  # a sink refused xml fragments
    info = conninfo.from_dsn(site.dsn)
    lr_conn, app = info.connect(), info.connect(Purpose.APPLICATION)
    given = conninfo.from_dsn(f"{site.dsn} client_encoding=LATIN1").connect()  # the DSN's is the application's
    optioned = conninfo.from_dsn(f"{site.dsn} options='-c client_encoding=LATIN1'").connect()
    try:
        for conn in (lr_conn, given, optioned):
            with conn.cursor() as cur:
                found = read_definition(cur, TableName.parse("public.quoted_types"))
                assert sql.Identifier("✓").as_string(cur) == '"✓"'  # LATIN1: psycopg2 composed '"â\x9c\x93"'
            assert found is not None and [(c.name, c.type) for c in found.columns] == [
                ("id", "integer"),
                ("t", "text"),
                ("✓", "integer"),
            ]
        with lr_conn.cursor() as cur:  # xml read as any site takes it (the test servers have no libxml to parse it)
            cur.execute("SHOW xmloption")
            assert cur.fetchone() == ("content",)
        with app.cursor() as cur:
            cur.execute("SHOW quote_all_identifiers")
            assert cur.fetchone() == ("on",)
            cur.execute("SHOW xmloption")
            assert cur.fetchone() == ("document",)
            assert app.encoding == "LATIN1"
    finally:
        lr_conn.close()
        app.close()
        given.close()
        optioned.close()


def test_a_server_whose_connection_slots_are_all_taken_is_said_to_be_full_not_down(lr_sites):
    """A connect the server refused for want of a slot (its max_connections, or a role's or
    database's CONNECTION LIMIT: here a role's, the same refusal): lr said "is the server up?" of a
    server that was up, and `lr status` and `lr sync` repeated it for every session of the site."""
    site = lr_sites[1]
    role = f"lr_no_slot_{os.getpid()}"
    site.query(
        sql.SQL("CREATE ROLE {} LOGIN CONNECTION LIMIT 0").format(sql.Identifier(role)).as_string(site.connect())
    )
    try:
        info = conninfo.from_dsn(psycopg2.extensions.make_dsn(site.dsn, user=role))
        with pytest.raises(SiteUnreachableError) as refused:
            info.connect()
        said = str(refused.value)
        assert "too many connections for role" in said, said
        assert "connections are all taken" in said and "pg_stat_activity" in said, said
        assert "is the server up" not in said, said
    finally:
        site.query(f'DROP ROLE "{role}"')


def test_a_dsn_whose_password_holds_an_unquoted_blank_is_refused_without_its_tail():
    """libpq refuses ``password=my secret`` naming the word after the blank (``missing "=" after
    "secret"``): the password's tail reached lr's one-line errors, though the DSN itself was masked."""
    with pytest.raises(psycopg2.Error) as refused:
        psycopg2.connect("host=127.0.0.1 port=1 password=my secret")
    said = one_line(refused.value)
    assert "secret" in str(refused.value) and "secret" not in said and 'missing "=" after "***"' in said, said


@pytest.mark.parametrize(
    "uri",
    [
        "postgresql://u:SE@KR ET@127.0.0.1:1/db",
        "postgresql://u:SE@KR@ET@127.0.0.1:1/db",
        "postgresql://u:S@E:K RET@h/db",
    ],
)
def test_libpq_reading_a_uri_whose_password_holds_an_at_names_no_piece_of_it(uri):
    """libpq ends a URI's user part at the password's first unescaped ``@``: the rest of the password
    became the host (or port) its refusal quotes (``could not translate host name "KR ET@127.0.0.1"``),
    and lr's one-line errors showed it."""
    with pytest.raises(psycopg2.Error) as refused:
        psycopg2.connect(uri, connect_timeout=5)
    said = one_line(refused.value)
    assert "@" in str(refused.value) and not any(p in said for p in ("SE", "KR", "ET")), said


@pytest.mark.parametrize(
    "dsn, refused",
    [
        ("postgresql://u:SE/KR@ET@h/db", "is not a valid URI"),  # the host would be "SE", the database "KR@ET@h/db"
        ("postgresql://u:SE?KR@ET@h/db", "is not a valid URI"),
        ("postgresql://u:SE#KR@ET@h/db", "is not a valid URI"),
        ("dbname='postgresql://u:SE@KR ET@h/db'", "holds a connection string"),  # libpq reads it by its own rules
        ("host=h dbname='user=u password=SEKRET'", "holds a connection string"),
    ],
)
def test_a_connection_that_would_quote_a_piece_of_its_password_is_refused_before_any_connect(dsn, refused):
    """A password cut by an unescaped ``/``, ``?`` or ``#`` left its pieces as the host, database or
    options every message quoted; a database name holding a connection string was read by libpq,
    whose refusal quoted the password's tail as the host."""
    with pytest.raises(ConfigurationError) as error:
        conninfo.from_dsn(dsn).connect()
    said = one_line(error.value)
    assert refused in said and not any(p in said for p in ("SE", "KR", "ET")), said


def test_a_uri_password_under_a_percent_encoded_name_is_read_as_one_and_never_shown(capsys):
    """libpq reads a URI's query parameter names percent-decoded, and so does lr (``from_uri``):
    ``?pass%77ord=...`` is the connection's password. Every message quoting such a URI showed it whole
    (``lr tables list --site <uri>``: ``unknown site '...?pass%77ord=<the password>'``); the other
    parameters stay as they were."""
    uri = "postgresql://u@db.example/app?applic%61tion_name=kept&pass%77ord=SEKRET"
    assert psycopg2.extensions.parse_dsn(uri)["password"] == "SEKRET" == conninfo.from_dsn(uri).params["password"]
    assert mask_secrets(f"unknown site {uri!r}") == (
        "unknown site 'postgresql://u@db.example/app?applic%61tion_name=kept&pass%77ord=***'"
    )
    assert cli.main(["tables", "list", "--site", uri]) != 0
    said = capsys.readouterr()
    assert "pass%77ord=***" in said.err and "SEKRET" not in said.out + said.err, said
