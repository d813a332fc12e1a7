"""Bad input at every entry point gets a clear error and changes nothing: names, CLI arguments,
topology files, corrupted log entries, topologies re-applied and names reused across versions."""

from __future__ import annotations

import json
import textwrap
import time

import psycopg2
import pytest

from airflow_provider_lr import cli
from airflow_provider_lr.client import RoutingQueueClient
from airflow_provider_lr.embedded.sites import SiteManager
from airflow_provider_lr.engine.db import schema
from airflow_provider_lr.engine.errors import ConfigurationError, SchemaError, TransmitError
from airflow_provider_lr.engine.session.settings import SessionSettings
from airflow_provider_lr.engine.site import topology
from airflow_provider_lr.engine.site.replicator import Replicator
from airflow_provider_lr.engine.source import trim
from airflow_provider_lr.engine.store import topology as topologies
from airflow_provider_lr.proto import lr_pb2
from airflow_provider_lr.subscriber import RoutingQueueSubscriber
from tests.support.session import App, Streaming, apply, queue, replicator, wait_for
from tests.support.spark_env import lr_connections  # noqa: F401 (fixture: the tee resolves the sites by id)

ONE_SINK = [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}]


def _write(tmp_path, text: str):
    path = tmp_path / "topology.yaml"
    path.write_text(textwrap.dedent(text).lstrip())
    return path


# --- names -------------------------------------------------------------------------------------
@pytest.mark.parametrize("site_id", ["dst\n", "Site-A", "../../escaped", "a'b", "", "-x", "a" * 64])
def test_an_invalid_site_id_is_refused_before_anything_is_written(sites, site_id):
    conn = sites[0].connect()
    with pytest.raises(SchemaError, match="invalid site id"):
        schema.init_site(conn, site_id)
    assert schema.current_version(conn) == 0  # not even the schema was installed
    conn.close()


def test_a_servers_error_quoting_an_applications_escape_sequence_is_printed_escaped_on_one_line(sites):
    """A sink's DETAIL quotes the row's values (``Key (k)=(...) already exists``): an ESC written by
    the application reached the operator's terminal raw through ``lr status``'s last error and
    ``lr sync``'s log, where a sequence can clear the screen or retitle it."""
    from airflow_provider_lr.cli.common import database_error
    from airflow_provider_lr.engine.errors import one_line

    hostile = "\x1b]0;owned\x07\x1b[2J\x08\tx\x9b2J\u202e"  # retitle, clear, backspace; a tab; C1 CSI, bidi
    conn = sites[0].connect()
    with conn.cursor() as cur:
        cur.execute("CREATE TABLE public.k (k text PRIMARY KEY)")
        cur.execute("INSERT INTO public.k VALUES (%s)", (hostile,))
        with pytest.raises(psycopg2.IntegrityError) as refused:
            cur.execute("INSERT INTO public.k VALUES (%s)", (hostile,))
    conn.close()
    assert "\x1b" in str(refused.value)  # what the server says, raw
    for shown in (one_line(refused.value), database_error(refused.value)):
        assert not any(c < " " or "\x7f" <= c <= "\x9f" or c == "\u202e" for c in shown), repr(shown)
        assert "(\\x1b]0;owned\\x07\\x1b[2J\\x08 x\\x9b2J\\u202e) already exists" in shown, shown


def test_lr_init_refuses_a_control_character_in_a_region_and_a_bad_site_id_as_usage(sites, capsys):
    """``--region 'r\\n1'`` was recorded (a line of its own wherever a region is printed);
    ``--site-id 'X Y'`` was refused after connecting, exit 1. Now both exit 2 before any site."""
    for option, value in (
        ("--region", "r\n1"),
        ("--region", "eu\x1b[31m"),
        ("--region", "eu\x9b31m"),  # the C1 CSI: what ESC [ is to a terminal
        ("--region", "eu\u202e1r"),  # a bidi override: the rest of the line printed backwards
        ("--site-id", "X Y"),
    ):
        with pytest.raises(SystemExit) as exited:
            cli.main(["init", "--site", "host=127.0.0.1 port=1", "--site-id", "x", option, value])
        assert exited.value.code == 2 and f"argument {option}" in capsys.readouterr().err
    conn = sites[0].connect()
    with pytest.raises(SchemaError, match="invalid region"):  # the engine's own check (a connection's extra)
        schema.init_site(conn, "site-x", "r\n1")
    assert schema.current_version(conn) == 0  # nothing was installed
    conn.close()


