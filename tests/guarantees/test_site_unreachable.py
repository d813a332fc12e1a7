"""A site that is down is not a misconfigured site: connecting says which (SiteUnreachableError is
retried, ConfigurationError is not), and lr sync's tee comes back after a source blip."""

from __future__ import annotations

import socket

import pytest

from airflow_provider_lr.engine.db.conninfo import ConnInfo, from_dsn
from airflow_provider_lr.engine.errors import ConfigurationError, SiteUnreachableError
from airflow_provider_lr.engine.session.settings import SessionSettings
from airflow_provider_lr.engine.site.replicator import Replicator
from tests.support.session import sink_queue
from tests.support.spark_env import expected_queue, in_log_entry_sync, lr_connections, transmit_backlog  # noqa: F401


def _closed_port() -> int:
    """A local port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _down(info: ConnInfo) -> ConnInfo:
    return ConnInfo({**info.params, "host": "127.0.0.1", "port": _closed_port(), "connect_timeout": 2}, info.site_id)


def test_a_server_that_is_not_there_is_unreachable_not_misconfigured(lr_sites):
    info = from_dsn(lr_sites[0].dsn)
    with pytest.raises(SiteUnreachableError, match="is the server up"):
        _down(info).connect()


def test_an_unknown_database_or_user_is_a_configuration_error(lr_sites):
    info = from_dsn(lr_sites[0].dsn)
    with pytest.raises(ConfigurationError, match="does not exist"):
        ConnInfo({**info.params, "dbname": "no_such_database"}, info.site_id).connect()
    with pytest.raises(ConfigurationError, match="does not exist"):
        ConnInfo({**info.params, "user": "no_such_role"}, info.site_id).connect()


def test_the_tee_is_used_again_after_the_source_was_briefly_down(lr_sites, lr_connections):
    """lr sync connects through ConnInfo; a source that is down for a cycle used to switch its tee
    off for the rest of the process (taken as "DSNs do not resolve")."""
    topo = in_log_entry_sync(lr_sites)
    transmit_backlog(lr_sites[0], 3000, per_txn=250)
    infos = {s.site_id: from_dsn(s.dsn) for s in lr_sites}
    source_down = True

    def connect(site_id: str):
        info = infos[site_id]
        return (_down(info) if site_id == "site-a" and source_down else info).connect()

    repl = Replicator(
        topo, connect, settings=SessionSettings(data_timeout=30.0, barrier_timeout=2.0, tee_min_backlog=1000)
    )
    reports = repl.run_cycle()  # the source is down: every session reports it, nothing raises
    assert all(r.error for r in reports), reports
    assert repl.teed == {}

    source_down = False
    repl.run(max_cycles=5, until_idle=True, interval=0.01)
    assert sum(repl.teed.values()) > 1000, "the backlog went by the tee once the source was back"
    for sink in lr_sites[1:]:
        assert sink_queue(sink, "policy") == expected_queue(lr_sites[0], sink.site_id, "policy")
