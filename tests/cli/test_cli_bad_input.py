"""Bad input through the `lr` CLI, as a user types it: each refused with one line that says why,
exit 1, no traceback, and nothing half-written on any site."""

from __future__ import annotations

import json
import logging

import pytest
import yaml

from airflow_provider_lr import cli
from tests.cli.test_cli_sync import topology_file
from tests.support.session import topology_doc

# Tables the statement-level capture triggers cannot follow whole (a write to a partition or an
# inheritance child fires only the triggers of the table it names), or that are not an application's.
NOT_CAPTURABLE = {
    "public.measures": "partitioned or a partition",
    "public.measures_2026": "partitioned or a partition",
    "public.animals": "inheritance parents or children",
    "public.cats": "inheritance parents or children",
    "public.animal_names": "not an ordinary table",
    "lr.log_entries": "lr's own tables",
    "lr.source_sessions": "lr's own tables",
    "pg_catalog.pg_class": "the system's own tables",
    "information_schema.tables": "the system's own tables",
}


def test_a_table_whose_changes_capture_would_miss_or_that_is_lrs_own_is_refused(
    lr_sites, tmp_path, monkeypatch, capsys
):
    """Federating a partitioned table used to be accepted and lose every write made straight to a
    partition while `lr status` called the sinks consistent; lr's own log was accepted too (each
    entry then captured into the log again)."""
    source = lr_sites[0]
    topo = topology_file(tmp_path, lr_sites, monkeypatch, providers={})
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    source.query(
        "CREATE TABLE public.measures (id int, d date, PRIMARY KEY (id, d)) PARTITION BY RANGE (d); "
        "CREATE TABLE public.measures_2026 PARTITION OF public.measures FOR VALUES FROM ('2026-01-01') TO ('2027-01-01'); "
        "CREATE TABLE public.animals (id int PRIMARY KEY, name text); "
        "CREATE TABLE public.cats (PRIMARY KEY (id)) INHERITS (public.animals); "
        "CREATE VIEW public.animal_names AS SELECT id, name FROM public.animals"
    )
    for table, why in NOT_CAPTURABLE.items():
        capsys.readouterr()
        assert cli.main(["tables", "open", table, "--client", "policy", "--topology", topo]) == 1, table
        err = capsys.readouterr().err
        assert f"lr: site-a: table {table} cannot be federated: " in err and why in err, err
        assert len(err.strip().splitlines()) == 1, err
    assert source.query("SELECT count(*) FROM lr.registry WHERE kind = 'table'") == [(0,)]
    assert source.query("SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'lr\\_capture\\_%%'") == [(0,)]


def test_a_step_a_site_refuses_is_said_on_one_line_naming_the_site_not_as_a_traceback(
    lr_sites, tmp_path, monkeypatch, capsys
):
    """`lr tables open` while an application's transaction writes the table (its lock is held),
    `lr trim` while lr's own table is locked: the lock timeout fires and the command says so on one
    line naming the site (it used to end in a psycopg2 traceback), with nothing half-written; `lr
    status` shows the site and says which part it could not read and who holds the lock (it said
    the whole site "unreachable", then "unreadable")."""
    source = lr_sites[0]
    topo = topology_file(tmp_path, lr_sites, monkeypatch, providers={})
    text = open(topo).read().replace("settings: {}", "settings: {lock_timeout_s: 1}")
    open(topo, "w").write(text)
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    source.query("CREATE TABLE public.items (id int PRIMARY KEY, v text)")
    app = source.connect()
    with app.cursor() as cur:
        cur.execute("INSERT INTO public.items VALUES (1, 'in flight')")  # left open: its lock is held
        for command in (["tables", "open", "public.items", "--client", "policy"], ["trim"]):
            if command == ["trim"]:
                cur.execute("LOCK TABLE lr.source_sessions IN ACCESS EXCLUSIVE MODE")
            capsys.readouterr()
            assert cli.main([*command, "--topology", topo]) == 1, command
            err = capsys.readouterr().err
            assert err.startswith("lr: site-a: a lock lr needs is held by another transaction (lock_timeout)"), err
            assert len(err.strip().splitlines()) == 1 and "LINE" not in err, err
        capsys.readouterr()  # lr status: the site is shown, the part its locked table holds said not read
        assert cli.main(["status", "--topology", topo]) == 1
        out = capsys.readouterr().out
        locked = f"sessions not read: lr.source_sessions is locked by pid {app.info.backend_pid} (AccessExclusiveLock)"
        assert f"\n  {locked}" in out and f"health: degraded\n  site-a: {locked}" in out, out
        assert "UNREADABLE" not in out and "unreachable" not in out and "LINE" not in out, out
    app.rollback()
    assert source.query("SELECT count(*) FROM lr.registry WHERE kind = 'table'") == [(0,)]
    assert cli.main(["tables", "open", "public.items", "--client", "policy", "--topology", topo]) == 0
    app.close()