@pytest.mark.parametrize(
    "ids, error",
    [
        (["../../escaped"], "invalid site id"),
        (["a'; touch /tmp/pwned; '"], "invalid site id"),
        (["ok\n"], "invalid site id"),
        (["x-1", "x_1"], "share the connection id"),
        ([f"s{n}" for n in range(65)], "at most 64 embedded sites"),  # `--count 1000000` started servers until killed
    ],
)
def test_lr_sites_up_refuses_ids_that_would_escape_lr_home_or_collide(tmp_path, ids, error):
    manager = SiteManager(tmp_path / "home")
    with pytest.raises(ConfigurationError, match=error):
        manager.up(site_ids=ids)
    assert not (tmp_path / "home" / "sites").exists() and manager.sites() == []


def test_lr_sites_given_ids_it_refuses_exits_2_as_every_usage_error_and_starts_nothing(tmp_path, capsys):
    """`lr sites up --ids ../x` (or an id named twice, or a count past the bound) and `lr sites down
    --ids nosuch` exited 1, as a server's refusal; `--ids a,a` started site a once, silently."""
    home = str(tmp_path / "home")
    for argv, said in [
        (["sites", "up", "--ids", "../x"], "'../x' is not a site id"),
        (["sites", "up", "--ids", "a,A"], "'A' is not a site id"),
        (["sites", "up", "--ids", "a,,b"], "'' is not a site id"),
        (["sites", "up", "--ids", "a,b,a"], "'a' given twice"),
        (["sites", "up", "--ids", "x-1,x_1"], "would share the connection id"),
        (["sites", "up", "--count", "65"], "at most 64 embedded sites"),
        (["sites", "down", "--ids", "a,a"], "'a' given twice"),
        (["sites", "down", "--ids", "nosuch"], "no embedded site nosuch"),
    ]:
        try:
            assert cli.main(["--home", home, *argv]) == 2, argv
        except SystemExit as exit_:  # argparse's refusals
            assert exit_.code == 2, argv
        err = capsys.readouterr().err
        assert said in err.strip().splitlines()[-1], (argv, err)
    assert not (tmp_path / "home" / "sites").exists()


def test_airflow_env_quotes_what_it_writes(tmp_path):
    from airflow_provider_lr.embedded.sites import EmbeddedSite

    manager = SiteManager(tmp_path)
    manager.write_connections([EmbeddedSite("site-a", "eu'; echo pwned; '", 5432, str(tmp_path))])
    import subprocess

    out = subprocess.run(
        ["bash", "-c", f'set -a; . {tmp_path / "airflow.env"}; echo "$AIRFLOW_CONN_LR_SITE_A"'],
        capture_output=True,
        text=True,
    )
    assert "pwned" not in out.stdout.replace("echo pwned", "") and out.returncode == 0
    assert json.loads(out.stdout)["extra"]["region"] == "eu'; echo pwned; '"


def test_the_connections_file_keeps_what_a_user_added_and_is_private(tmp_path):
    """lr tells a user to add a site's connection to ``$LR_HOME/connections.json`` (``unknown site
    or connection ...``), a password with it; every ``lr sites up`` or ``down --remove`` rewrote the
    file with the embedded sites alone (the user's entries gone) and readable by every local user.
    Now the entries that are not embedded sites' stay, a removed site's go, and the file is 0600."""
    from airflow_provider_lr.embedded.sites import EmbeddedSite

    manager = SiteManager(tmp_path)
    a, b = (EmbeddedSite(s, "r", 5432, str(tmp_path / s)) for s in ("site-a", "site-b"))
    manager._save([a, b])
    path = tmp_path / "connections.json"
    added = {"conn_type": "postgres", "host": "db.example", "login": "app", "password": "S3cret!"}
    path.write_text(json.dumps({**json.loads(path.read_text()), "my_remote": added}))
    manager._save([a])  # site-b removed
    assert json.loads(path.read_text()) == {"lr_site_a": a.airflow_conn(), "my_remote": added}
    assert [oct(p.stat().st_mode & 0o777) for p in (path, tmp_path / "airflow.env")] == [oct(0o600)] * 2


