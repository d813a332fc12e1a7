"""Two `lr sync` share one source's sessions; one of them loses its links to the sinks (half-open:
the link stops forwarding, nothing closes) while it still reaches the source; the other reaches
every site. The cut-off member says, with its heartbeats, the sinks it cannot reach (V0050), and
the members give those sinks' sessions to the member that reaches them: every payload arrives
while the cut lasts. Before, the cut-off member kept its share for as long as the partition lasted
(alive at the source, its heartbeat going on), its cycles failing on `cannot connect to site
'site-b'` and retried, and replication stopped for those sessions until the link healed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.cli.test_cli_sync_members import ROOT, SINKS, Writers, lr_sync, stop, streaming, topology_file
from tests.support.link_proxy import LinkProxy
from tests.support.session import queue, wait_for


def proxied_lr_sync(topo: str, log, sites, proxies: dict[str, LinkProxy]) -> subprocess.Popen:
    """`lr sync` whose connections to every site go through that site's link."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for site in sites:
        conn = {**site.server.airflow_conn(site.dbname), "port": proxies[site.site_id].port}
        env[f"AIRFLOW_CONN_LR_TEST_{site.site_id.replace('-', '_').upper()}"] = json.dumps(conn)
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "airflow_provider_lr.cli", "sync", "--topology", topo],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def holders(source) -> int:
    return source.query("SELECT count(DISTINCT lease_owner) FROM lr.source_sessions WHERE lease_owner IS NOT NULL")[0][
        0
    ]


@pytest.mark.slow
def test_sinks_cut_off_from_one_of_two_lr_sync_are_served_by_the_other(lr_sites, tmp_path, monkeypatch):
    source, sink_b, sink_c = lr_sites
    topo = topology_file(tmp_path, lr_sites, monkeypatch)
    proxies = {s.site_id: LinkProxy(s.server.port) for s in lr_sites}
    cut_off = proxied_lr_sync(topo, tmp_path / "cut_off.log", lr_sites, proxies)
    healthy = lr_sync(topo, tmp_path / "healthy.log")
    try:
        wait_for(lambda: streaming(source) == 6 and holders(source) == 2, 60, "the sessions streaming, shared")
        with Writers(source) as writers:
            time.sleep(0.5)
            for sink in SINKS:  # the cut-off member's links to the sinks (its share holds sessions of one or both)
                proxies[sink].stall()
            time.sleep(1.0)
        # the healthy member reaches both sinks: it could deliver everything within the stream's sink
        # deadline (10 s) and a takeover, were the sessions handed to it
        wait_for(
            lambda: all(
                sum(k == "log" for k, _ in queue(sink, "site-a", client=c)) == writers.sent[c]
                for sink in (sink_b, sink_c)
                for c in writers.sent
            ),
            20,
            "every payload at both sinks",
        )
    finally:
        cut_off.kill()  # its stalled calls would hold a clean stop up to their deadlines
        stop(cut_off, healthy)
        for proxy in proxies.values():
            proxy.close()