def test_the_pre_failover_file_applied_again_is_refused_and_the_sites_keep_the_failovers_topology(
    lr_sites, tmp_path, monkeypatch, capsys
):
    """After `lr failover`, every command refuses the old file and advises applying it if it is the
    current one; applying it used to be accepted: site-a the source of its clients again, its
    writers accepted, and each of their entries refused for good by the sinks (whose sessions from
    site-a the failover closed) while `lr status` said healthy."""
    site_a, site_b, site_c = lr_sites
    topo = topology_file(tmp_path, lr_sites, monkeypatch, providers={"policy": "tests.support.session:empty_provider"})
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    assert cli.main(["sync", "--topology", topo, "--until-idle", "--cycles", "10", "--interval", "0.01"]) == 0
    new = tmp_path / "after.yaml"
    assert cli.main(["failover", "--topology", topo, "--promote", "site-b", "--out", str(new)]) == 0
    held = [site.query("SELECT topology_config_id FROM lr.topology") for site in lr_sites]
    capsys.readouterr()

    assert cli.main(["topology", "apply", "--topology", topo]) == 1
    err = capsys.readouterr().err
    assert "session site-a->site-c/policy was failed over to site-b" in err, err
    assert "nothing was applied on any site" in err and len(err.strip().splitlines()) == 1, err
    assert [site.query("SELECT topology_config_id FROM lr.topology") for site in lr_sites] == held
    assert cli.main(["topology", "apply", "--topology", str(new)]) == 0  # the failover's own file, again


def test_a_malformed_connections_file_or_connection_is_named_on_one_line_not_a_traceback(tmp_path, monkeypatch, capsys):
    """Each of these raised a raw JSONDecodeError or AttributeError out of `lr` (a traceback, or
    `'list' object has no attribute 'items'` as a site's status): the file or variable is named, and
    what it should be."""
    conns = tmp_path / "connections.json"
    monkeypatch.setenv("LR_CONNECTIONS_FILE", str(conns))
    for text, message in [
        ("{bad json", f"connections file {conns} is not valid JSON: Expecting property name"),
        ("[1, 2]", f"connections file {conns} must be a JSON object of connection id -> connection, not list"),
        ('{"lr_a": 5}', "connection 'lr_a' must be a JSON object (conn_type, host, port, login, password, schema"),
        ('{"lr_a": {"host": "h", "extra": "{bad"}}', "the extra of connection 'lr_a' is not valid JSON"),
        ('{"lr_a": {"host": "h", "extra": [1]}}', "the extra of connection 'lr_a' must be a JSON object, not list"),
        ('{"lr_a": "postgres://h/db?__extra__=%7Bx"}', "the __extra__ of connection 'lr_a' is not valid JSON"),
    ]:
        conns.write_text(text)
        assert cli.main(["init", "--site", "lr_a"]) == 2, text  # the connection the user named: input, exit 2
        assert message in capsys.readouterr().err, text
    monkeypatch.setenv("AIRFLOW_CONN_LR_B", "{not json")
    assert cli.main(["init", "--site", "lr_b"]) == 2
    assert "AIRFLOW_CONN_LR_B is not valid JSON" in capsys.readouterr().err