# --- CLI arguments -----------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["-3600", "nan", "inf", "1e308", "soon"])
def test_trim_retention_must_be_a_sane_number_of_seconds(value, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["trim", "--retention", value])
    assert exit_.value.code == 2 and "number of seconds" in capsys.readouterr().err


@pytest.mark.parametrize(
    "job, args, flag",
    [
        ("lr_fanout.py", ["--source", "site-a"], "--tasks"),
        ("lr_fanout.py", ["--source", "site-a"], "--partitions"),
        ("lr_fanout.py", ["--source", "site-a"], "--max-entries"),
        ("lr_snapshot_transfer.py", ["--source", "site-a", "--sink", "site-b", "--client", "policy"], "--partitions"),
        ("lr_table_snapshot.py", ["--source", "site-a", "--client", "policy"], "--parts"),
        ("lr_apply_receive_queue.py", ["--sink", "site-b", "--client", "policy", "--function", "m:f"], "--batch"),
    ],
)
@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_a_spark_job_refuses_a_count_below_one_before_spark_starts(repo_root, job, args, flag, value):
    import subprocess
    import sys

    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, str(repo_root / "spark_jobs" / job), *args, flag, value],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and f"argument {flag}" in out.stderr and "whole number of at least 1" in out.stderr
    assert "SparkContext" not in out.stderr and time.monotonic() - started < 30


@pytest.mark.parametrize("counts", [{"partitions": 0}, {"tasks": -1}, {"max_entries": 0}, {"tasks": True}])
def test_a_fan_out_with_a_count_below_one_is_refused_naming_it(lr_sites, lr_connections, counts):
    from airflow_provider_lr.engine.bulk import fanout

    topo = apply(lr_sites, ONE_SINK)
    driver = fanout.FanoutDriver(topo, "site-a")
    try:
        with pytest.raises(ConfigurationError, match=f"{next(iter(counts))} must be a whole number of at least 1"):
            driver.plan(**counts)
    finally:
        driver.close()


@pytest.mark.parametrize("field", ["max_entries", "max_bytes", "max_batches"])
def test_session_settings_refuse_a_batch_of_nothing(field):
    with pytest.raises(ConfigurationError, match=f"{field} must be a whole number of at least 1, not 0"):
        SessionSettings(**{field: 0})


