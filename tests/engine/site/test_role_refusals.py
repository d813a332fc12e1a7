"""A role lr's grants do not cover for a client is told which grant it lacks. Row-level security hides
another client's rows (docs/security.md): a ``RoutingQueueSubscriber`` of client beta logged in as a
consumer of alpha only (a grant given for the wrong client, or on another sink) delivered nothing, for
ever, without a word; a writer of alpha transmitting as beta got "new row violates row-level security
policy for table log_entries", its transaction aborted."""

from __future__ import annotations

import json
import threading

import pytest

from airflow_provider_lr import cli
from airflow_provider_lr.client import RoutingQueueClient
from airflow_provider_lr.engine.errors import ConfigurationError, TransmitError
from airflow_provider_lr.subscriber import RoutingQueueSubscriber, open_relay
from tests.cli.test_cli_sync import topology_file
from tests.engine.site.test_roles import Collect, connect_as, info_as, made  # noqa: F401 (fixture)
from tests.support.session import App, apply, final_state, queue, source_state


def test_a_subscriber_whose_role_may_not_read_its_clients_queues_is_refused_naming_the_grant(lr_sites, made):
    sink = lr_sites[1]
    apply(lr_sites, [{"source": "site-a", "sinks": ["site-b"], "clients": ["alpha", "beta"]}])
    alpha, group, member = made.name("c_alpha"), made.name("c_group"), made.name("c_member")
    made.grant(sink, "consumer", alpha, ["alpha"])
    made.grant(sink, "consumer", group, ["beta"])
    sink.query(f'CREATE ROLE "{member}" LOGIN IN ROLE "{group}"')
    refused = f"role '{alpha}' may not consume the receive queues of client 'beta' on site .* holds consumer of alpha"
    wrong = RoutingQueueSubscriber(info_as(sink, alpha).dsn, client_name="beta")
    with pytest.raises(ConfigurationError, match=refused) as error:
        wrong.poll(Collect())
    assert f"lr roles grant consumer --client beta --role {alpha}" in str(error.value)
    with pytest.raises(ConfigurationError, match=refused):
        wrong.run(Collect(), threading.Event())  # the follow loop too: it ends, saying why
    # what the grants give is consumed as before: its own client, a group's grant for its members, the owner
    for dsn, client in ((info_as(sink, alpha).dsn, "alpha"), (info_as(sink, member).dsn, "beta"), (sink.dsn, "beta")):
        assert RoutingQueueSubscriber(dsn, client_name=client).poll(Collect()) == 0


def test_a_relay_subscription_whose_role_may_not_read_its_clients_queues_ends_naming_the_grant(lr_sites, made):
    """The same through a relay: a subscription of beta by a consumer of alpha delivered nothing, for
    ever, without a word; it ends at its first pass (``join`` raises the refusal), and again when an
    allowed subscription's demand changes to a client the role may not read. The others go on."""
    sink = lr_sites[1]
    apply(lr_sites, [{"source": "site-a", "sinks": ["site-b"], "clients": ["alpha", "beta"]}])
    alpha = made.name("r_alpha")
    made.grant(sink, "consumer", alpha, ["alpha"])
    refused = f"role '{alpha}' may not consume the receive queues of client 'beta' on site .* holds consumer of alpha"
    with open_relay(info_as(sink, alpha).dsn) as relay:
        wrong, right, moved = (relay.subscribe(Collect(), c) for c in ("beta", "alpha", "alpha"))
        with pytest.raises(ConfigurationError, match=refused):
            wrong.join(30)
        moved.update(client="beta")
        with pytest.raises(ConfigurationError, match=refused):
            moved.join(30)
        assert right.running and right.error is None


def test_a_writer_transmitting_as_a_client_it_does_not_write_is_refused_and_its_transaction_goes_on(lr_sites, made):
    source = lr_sites[0]
    apply(lr_sites, [{"source": "site-a", "sinks": ["site-b"], "clients": ["alpha", "beta"]}])
    alpha = made.name("w_alpha")
    made.grant(source, "writer", alpha, ["alpha"])
    conn = connect_as(source, alpha)
    with pytest.raises(
        TransmitError, match=f"role '{alpha}' may not transmit as client 'beta' .* holds writer of alpha"
    ):
        RoutingQueueClient(conn, "beta").transmit_log_entry_message(b"b", ["site-b"])
    RoutingQueueClient(conn, "alpha").transmit_log_entry_message(b"a", ["site-b"])  # the same transaction
    conn.commit()
    conn.close()
    assert source.query("SELECT count(*) FROM lr.log_entries") == [(1,)]


def test_lr_sync_as_a_replicator_whose_grant_is_missing_at_one_sink_names_that_sink_and_resumes_once_granted(
    lr_sites, made, tmp_path, monkeypatch, capsys
):
    """A session spans two sites: its refusal said `role ... lacks a privilege this step needs` and no
    site, so a grant missing at the sink read as if anywhere. It names the site (and the grant to give)
    now; the other sink is delivered, and the session resumes once granted, each entry once."""
    source, sink_b, sink_c = lr_sites
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    app = App(source)
    repl = made.name("s_repl")
    for site in (source, sink_b):
        made.grant(site, "replicator", repl)
    sink_c.query(f'CREATE ROLE "{repl}" LOGIN')  # the role, not the grant
    source.query(f'GRANT SELECT ON app_state TO "{repl}"')  # the topology's provider reads it
    for i in range(3):
        app.put(f"k{i}", i, ["site-b", "site-c"])
    app.conn.close()
    for site in lr_sites:
        login = {**site.server.airflow_conn(site.dbname), "login": repl}
        monkeypatch.setenv(f"AIRFLOW_CONN_LR_TEST_{site.site_id.replace('-', '_').upper()}", json.dumps(login))
    sync = ["sync", "--topology", topo, "--until-idle", "--cycles", "10", "--interval", "0.01"]
    capsys.readouterr()
    assert cli.main(sync) == 1
    said = capsys.readouterr().out
    assert f"site-a->site-c/policy: ERROR role '{repl}' lacks a privilege this step needs on site 'site-c'" in said
    assert f"lr roles grant replicator --role {repl} --site" in said, said
    assert final_state(queue(sink_b, "site-a")) == source_state(source) and queue(sink_c, "site-a") == []
    made.grant(sink_c, "replicator", repl, create=False)
    assert cli.main(sync) == 0
    assert queue(sink_c, "site-a") == queue(sink_b, "site-a")  # each entry once