def test_a_password_given_to_lr_is_never_printed_whatever_is_wrong(tmp_path, monkeypatch, capsys):
    """argparse quoted a refused `--site host=... password=...` whole; a URI's bad `__extra__` quoted
    the URI; a bad port or a DSN libpq cannot parse raised a traceback (or quoted a piece of the
    password). Each is now one line, with the password masked or left out."""
    monkeypatch.setenv("LR_CONNECTIONS_FILE", str(tmp_path / "none.json"))
    monkeypatch.setenv("AIRFLOW_CONN_LR_X", "postgresql://u:SEKRET@127.0.0.1:1/db?connect_timeout=x")
    for argv, code, said in [
        (["status", "--site", "host=h password=SEKRET"], 2, "unrecognized arguments: --site host=h password=***"),
        (["trim", "--retention", "postgresql://u:SEKRET@h/db"], 2, "'postgresql://u:***@h/db' is not a number"),
        # a DSN or connection that cannot be parsed is the user's input: exit 2 (it was 1, as a server's refusal)
        (["init", "--site", "postgresql://u:SEKRET@h/db?__extra__=x"], 2, "'postgresql://u:***@h/db?__extra__=x'"),
        (["init", "--site", "postgresql://u:SEKRET@h:99999/db"], 2, "has an invalid port: give a number from 1"),
        (["init", "--site", "host=h password=SEK RET"], 2, 'the DSN given is not valid (missing "=" after a word'),
        (["init", "--site", "lr_x", "--site-id", "a"], 2, "has an invalid connect_timeout 'x': give a number"),
        # an option libpq does not know: psycopg2's ProgrammingError, exit 1
        (["roles", "list", "--site", "postgresql://u:SEKRET@h/db?bogus=1"], 2, 'invalid connection option "bogus"'),
        (["init", "--site", "host=h port=5432,x password=SEKRET"], 2, "has an invalid port '5432,x'"),
        # a URI whose password has an unescaped '/' (libpq reads host:port there): printed whole, unwarned;
        # then its piece after the '/' was the database name (or the host) every message quoted
        (["init", "--site", "postgresql://u:SEK/RET@127.0.0.1:1/db", "--site-id", "a"], 2, "percent-encode them"),
        (["init", "--site", "postgresql://u:S@EK/R ET@127.0.0.1:1/db", "--site-id", "a"], 2, "is not a valid URI"),
        (["init", "--site", "postgresql://u:SEK#RET@127.0.0.1:1/db", "--site-id", "a"], 2, "(%2F, %3F, %23, %40)"),
        # a database name libpq reads as a URI of its own: the password's tail was the host it quoted
        (["init", "--site", "dbname='postgresql://u:S@EK RET@h/db'", "--site-id", "a"], 2, "holds a connection string"),
        # an unescaped '@' and a blank: lr's own reading of the URI finds the host after the last '@'
        (["init", "--site", "postgresql://u:S@EK RET@127.0.0.1:1/db", "--site-id", "a"], 1, "password=***"),
        # a value libpq refuses before any network: exit 1 saying "is the server up?" (and lr sync retried it)
        (
            ["init", "--site", "host=127.0.0.1 port=1 sslmode=requier password=SEKRET", "--site-id", "a"],
            2,
            "invalid sslmode 'requier': give one of",
        ),
        *[
            (
                ["roles", "list", "--site", f"postgresql://u:SEKRET@127.0.0.1:1/db?{option}=bogus"],
                2,
                f"invalid {option} 'bogus'",
            )
            for option in ("target_session_attrs", "gssencmode", "channel_binding", "load_balance_hosts")
        ],
        # an empty or blank site: "unknown site or connection '': ... set AIRFLOW_CONN_, ..."
        (["init", "--site", ""], 2, "the site or connection given is empty (''): give a DSN"),
        (["init", "--site", "   "], 2, "the site or connection given is empty ('   ')"),
        # a server that does not answer is not: exit 1
        (["init", "--site", "host=127.0.0.1 port=1 password=SEKRET", "--site-id", "a"], 1, "password=***"),
    ]:
        try:
            assert cli.main(argv) == code, argv
        except SystemExit as exit_:  # argparse's refusals
            assert exit_.code == code, argv
        out, err = capsys.readouterr()
        assert said in err.strip().splitlines()[-1], (argv, err)  # the last line: argparse prints its usage first
        assert "SEKRET" not in out + err and "RET" not in err.replace("SEKRET", "") and "Traceback" not in err, err