def test_a_subscriber_or_client_made_with_what_cannot_mean_what_was_meant_is_refused_saying_what_to_give(lr_sites):
    """A site id as a subscriber's ``sources`` was taken letter by letter (it never delivered); a
    batch of 0 or a pause of 0 was taken as given (nothing delivered, a spinning core); an open
    connection given to the subscriber failed with "not iterable", a DSN given to the client with an
    AttributeError; a payload limit of 0 or "1024" was taken as given."""
    from airflow_provider_lr.engine.sink.relay import Relay
    from airflow_provider_lr.subscriber import open_relay

    source, sink = lr_sites[0], lr_sites[1]
    opened = source.connect()
    for kwargs, said in [
        ({"dsn": opened}, "not a connection: lr opens its own connections"),  # the app's connection, by habit
        ({"dsn": None}, "not a NoneType"),
        ({"client_name": 5}, "client_name is required"),
        ({"client_name": ""}, "client_name is required"),
        # a name no topology can hold (it delivered nothing, silently, for ever)
        *(({"client_name": name}, "cannot be a client") for name in ("policy\n", "pol icy", "x'; --", "p" * 64)),
        ({"sources": "site-a"}, "sources is a list of site ids, not one string"),
        ({"sources": [None]}, "sources must be site ids"),
        ({"batch_size": 0}, "batch_size must be a whole number of at least 1, not 0"),
        ({"batch_size": "500"}, "batch_size must be a whole number"),
        ({"batch_bytes": -1}, "batch_bytes must be a whole number"),
        ({"poll_interval": 0}, "poll_interval must be a number of seconds above 0, not 0"),
        ({"retry_interval": -1.0}, "retry_interval must be a number of seconds above 0"),
    ]:
        given = {"dsn": sink.dsn, "client_name": "policy", **kwargs}
        with pytest.raises(ConfigurationError, match=said):
            RoutingQueueSubscriber(**given)
        with pytest.raises(ConfigurationError, match=said):  # a relay's subscriptions take the same
            if "dsn" in kwargs:
                open_relay(given["dsn"])
            else:
                relay = Relay(sink.connect, **{k: v for k, v in kwargs.items() if k not in ("client_name", "sources")})
                try:
                    relay.subscribe(_AcceptAll(), given["client_name"], given.get("sources"))
                finally:
                    relay.close()

    # a listener without a callback delivery calls: found out only when such an entry came, then an
    # AttributeError every pass, the entries kept forever; now refused before anything is delivered
    class LogEntriesOnly:
        def on_log_entry_messages(self, source, payloads):
            return True

    subscriber = RoutingQueueSubscriber(sink.dsn, client_name="policy")
    relay = open_relay(sink.dsn)
    try:
        for listener in (None, LogEntriesOnly()):
            said = "lacks on_snapshot_sync_start, on_snapshot_messages, on_snapshot_sync_complete"
            for deliver in (subscriber.poll, subscriber.run, lambda lst: relay.subscribe(lst, "policy")):
                with pytest.raises(ConfigurationError, match=said):
                    deliver(listener)
    finally:
        subscriber.close()
        relay.close()
    relay = open_relay(sink.dsn)
    try:
        subscription = relay.subscribe(_AcceptAll(), "policy")
        with pytest.raises(ConfigurationError, match="sources is a list of site ids, not one string"):
            subscription.update(sources="site-a")  # and a subscription's new demand
        assert subscription.demand.sources is None
    finally:
        relay.close()
    for conn, client, limit, error, said in [
        ("lr_site_a", "policy", None, ConfigurationError, "give its open psycopg2 connection, not a str"),
        (None, "policy", None, ConfigurationError, "not a NoneType"),
        (opened, 5, None, TransmitError, "invalid client name 5"),
        (opened, "policy", 0, ConfigurationError, "max_payload_bytes must be a whole number of at least 1, not 0"),
        (opened, "policy", "1024", ConfigurationError, "max_payload_bytes must be a whole number"),
        # a limit above the topology's was taken as given: a 200 MB entry took a streaming replicator
        # of every client to 2.4 GB (its readers' budgets assume 16 MiB at most, docs/memory.md)
        (opened, "policy", (16 << 20) + 1, ConfigurationError, "above the topology's limit of 16777216 bytes"),
    ]:
        with pytest.raises(error, match=said):
            RoutingQueueClient(conn, client, max_payload_bytes=limit)
        assert opened.get_transaction_status() == psycopg2.extensions.TRANSACTION_STATUS_IDLE
    apply(
        lr_sites,
        [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}],
        settings={"max_payload_bytes": 4096},
    )
    with pytest.raises(ConfigurationError, match="above the topology's limit of 4096 bytes"):
        RoutingQueueClient(opened, "policy", max_payload_bytes=4097)
    assert RoutingQueueClient(opened, "policy", max_payload_bytes=4096).max_payload_bytes == 4096
    assert RoutingQueueClient(opened, "policy", max_payload_bytes=100).max_payload_bytes == 100  # a lower one
    # what is not a transmit's ticket (None from transmitting no message, its id, its dict): an
    # AttributeError ('NoneType' object has no attribute 'tx') from inside lr
    client = RoutingQueueClient(opened, "policy")
    for ticket in (None, 5, {"tx": 5}):
        for ask in (client.delivery, client.wait_until_safe):
            with pytest.raises(ConfigurationError, match=f"not a {type(ticket).__name__}: give the Ticket a transmit"):
                ask(ticket)
    opened.close()


def test_a_negative_retention_never_trims_what_no_sink_has(lr_sites):
    source = lr_sites[0]
    apply(lr_sites, ONE_SINK)
    App(source).put("k", 1, ["site-b"])
    for bad in (-3600.0, float("nan"), float("inf")):
        with pytest.raises(ConfigurationError, match="retention"):
            trim.retention_trim(source.connect(), bad)
    assert source.query("SELECT count(*) FROM lr.log_entries")[0][0] == 1


# --- topology files ----------------------------------------------------------------------------
GOOD = """
sites:
  - {id: site-a, region: r1}
  - {id: site-b, region: r2}
replication:
  - {source: site-a, sinks: [site-b], clients: [policy]}
settings:
  lease_seconds: 30
"""


