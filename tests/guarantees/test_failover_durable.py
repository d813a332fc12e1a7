"""A failover's, a rejoin's, a topology apply's and a full-sync request's commits are on the site's
disk before the command says it is done, also on a server whose `synchronous_commit` is `off`
(lr's fenced sink writes are made durable there: crash-windows.md row 9). The test servers commit
asynchronously (tests/conftest.py); the site's WAL writer is stalled, so its asynchronous commits
stay in memory, and its server crashes (every process killed) right after the command returns."""

from __future__ import annotations

import pytest

from airflow_provider_lr import cli
from tests.cli.test_cli_sync import topology_file
from tests.guarantees.test_async_sink_commits import _crash, _wal_flushers_stalled
from tests.support.session import App

# a database made in the background meanwhile (tests/conftest.py) would flush the WAL the test keeps unflushed
pytestmark = pytest.mark.quiet_servers


def _topology_id(site) -> str | None:
    found = site.query("SELECT topology_config_id FROM lr.topology")
    return found[0][0] if found else None


def test_a_sink_crashing_right_after_a_switchover_keeps_its_fence_and_the_new_topology(
    lr_sites, site_manager, tmp_path, monkeypatch
):
    """Before, the sink's fence, reconcile and new topology were committed asynchronously: the sink
    came back with the old topology and its session from the old source open, so the new source's
    sessions to it were refused (`topology config id mismatch`) and the old source's replicator
    could write there again, though `lr failover` had said the switchover was done."""
    source, sink_b, sink_c = lr_sites
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    App(source).put("k1", 1, ["site-b", "site-c"])
    assert cli.main(["sync", "--topology", topo, "--until-idle"]) == 0
    new = tmp_path / "new.yaml"
    with _wal_flushers_stalled(sink_c):
        assert cli.main(["failover", "--topology", topo, "--promote", "site-b", "--out", str(new)]) == 0
        _crash(site_manager, sink_c)
    site_manager.up(site_ids=[sink_c.site_id])
    assert _topology_id(sink_c) == _topology_id(sink_b), "the sink runs the failover's topology"
    fenced = sink_c.query("SELECT client_name, failed_over_to FROM lr.sink_sessions WHERE source_site_id = 'site-a'")
    assert fenced == [("policy", "site-b")], "the old source's session stays closed at the sink"


def test_a_site_crashing_right_after_a_topology_apply_keeps_the_topology(lr_sites, site_manager, tmp_path, monkeypatch):
    """`lr topology apply` said `applied` on every site, and a site that crashed then came back with
    the topology it had before: every session with it refused (`topology config id mismatch`)."""
    _, _, sink_c = lr_sites
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    with _wal_flushers_stalled(sink_c):
        assert cli.main(["topology", "apply", "--topology", topo]) == 0
        applied = _topology_id(lr_sites[0])
        _crash(site_manager, sink_c)
    site_manager.up(site_ids=[sink_c.site_id])
    assert _topology_id(sink_c) == applied


def test_a_full_sync_asked_is_kept_by_a_source_crashing_right_after(lr_sites, site_manager, tmp_path, monkeypatch):
    """`lr full-sync` said `requested`, and a source that crashed then came back without the request:
    the full sync was never carried out, and nothing said so."""
    source = lr_sites[0]
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    App(source).put("k1", 1, ["site-b", "site-c"])
    assert cli.main(["sync", "--topology", topo, "--until-idle"]) == 0
    with _wal_flushers_stalled(source):
        assert cli.main(["full-sync", "--topology", topo, "--sink", "site-c", "--reason", "asked"]) == 0
        _crash(site_manager, source)
    site_manager.up(site_ids=[source.site_id])
    asked = source.query("SELECT sink_site_id, status FROM lr.full_sync_requests WHERE reason = 'asked'")
    assert asked == [("site-c", "pending")]


def test_a_table_opened_is_kept_by_a_source_crashing_right_after(lr_sites, site_manager, tmp_path, monkeypatch):
    """`lr tables open` said the table is federated, and a source that crashed then came back without
    it: its applications' changes were no longer captured, and nothing said so."""
    source = lr_sites[0]
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    assert cli.main(["topology", "apply", "--topology", topo]) == 0
    source.query("CREATE TABLE public.items (id int PRIMARY KEY, v text)")
    source.query("CHECKPOINT")  # the table itself on disk: what the crash may lose is the open alone
    with _wal_flushers_stalled(source):
        assert cli.main(["tables", "open", "public.items", "--client", "policy", "--topology", topo]) == 0
        _crash(site_manager, source)
    site_manager.up(site_ids=[source.site_id])
    assert source.query("SELECT stream_name, is_federated FROM lr.registry WHERE kind = 'table'") == [
        ("public.items", True)
    ]


def test_grants_given_by_lr_roles_are_kept_by_a_site_crashing_right_after(
    lr_sites, site_manager, tmp_path, monkeypatch
):
    """`lr roles grant` said `granted`, and a site that crashed then came back without the role's
    grants (and its row of lr.role_grants): the writer's transmits were refused, though the command
    had said it was done."""
    from tests.engine.site.test_roles import Roles

    source = lr_sites[0]
    assert cli.main(["topology", "apply", "--topology", topology_file(tmp_path, lr_sites, monkeypatch)]) == 0
    made = Roles(lr_sites)
    try:
        role = made.name("writer")
        source.query(f'CREATE ROLE "{role}" LOGIN')
        source.query("CHECKPOINT")  # the role itself on disk: what the crash may lose is the grant alone
        with _wal_flushers_stalled(source):
            granted = ["roles", "grant", "writer", "--client", "policy", "--role", role, "--site", source.dsn]
            assert cli.main(granted) == 0
            _crash(site_manager, source)
        site_manager.up(site_ids=[source.site_id])
        kept = source.query("SELECT kind, client_name FROM lr.role_grants WHERE role_name = %s", (role,))
        assert kept == [("writer", "policy")]
    finally:
        made.drop()