def test_a_password_on_the_command_line_is_warned_of_and_a_dsn_without_one_is_not(tmp_path, monkeypatch, capsys):
    """`lr init --site "... password=..."` put the password where every local user reads it (`ps`,
    /proc/<pid>/cmdline) for as long as lr ran, and nothing said so; lr now warns, naming the
    places a password belongs (libpq's PGPASSWORD or ~/.pgpass, a connection)."""
    monkeypatch.setenv("LR_CONNECTIONS_FILE", str(tmp_path / "none.json"))
    for dsn, warned in [
        ("host=127.0.0.1 port=1 user=x password=SEKRET", True),
        ("postgresql://x:SEKRET@127.0.0.1:1/db", True),
        ("host=127.0.0.1 port=1 user=x", False),
        ("postgresql://127.0.0.1:1/db?application_name=me@there", False),
    ]:
        assert cli.main(["init", "--site", dsn, "--site-id", "a"]) == 1
        err = capsys.readouterr().err
        assert ("seen by every local user (`ps`" in err) is warned and "SEKRET" not in err, err
    for dsn in ("postgresql://x:SEK/RET@127.0.0.1:1/db", "postgresql://x:SEK/RET@127.0.0.1:1/db?sslmode=x@"):
        assert cli.main(["init", "--site", dsn, "--site-id", "a"]) == 2  # libpq cannot read it: still warned
        err = capsys.readouterr().err
        assert "seen by every local user (`ps`" in err and "RET" not in err, err


def test_commands_run_before_lr_init_say_to_run_it_once_not_a_missing_relation_every_cycle(
    sites, tmp_path, monkeypatch, capsys, caplog
):
    """A new user's commonest slip: `lr sites up`, then a command before `lr init`. `lr full-sync`
    and `lr tables open` said `UndefinedTable: relation "lr.source_sessions" does not exist`, and
    `lr sync` logged the in-process fan-out's SQL error (its statement's text included) on every
    cycle, one line every cycle for as long as it ran, beside the session's own `run lr init`."""
    topo = topology_file(tmp_path, sites, monkeypatch, providers={})
    assert cli.main(["status", "--topology", topo]) == 1
    out = capsys.readouterr().out  # it said "lr schema v0 is older than this lr's v28"
    assert "site-a: no lr schema: lr replicates nothing with it; run `lr init` on the site" in out, out
    for command in (["full-sync"], ["tables", "open", "public.items", "--client", "policy"], ["trim"]):
        capsys.readouterr()
        assert cli.main([*command, "--topology", topo]) == 1, command
        err = capsys.readouterr().err
        assert err.startswith("lr: site-a: ") and "run `lr init`" in err, err
        assert len(err.strip().splitlines()) == 1 and "LINE" not in err, err
    caplog.set_level(logging.INFO, logger="airflow_provider_lr")
    rc = cli.main(["sync", "--topology", topo, "--until-idle", "--give-up-after", "1", "--interval", "0.01"])
    assert rc == 1
    fanout = [r.getMessage() for r in caplog.records if "fan-out" in r.getMessage()]
    assert len(fanout) <= 1 and not any("LINE" in m for m in fanout), fanout
    assert "has no lr schema; run `lr init` on it first" in capsys.readouterr().out


def test_lr_trim_on_a_site_without_lr_reached_by_a_dsn_names_the_site(sites, tmp_path, capsys):
    """A topology whose conn_id is a DSN (no connection id to name it by): `lr trim` before `lr init`
    said `lr: the site has no lr schema ...: run lr init on it` without saying which site."""
    doc = topology_doc(sites, conn_ids=lambda site_id: next(s.dsn for s in sites if s.site_id == site_id))
    path = tmp_path / "dsn-topology.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert cli.main(["trim", "--topology", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("lr: site-a: the site has no lr schema") and "run `lr init`" in err, err
    assert len(err.strip().splitlines()) == 1 and "LINE" not in err, err