@pytest.mark.parametrize(
    "text, where",
    [
        (GOOD.replace("replication:", "replications:"), ":4: replications: unknown key 'replications'"),
        (GOOD.replace("sinks:", "sink:"), ":5: replication[0].sink: unknown key 'sink'"),
        (GOOD.replace("region: r2", "regoin: r2"), ":3: sites[1].regoin: unknown key 'regoin'"),
        (GOOD.replace("lease_seconds", "lease_secs"), ":7: settings.lease_secs: unknown key 'lease_secs'"),
        (GOOD.replace("lease_seconds: 30", "lease_seconds: soon"), ":7: settings.lease_seconds: 'soon' is not of type"),
        (GOOD.replace("clients: [policy]", "clients: policy"), ":5: replication[0].clients: 'policy' is not of type"),
        (GOOD.replace("id: site-b", 'id: "site-b\\n"'), ":3: sites[1].id: 'site-b\\n' is not a valid site id"),
        (GOOD.replace("sinks: [site-b]", "sinks: [site-x]"), ":5: replication[0].sinks: unknown site 'site-x'"),
        # a region or conn_id lr prints: a newline in one printed a line of its own, ESC recoloured it
        *[
            (GOOD.replace("region: r2", f'region: "{bad}"'), ":3: sites[1].region: " + repr(shown) + " is not one line")
            for bad, shown in (("r2\\nsite-c: consistent", "r2\nsite-c: consistent"), ("r\\e[31m2", "r\x1b[31m2"))
        ],
        (GOOD.replace("region: r2", 'region: "r2\\n"'), ":3: sites[1].region: 'r2\\n' is not one line"),
        (GOOD.replace("region: r2", f"region: {'r' * 64}"), ":3: sites[1].region: "),
        (GOOD.replace("region: r1", 'region: r1, conn_id: "lr_a\\n"'), ":2: sites[0].conn_id: 'lr_a\\n' is not one"),
        (
            GOOD.replace("sinks: [site-b]", "sinks: [site-a]"),
            ":5: replication[0].sinks: site 'site-a' cannot replicate",
        ),
        (
            GOOD.replace("[policy]}", "[policy]\n"),
            ":7: YAML syntax error: expected ',' or '}', but got '<scalar>' (while parsing a flow mapping from line 5)",
        ),
        # NaN passes every bound (no comparison holds): 'valid', then apply failed on the site's json
        *[
            (
                GOOD.replace("lease_seconds: 30", f"{key}: {value}"),
                f":7: settings.{key}: {shown} is not a finite number",
            )
            for key, value, shown in (
                ("lease_seconds", ".nan", "nan"),
                ("statement_timeout_s", ".NaN", "nan"),
                ("lock_timeout_s", "-.inf", "-inf"),
            )
        ],
        ("sites: site-a\n", ":1: sites: 'site-a' is not of type 'array'"),
        ("- just a list\n", ":1: (document): a list, not a mapping: a topology is a mapping of sites:"),
        # an empty file (a truncated copy) said "(document): None is not of type 'object'"
        ("", ": (document): the file is empty: a topology is a mapping of sites:, replication:"),
        ("# nothing yet\n", ": (document): the file is empty: a topology is a mapping of sites:"),
        (GOOD + "providers:\n  policy: not-a-module\n", ":9: providers.policy: 'not-a-module' is not a valid provider"),
        (
            GOOD.replace("region: r1", "region: r1, conn_id: 'host=db password=hunter2'"),
            ":2: sites[0].conn_id: holds a password",
        ),
        (
            GOOD.replace("region: r1", "region: r1, conn_id: 'postgresql://lr:hunter2@db/app'"),
            ":2: sites[0].conn_id: holds a password",
        ),
        # a client key's passphrase, a password in a URI's query (its key percent-encoded, as libpq
        # decodes it): all were stored on every site, readable by every writer
        *[
            (GOOD.replace("region: r1", f"region: r1, conn_id: '{dsn}'"), ":2: sites[0].conn_id: holds a password")
            for dsn in (
                "host=db sslpassword=hunter2",
                "host=db SSLPASSWORD = hunter2",
                "postgresql://db/app?sslpassword=hunter2",
                "postgresql://db/app?pass%77ord=hunter2",
                "postgresql://lr:hunter2@db:5432,db2:5433/app",
                "postgresql://lr:hun/ter2@db/app",  # an unescaped '/' in it: libpq cannot read it, still a password
                # a user@server login's unescaped '@', a database name libpq reads as a connection
                # string: both stored on every site as they were
                "postgresql://lr@srv:hunter2@db/app",
                "host=db dbname=postgresql://lr:hunter2@db/app",
                "dbname=''postgresql://lr:hunter2@db/app''",
            )
        ],
    ],
)
def test_a_topology_file_with_a_mistake_is_refused_naming_file_line_and_key(tmp_path, text, where):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigurationError) as error:
        topologies.load(path)
    message = str(error.value)
    assert message.startswith(str(path)) and where in message, message
    assert "\n" not in message.strip()


