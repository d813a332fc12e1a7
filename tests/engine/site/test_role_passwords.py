"""A password given to `lr roles grant --create` reaches no server as text: the server logs a failing
statement's text (``log_min_error_statement``, on by default) and, with ``log_statement``, every DDL,
to files its administrators and log shippers read. lr sends the password's verifier, computed by
libpq as psql's ``\\password`` does."""

from __future__ import annotations

import base64
import hashlib
import hmac
from pathlib import Path

from airflow_provider_lr import cli
from tests.engine.site.test_roles import info_as, made  # noqa: F401 (fixture)

PASSWORD = "Pw-in-no-log-7f3a"


def server_log(site) -> Path:
    """The embedded server's log (``SiteManager`` starts it beside its data directory)."""
    return Path(site.query("SHOW data_directory")[0][0]).parent / "postgres.log"


def scram_matches(verifier: str, password: str) -> bool:
    """Whether a SCRAM-SHA-256 verifier (RFC 5802, PostgreSQL's ``rolpassword``) is one of ``password``."""
    method, rest = verifier.split("$", 1)
    iterations_salt, keys = rest.split("$")
    iterations, salt = iterations_salt.split(":")
    stored = keys.split(":")[0]
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), base64.b64decode(salt), int(iterations))
    client_key = hmac.new(salted, b"Client Key", hashlib.sha256).digest()
    return method == "SCRAM-SHA-256" and hashlib.sha256(client_key).digest() == base64.b64decode(stored)


def test_a_password_given_to_lr_roles_is_in_no_server_log_and_logs_the_role_in(lr_sites, made, capsys, monkeypatch):
    site = lr_sites[0]
    log = server_log(site)
    start = log.stat().st_size
    monkeypatch.setenv("LR_TEST_PASSWORD", PASSWORD)
    # a grant by a login that may not create roles: the server refuses the CREATE ROLE and logs it
    weak, role = made.name("weak"), made.name("repl")
    made.grant(site, "replicator", weak)  # reads the site's schema, may not create roles
    grant = ["roles", "grant", "replicator", "--role", role, "--create", "--password-env", "LR_TEST_PASSWORD"]
    assert cli.main([*grant, "--site", info_as(site, weak).dsn]) == 1
    assert "may not change roles" in capsys.readouterr().err
    # and one that creates it: the server logs its DDL (this test's database only)
    site.query(f"ALTER DATABASE \"{site.dbname}\" SET log_statement = 'ddl'")
    assert cli.main([*grant, "--site", site.dsn]) == 0
    printed = capsys.readouterr()
    with log.open("rb") as file:
        file.seek(start)
        written = file.read().decode(errors="replace")
    assert f'CREATE ROLE "{role}" LOGIN PASSWORD' in written  # both statements reached the log
    assert PASSWORD not in written and PASSWORD not in printed.out + printed.err
    # the role logs in with that password: its stored verifier is one of it
    (stored,) = site.query("SELECT rolpassword FROM pg_authid WHERE rolname = %s", (role,))[0]
    assert scram_matches(stored, PASSWORD), stored
    assert not scram_matches(stored, PASSWORD + "x")


def test_an_empty_password_is_refused_not_a_role_without_one(lr_sites, made, capsys, monkeypatch):
    """PostgreSQL takes ``PASSWORD ''`` as no password (a NOTICE lr did not show): the role was made
    without one, where the user meant it to have one."""
    site = lr_sites[0]
    role = made.name("repl")
    monkeypatch.setenv("LR_TEST_PASSWORD", "")
    args = ["roles", "grant", "replicator", "--role", role, "--create", "--password-env", "LR_TEST_PASSWORD"]
    assert cli.main([*args, "--site", site.dsn]) == 1
    assert "is empty" in capsys.readouterr().err
    assert site.query("SELECT count(*) FROM pg_roles WHERE rolname = %s", (role,)) == [(0,)]