def test_a_malformed_connections_file_is_the_users_input_exit_2_from_every_command_reading_the_topology(
    tmp_path, monkeypatch, capsys, caplog
):
    """`lr init --site` said exit 2 for it, but `lr topology apply`, `full-sync`, `trim` and `failover`
    exited 1, as for a site's refusal; `lr sync --once` (and `lr sync`) said it on two lines, the
    first as the in-process fan-out's reason not to run."""
    (tmp_path / "connections.json").write_text('{"lr_site_a": ')
    topo = tmp_path / "topology.yaml"
    topo.write_text(
        "sites:\n  - {id: site-a, conn_id: lr_site_a}\n  - {id: site-b, conn_id: lr_site_b}\n"
        "replication:\n  - {source: site-a, sinks: [site-b], clients: [policy]}\n"
    )
    monkeypatch.setenv("LR_HOME", str(tmp_path))
    for command in (
        ["topology", "apply"],
        ["full-sync"],
        ["trim"],
        ["failover", "--promote", "site-b"],
        ["sync", "--once"],
        ["sync", "--until-idle"],
    ):
        capsys.readouterr()
        caplog.clear()
        caplog.set_level(logging.INFO, logger="airflow_provider_lr")
        assert cli.main([*command, "--topology", str(topo)]) == 2, command
        err = [line for line in capsys.readouterr().err.splitlines() if "warning" not in line]
        # what lr logs from INFO up is on `lr`'s stderr too ("lr: ..."): under pytest, in caplog
        err += [r.getMessage() for r in caplog.records if r.name.startswith("airflow_provider_lr")]
        assert len(err) == 1 and f"connections file {tmp_path / 'connections.json'} is not valid JSON" in err[0], err


def test_options_that_do_not_go_together_are_usage_errors_exit_2_before_any_site_is_touched(
    tmp_path, monkeypatch, capsys
):
    """`lr roles grant --create` without a password option, `--password-env` with `--no-password` or
    naming an unset variable, `lr tables open --no-federated` without `--site`, `lr init` of a DSN
    without `--site-id`: each exited 1, like a site's refusal, where argparse's own usage errors exit
    2. Now 2, with the one line that says what to give; no site is reached (none is running here)."""
    monkeypatch.setenv("LR_HOME", str(tmp_path))
    monkeypatch.delenv("LR_TEST_UNSET", raising=False)
    dsn = "host=127.0.0.1 port=1 user=postgres dbname=postgres"
    grant = ["roles", "grant", "writer", "--client", "policy", "--role", "app", "--site", dsn, "--create"]
    cases = {
        "give its password with --password-env VAR": grant,
        "--password-env and --no-password: give one of them": [*grant, "--password-env", "HOME", "--no-password"],
        "--password-env LR_TEST_UNSET: that environment variable is not set": [
            *grant,
            "--password-env",
            "LR_TEST_UNSET",
        ],
        "--no-federated: name the --site(s)": ["tables", "open", "public.t", "--client", "policy", "--no-federated"],
        "give --site-id (the connection has no site_id extra)": ["init", "--site", dsn],
        "--give-up-after applies to --until-idle only": ["sync", "--once", "--give-up-after", "5"],
        # was ignored silently: a run of cycles prints a line per cycle, no progress lines
        "--report-every applies to a streaming lr sync only": ["sync", "--once", "--report-every", "5"],
        # --cycles was ignored silently: one cycle ran
        "--once is one cycle, --cycles N is N: give one of them": ["sync", "--once", "--cycles", "3"],
        # were said by the first site reached, exit 1 (checks that need no site)
        "a writer is the writer of a client: give --client NAME": ["roles", "grant", "writer", "--role", "a"],
        "a replicator serves every client of the site: give no --client": [
            *("roles", "revoke", "replicator", "--role", "a", "--client", "policy"),
        ],
    }
    for said, argv in cases.items():
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("lr: ") and said in err and len(err.strip().splitlines()) == 1, err
    # a malformed HOST:PORT is refused by the parser (it was exit 1, after reading the topology)
    for argv in (["metrics", "--listen", "127.0.0.1:99999"], ["sync", "--metrics-listen", "nonsense"]):
        with pytest.raises(SystemExit) as refused:
            cli.main(argv)
        assert refused.value.code == 2, argv
        assert "is not HOST:PORT with a port from 0 to 65535" in capsys.readouterr().err