def test_lr_topology_validate_says_what_the_file_defines_or_what_is_wrong(tmp_path, capsys):
    path = _write(tmp_path, GOOD)
    assert cli.main(["topology", "validate", "--topology", str(path)]) == 0
    out = capsys.readouterr().out
    assert "valid" in out and "site-a->site-b/policy" in out
    _write(tmp_path, GOOD.replace("replication:", "replications:"))
    assert cli.main(["topology", "validate", "--topology", str(path)]) == 2  # the user's input: as a bad argument
    assert "unknown key 'replications'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text, said",
    [
        ("sites: [\n", "YAML syntax error"),
        (GOOD.replace("replication:", "replications:"), "unknown key 'replications'"),
        (None, "not found"),
    ],
)
def test_a_malformed_or_missing_topology_file_is_a_usage_error_for_every_command(tmp_path, capsys, text, said):
    """Exit 2, as any bad argument (exit 1 is a site's refusal): it was 1, so a script could not
    tell a typo in its file from a site that refused; no site is reached before the file is read."""
    path = tmp_path / "topology.yaml"
    if text is not None:
        path.write_text(textwrap.dedent(text).lstrip())
    for command in (["topology", "validate"], ["topology", "apply"], ["status"], ["sync", "--once"], ["full-sync"]):
        assert cli.main([*command, "--topology", str(path)]) == 2, command
        err = capsys.readouterr().err
        assert err.startswith("lr: ") and str(path) in err and said in err and err.count("\n") == 1, err


def test_the_shipped_topology_is_valid_and_its_payload_limit_is_enforced(lr_sites, repo_root):
    shipped = topologies.load(repo_root / "include" / "topology.yaml")
    assert shipped.settings["max_payload_bytes"] == 16 * 1024 * 1024
    apply(lr_sites, ONE_SINK, settings={"max_payload_bytes": 1000})
    conn = lr_sites[0].connect()
    client = RoutingQueueClient(conn, "policy")
    client.transmit_log_entry_message(b"x" * 1000, ["site-b"])
    with pytest.raises(TransmitError, match="exceeds the maximum of 1000 bytes"):
        client.transmit_log_entry_message(b"x" * 1001, ["site-b"])
    conn.close()


def test_topology_apply_is_all_or_nothing_when_a_site_is_unreachable(lr_sites):
    apply(lr_sites, ONE_SINK)
    before = [s.query("SELECT topology_config_id FROM lr.topology") for s in lr_sites]
    two = topologies.from_document(
        {
            "sites": [{"id": s.site_id} for s in lr_sites],
            "replication": [{"source": "site-a", "sinks": ["site-b", "site-c"], "clients": ["policy"]}],
        }
    )

    def connect(site_id: str):
        if site_id == "site-c":
            raise psycopg2.OperationalError("connection refused")
        return next(s for s in lr_sites if s.site_id == site_id).connect()

    with pytest.raises(ConfigurationError, match="site 'site-c'.*nothing was applied on any site"):
        topology.apply_everywhere(two, connect)
    assert [s.query("SELECT topology_config_id FROM lr.topology") for s in lr_sites] == before
    swapped = {"site-a": lr_sites[0], "site-b": lr_sites[2], "site-c": lr_sites[1]}  # wrong connection
    with pytest.raises(ConfigurationError, match="reaches site 'site-c'"):
        topology.apply_everywhere(two, lambda site_id: swapped[site_id].connect())
    assert [s.query("SELECT topology_config_id FROM lr.topology") for s in lr_sites] == before


# --- sessions re-added, names reused -----------------------------------------------------------
def test_a_session_removed_and_added_back_is_not_fenced_by_its_old_epoch(lr_sites):
    source, sink_b, _ = lr_sites
    topo = apply(lr_sites, ONE_SINK, providers={"policy": "tests.support.session:table_provider"})
    app = App(source)
    app.put("k", 1, ["site-b"])
    for _ in range(3):  # a few lease holders: the sink's epoch climbs
        repl = replicator(topo, lr_sites)
        repl.run(max_cycles=2, until_idle=True, interval=0.01)
        repl.close()
    assert sink_b.query("SELECT lease_epoch FROM lr.sink_sessions")[0][0] >= 3
    apply(lr_sites, [{"source": "site-a", "sinks": ["site-c"], "clients": ["policy"]}])  # removed ...
    topo = apply(lr_sites, ONE_SINK, providers={"policy": "tests.support.session:table_provider"})  # ... and back
    app.put("k", 2, ["site-b"])
    repl = replicator(topo, lr_sites)
    (report,) = repl.run(max_cycles=3, until_idle=True, interval=0.01)
    assert not report.error and report.state == "IN_LOG_ENTRY_SYNC", report
    assert [p for k, p in queue(sink_b, "site-a") if k == "log"][-1] == "k=2"
    source_epoch = source.query("SELECT lease_epoch FROM lr.source_sessions")[0][0]
    assert source_epoch == sink_b.query("SELECT lease_epoch FROM lr.sink_sessions")[0][0]
    repl.close()
    app.close()


def test_a_queue_name_reused_by_a_later_topology_is_registered_once_the_old_queue_drained(sites):
    """Client ``a_b`` from ``c``, later client ``a`` from ``b_c``: both queues are named
    LRQ_Recv_a_b_c on the sink. The later session takes the name over once nothing of the earlier
    waits; while something does, its writes are refused with a clear error (nothing hidden)."""
    ids = {"c": sites[0], "b_c": sites[1], "k": sites[2]}
    for site_id, site in ids.items():
        conn = site.connect()
        schema.init_site(conn, site_id)
        conn.close()

    def topo_of(source: str, client: str):
        topo = topologies.from_document(
            {
                "sites": [{"id": i} for i in ids],
                "replication": [{"source": source, "sinks": ["k"], "clients": [client]}],
            }
        )
        for site_id, site in ids.items():
            conn = site.connect()
            topology.apply_to_site(conn, topo, site_id)
            conn.close()
        return topo

    def run(topo):
        repl = Replicator(
            topo,
            lambda s: psycopg2.connect(ids[s].dsn),
            settings=SessionSettings(barrier_timeout=2.0),
            providers={"a_b": lambda ctx: None, "a": lambda ctx: None},
        )
        reports = repl.run(max_cycles=3, until_idle=True, interval=0.01)
        repl.close()
        return reports

    first = topo_of("c", "a_b")
    conn = ids["c"].connect()
    RoutingQueueClient(conn, "a_b").transmit_log_entry_message(b"old", ["k"])
    conn.commit()
    run(first)
    second = topo_of("b_c", "a")
    (report,) = run(second)
    assert "still holds entries of client 'a_b' from 'c'" in report.error
    RoutingQueueSubscriber(ids["k"].dsn, client_name="a_b").poll(_AcceptAll())  # the old queue drains
    (report,) = run(second)
    assert not report.error, report
    assert RoutingQueueSubscriber(ids["k"].dsn, client_name="a").poll(_AcceptAll()) >= 0
    registered = ids["k"].query(
        "SELECT source_site_id, client_name FROM lr.registry WHERE stream_name = 'LRQ_Recv_a_b_c'"
    )
    assert registered == [("b_c", "a")]


class _AcceptAll:
    def __init__(self) -> None:
        self.log: list[bytes] = []
        self.dead: list = []

    def on_snapshot_sync_start(self, source):
        pass

    def on_snapshot_messages(self, source, payloads):
        return True

    def on_snapshot_sync_complete(self, source):
        pass

    def on_log_entry_messages(self, source, payloads):
        self.log.extend(payloads)
        return True