@pytest.mark.parametrize(
    "command, unknown",
    [
        (["full-sync", "--sink", "nosuch"], "site 'nosuch'"),
        (["full-sync", "--source", "nosuch", "--wait", "5"], "site 'nosuch'"),
        (["full-sync", "--client", "nosuch"], "client 'nosuch'"),
        (["tables", "open", "public.t", "--client", "nosuch"], "client 'nosuch'"),
        (["tables", "open", "public.t", "--client", "policy", "--site", "nosuch"], "site 'nosuch'"),
        (["tables", "close", "public.t", "--site", "nosuch"], "site 'nosuch'"),
        (["tables", "list", "--site", "site-a", "--site", "nosuch"], "site 'nosuch'"),
        (["failover", "--promote", "nosuch"], "site 'nosuch'"),
        (["failover", "--promote", "site-b", "--from", "nosuch"], "site 'nosuch'"),
        (["failover", "--promote", "site-b", "--client", "nosuch"], "client 'nosuch'"),
        (["failover", "--rejoin", "nosuch"], "site 'nosuch'"),
    ],
)
def test_a_site_or_client_the_topology_does_not_know_is_a_usage_error_listing_the_known_ones(
    command, unknown, tmp_path, capsys
):
    """`lr full-sync --sink nosuch` exited 1, as a site's refusal (and `lr tables list` reached every
    site first): a name the topology does not know is a usage error, exit 2, said on one line with
    the names it knows, before any site is reached (none runs here)."""
    topo = tmp_path / "topology.yaml"
    topo.write_text(
        "sites:\n  - {id: site-a, region: r1}\n  - {id: site-b, region: r2}\n"
        "replication:\n  - {source: site-a, sinks: [site-b], clients: [policy]}\n"
    )
    assert cli.main([*command, "--topology", str(topo)]) == 2
    err = capsys.readouterr().err
    known = "site-a, site-b" if unknown.startswith("site") else "policy"
    assert (
        err
        == f"lr: unknown {unknown}; the topology {'knows' if unknown.startswith('site') else 'replicates'} {known}\n"
    )


@pytest.mark.parametrize(
    "command",
    [
        ["full-sync", "--sink", "s" * 100_000],
        ["full-sync", "--client", "c" * 100_000],
        ["failover", "--promote", "s" * 100_000],
        ["init", "--site", "s" * 100_000],
        ["roles", "grant", "writer", "--client", "c" * 100_000, "--role", "app"],
        ["roles", "grant", "writer", "--client", "policy", "--role", "r" * 100_000],
    ],
)
def test_a_name_of_100_000_characters_is_refused_on_one_short_line(command, tmp_path, monkeypatch, capsys):
    """A hostile name was quoted back whole: `lr full-sync --sink <100 kB>` printed a line of 100 kB
    (so did an unknown connection, a role and a client name). The name is cut, its length said."""
    monkeypatch.setenv("LR_CONNECTIONS_FILE", str(tmp_path / "none.json"))
    monkeypatch.delenv("AIRFLOW_HOME", raising=False)  # no Airflow to ask for the connection (10 s to import)
    monkeypatch.setenv("HOME", str(tmp_path))
    topo = tmp_path / "topology.yaml"
    topo.write_text(
        "sites:\n  - {id: site-a, region: r1}\n  - {id: site-b, region: r2}\n"
        "replication:\n  - {source: site-a, sinks: [site-b], clients: [policy]}\n"
    )
    topology = [] if command[0] in ("init", "roles") else ["--topology", str(topo)]
    assert cli.main([*command, *topology]) in (1, 2)
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and len(err) < 600 and "(100000 characters)" in err, err[:300]