# --- corrupted log entries ---------------------------------------------------------------------
@pytest.mark.parametrize("path", ["session", "tee", "stream"])
def test_a_corrupted_source_entry_is_passed_on_and_dead_lettered_alone_by_every_path(lr_sites, lr_connections, path):
    source, sink_b, _ = lr_sites
    topo = apply(lr_sites, ONE_SINK, providers={"policy": "tests.support.session:empty_provider"})
    repl = replicator(topo, lr_sites, tee_min_backlog=0)
    repl.run(max_cycles=3, until_idle=True, interval=0.01)
    repl.close()
    app = App(source)
    corrupt = (
        "UPDATE lr.log_entries SET message = '\\x08ff0a'::bytea WHERE entry_id = "
        "(SELECT min(entry_id) + 10 FROM lr.log_entries WHERE stream = 1)"
    )
    repl = replicator(topo, lr_sites, tee_min_backlog=1 if path == "tee" else 0)
    if path == "stream":
        with Streaming(repl) as streaming:
            streaming.streaming()
            for i in range(30):  # one transaction, corrupted before it commits: the stream reads it so
                app.client.transmit_log_entry_message(f"k{i}={i}".encode(), ["site-b"])
            with app.conn.cursor() as cur:
                cur.execute(corrupt)
            app.conn.commit()
            wait_for(
                lambda: sink_b.query(
                    "SELECT coalesce(sum(entry_count), 0) FROM lr.receive_queue WHERE visible AND kind <> %s",
                    (lr_pb2.SNAPSHOT_SYNC_START,),
                )
                >= [(30 + 1,)],
                30,
                "the 30 entries and the first contact's end marker",
            )
        streamer = streaming.streamer
        assert [(e.reason, e.error, e.delivered) for e in streamer.ends] == [("stopped", "", 30)]
    else:
        for i in range(30):
            app.put(f"k{i}", i, ["site-b"])
        source.query(corrupt)
        reports = repl.run(max_cycles=3, until_idle=True, interval=0.01)
        assert not any(r.error for r in reports), reports
    if path == "tee":
        assert sum(repl.teed.values()) == 30
    if path != "stream":  # the streaming replicator was closed with its streamer
        repl.close()
    listener = _AcceptAll()
    RoutingQueueSubscriber(sink_b.dsn, client_name="policy").poll(listener)
    assert len(listener.log) == 29 and b"k10=10" not in listener.log
    dead = sink_b.query("SELECT error FROM lr.receive_dead_letters")
    assert len(dead) == 1 and "kind 0" in dead[0][0]
    app.close()


ALIAS_BOMB = "".join(f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefg", "bcdefgh"))


@pytest.mark.parametrize(
    "text, said",
    [
        ("a: &a [x, x, x, x, x, x, x, x, x]\n" + ALIAS_BOMB + "sites: *h\n", "more than 100000 values"),
        ("sites: " + "[" * 1000 + "]" * 1000 + "\n", "nested too deeply"),
        (GOOD + "sites: []\n", ":9: key 'sites' given twice in one mapping"),
        (GOOD + "#" + "x" * (1 << 20) + "\n", "larger than 1048576 bytes"),
        ("sites: !!python/object/apply:os.system ['echo pwned']\n", "could not determine a constructor for the tag"),
        (b"sites: \xff\xfe\n", "not a text file"),
        # one tag per sink in a log entry, bounded by the database (V0046); the message quoted every site
        ("sites:\n" + "".join(f"  - {{id: s{i}}}\n" for i in range(4097)), ":1: sites: 4097 items; at most 4096"),
    ],
)
def test_a_hostile_topology_file_is_refused_fast_on_one_line_and_runs_nothing(tmp_path, text, said):
    """An alias bomb took 300 MB and seconds (or more), a deep nesting raised a RecursionError out of
    `lr`, a 200 MB file was read whole, and a key given twice silently replaced the first."""
    path = tmp_path / "topology.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    started = time.monotonic()
    with pytest.raises(ConfigurationError) as error:
        topologies.load(path)
    assert said in str(error.value) and "\n" not in str(error.value), error.value
    assert time.monotonic() - started < 5  # the bomb alone took 3.6 s and 300 MB
    with pytest.raises(ConfigurationError, match="is a directory"):
        topologies.load(tmp_path)