@pytest.mark.parametrize(
    "reason",
    ["line1\nsite-a: FAKE healthy", "tab\there", "x" * 501, "csi \x9b2J", "nel\x85x", "ls\u2028x", "\u202eright"],
)
@pytest.mark.parametrize("command", [["full-sync"], ["failover", "--promote", "site-b"]])
def test_a_full_sync_reason_lr_status_could_not_show_on_one_line_is_a_usage_error(command, reason, tmp_path, capsys):
    """`lr full-sync --reason` (and a failover's, recorded with its full syncs) took a newline, which
    `lr status` printed as a line of its own reading like another site's, and 100 kB, printed as one
    line of 100 kB; the lr_full_sync and lr_failover forms take it too. Now one line of at most 500
    characters, else refused before any site is reached (none runs here)."""
    from airflow_provider_lr.engine.errors import ConfigurationError
    from airflow_provider_lr.engine.site import failover
    from airflow_provider_lr.engine.source import full_sync

    topo = tmp_path / "topology.yaml"
    topo.write_text(
        "sites:\n  - {id: site-a, region: r1}\n  - {id: site-b, region: r2}\n"
        "replication:\n  - {source: site-a, sinks: [site-b], clients: [policy]}\n"
    )
    with pytest.raises(SystemExit) as exit_:  # argparse's usage error
        cli.main([*command, "--reason", reason, "--topology", str(topo)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "reason is one line of text of at most 500 characters" in err, err
    assert "\nsite-a: FAKE" not in err and len(err) < 1000, err  # said (escaped), never as a line of its own
    with pytest.raises(ConfigurationError, match="reason is one line"):  # the DAGs' forms, through the engine
        if command[0] == "full-sync":
            full_sync.request_for_sessions([], lambda site: None, reason)
        else:
            failover.promote(failover.FailoverRequest("site-a", "site-b", reason=reason), lambda site: None)


def test_lr_status_shows_a_site_whose_lr_table_is_locked_and_says_a_missing_grant_is_a_refusal(
    lr_sites, tmp_path, monkeypatch, capsys
):
    """A sink's `lr.receive_queue` held in ACCESS EXCLUSIVE by another session (VACUUM FULL, an
    admin's LOCK): `lr status` called the whole site UNREADABLE, hid its sessions and exited 2
    ("unreachable") after the 5 s lock_timeout. Now the rest of the site is shown, the queues are
    said not read and which pid holds the lock, the health is degraded, the wait short. A writer
    login (no replicator grant) was called unreachable too: now a refusal (exit 1, health refused)
    naming the role and the grant it lacks. `lr tables list` alike; `lr roles list` too (a lock was
    a bare error after 5 s, a login without lr's grants UNREADABLE, exit 2). `lr metrics` gives no
    sample of a part not read (diverged tables, held back, members: they exported 0)."""
    import re
    import time

    from airflow_provider_lr.engine.site import roles, status_parts

    source, sink = lr_sites[0], lr_sites[1]
    topo = topology_file(tmp_path, lr_sites, monkeypatch, providers={"policy": "tests.support.session:empty_provider"})
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    assert cli.main(["sync", "--topology", topo, "--until-idle", "--cycles", "10", "--interval", "0.01"]) == 0
    admin = sink.connect()
    with admin.cursor() as cur:
        cur.execute("LOCK TABLE lr.receive_queue IN ACCESS EXCLUSIVE MODE")
        cur.execute("SELECT pg_backend_pid()")
        pid = cur.fetchone()[0]
    capsys.readouterr()
    started = time.monotonic()
    assert cli.main(["status", "--topology", topo]) == 1
    took = time.monotonic() - started
    out = capsys.readouterr().out
    assert "UNREADABLE" not in out and "unreachable" not in out, out
    assert "sink   site-a->site-b/policy" in out, out  # the site's sessions are shown
    assert f"  receive queues not read: lr.receive_queue is locked by pid {pid} (AccessExclusiveLock)" in out, out
    assert "health: degraded" in out and "site-b: receive queues not read" in out, out
    assert took < 4.5, took  # not the 5 s lock_timeout of the topology's settings
    monkeypatch.setattr(status_parts, "STATUS_LOCK_WAIT", "200ms")  # (the rest: cheaper waits)
    # lr tables list, its sink copies' table locked: the site's other parts listed, exit 1 (was 2)
    with admin.cursor() as cur:
        cur.execute("LOCK TABLE lr.sink_tables IN ACCESS EXCLUSIVE MODE")
    assert cli.main(["tables", "list", "--topology", topo]) == 1
    out = capsys.readouterr().out
    assert "\n  copies held here not read: " in out and f"lr.sink_tables is locked by pid {pid}" in out, out
    assert "UNREADABLE" not in out and "\nsite-c: no tables registered\n" in out, out
    assert cli.main(["metrics", "--topology", topo]) == 0  # lr metrics: the site up, its parts not read counted
    out = capsys.readouterr().out
    unread = re.search(r'^lr_site_parts_unread\{site="site-b"\} (\d+)', out, re.M)
    assert unread and int(unread[1]) >= 2 and 'lr_site_up{site="site-b"} 1.0' in out, out
    assert 'lr_site_parts_unread{site="site-a"} 0.0' in out, out
    # its diverged tables not read (lr.sink_tables): no sample, not a made-up 0 (nothing diverged)
    assert 'lr_tables_diverged{site="site-b"}' not in out and 'lr_tables_diverged{site="site-a"} 0.0' in out, out
    # lr roles list, a site's lr.role_grants locked: said so with the pid after the short wait (was
    # a bare lock error after the 5 s lock_timeout); the other site listed
    with admin.cursor() as cur:
        cur.execute("LOCK TABLE lr.role_grants IN ACCESS EXCLUSIVE MODE")
    started = time.monotonic()
    assert cli.main(["roles", "list", "--site", "lr_test_site_a", "--site", "lr_test_site_b"]) == 2
    took, out = time.monotonic() - started, capsys.readouterr().out
    assert "\nsite-b: UNREADABLE (" in out and f"lr.role_grants is locked by pid {pid} (AccessExclusiveLock)" in out, (
        out
    )
    assert "site-a: no roles granted" in out and took < 4.5, (took, out)
    admin.rollback()
    admin.close()
    # site-a's sessions and members not read: no lr_log_held_back (whether it is a source is not
    # known) and no lr_replicator_members sample (both exported 0); its trim mark still said
    other = source.connect()
    with other.cursor() as cur:
        cur.execute("LOCK TABLE lr.replication_status, lr.replicator_members IN ACCESS EXCLUSIVE MODE")
    assert cli.main(["metrics", "--topology", topo]) == 0
    out = capsys.readouterr().out
    assert 'lr_site_up{site="site-a"} 1.0' in out and 'lr_log_trim_mark{site="site-a"}' in out, out
    assert 'lr_log_held_back{site="site-a"}' not in out and 'lr_replicator_members{site="site-a"}' not in out, out
    other.rollback()
    other.close()
    # the site's schema version locked: nothing of it can be read, said with who holds the lock
    other = lr_sites[2].connect()
    with other.cursor() as cur:
        cur.execute("LOCK TABLE lr.schema_migrations IN ACCESS EXCLUSIVE MODE")
    assert cli.main(["status", "--topology", topo]) == 2
    out = capsys.readouterr().out
    assert f"site-c: UNREADABLE (lr.schema_migrations is locked by pid {other.info.backend_pid} (" in out, out
    other.rollback()
    other.close()

    writer = f"lrt_{source.dbname}_writer"
    source.query(f'CREATE ROLE "{writer}" LOGIN')
    try:
        conn = source.connect()
        roles.grant(conn, "writer", writer, ["policy"])
        conn.close()
        as_writer = {**source.server.airflow_conn(source.dbname), "login": writer}
        monkeypatch.setenv("AIRFLOW_CONN_LR_TEST_SITE_A", json.dumps(as_writer))
        capsys.readouterr()
        assert cli.main(["status", "--topology", topo]) == 1
        out = capsys.readouterr().out
        assert "unreachable" not in out and "UNREADABLE" not in out, out
        assert f"site-a: REFUSED (role '{writer}' lacks the replicator grant here" in out, out
        assert f"lr roles grant replicator --role {writer}" in out, out
        assert "health: refused" in out and "  site-a: refused" in out, out
        assert "sink   site-a->site-b/policy" in out, out  # the other sites are read
        assert cli.main(["status", "--json", "--topology", topo]) == 1
        said = json.loads(capsys.readouterr().out)
        assert said["health"] == "refused" and said["sites"]["site-a"]["refused"] is True, said
        assert said["sites"]["site-a"]["reachable"] is True and said["sites"]["site-b"]["unread"] == [], said
        assert cli.main(["tables", "list", "--topology", topo]) == 1  # lr tables list: the same refusal
        out = capsys.readouterr().out
        assert f"site-a: REFUSED (role '{writer}' lacks the replicator grant here" in out, out
        # lr roles list as a login without any of lr's grants: a refusal (exit 1), not unreadable (exit 2)
        source.query(f'CREATE ROLE "{writer}_none" LOGIN')
        monkeypatch.setenv("AIRFLOW_CONN_LR_TEST_SITE_C", json.dumps({**as_writer, "login": f"{writer}_none"}))
        assert cli.main(["roles", "list", "--site", "lr_test_site_a", "--site", "lr_test_site_c"]) == 1
        out = capsys.readouterr().out
        assert f": REFUSED (role '{writer}_none' lacks the replicator grant" in out, out
        assert f"site-a: \n  {writer}: writer of policy" in out and "UNREADABLE" not in out, out
        assert cli.main(["status", "--topology", topo]) == 1  # lr status alike (it said UNREADABLE, exit 2)
        out = capsys.readouterr().out
        assert f"site-c: REFUSED (role '{writer}_none' lacks the replicator grant" in out, out
    finally:
        source.query(f'DROP OWNED BY "{writer}"; DROP ROLE "{writer}"; DROP ROLE IF EXISTS "{writer}_none"')
