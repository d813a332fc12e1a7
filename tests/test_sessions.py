"""Replication sessions end to end against real sites: negotiation, snapshot sync, log-entry sync."""
from __future__ import annotations

from tests.session_helpers import App, apply, final_state, queue, replicator, source_state, table_provider, empty_provider


def test_first_contact_with_client_data_then_deltas(lr_sites):
    source, sink_b, sink_c = lr_sites
    topo = apply(lr_sites, [{"source": "site-a", "sinks": ["site-b", "site-c"], "clients": ["policy"]}])
    app = App(source)
    for i in range(5):
        app.put(f"k{i}", i, ["site-b", "site-c"])
    repl = replicator(topo, lr_sites, providers={"policy": table_provider})
    reports = repl.run(max_cycles=3, until_idle=True, interval=0.01)
    assert all(not r.error for r in reports), reports
    for sink in (sink_b, sink_c):
        q = queue(sink, "site-a")
        assert q[0] == ("start", "") and q[-1] == ("end", ""), q
        assert sorted(p for k, p in q if k == "snap") == [f"k{i}={i}" for i in range(5)]
        assert [k for k, _ in q].count("log") == 0  # covered by the snapshot: not sent again
    app.put("k1", 100, ["site-b"])
    app.put("k9", 9, ["site-b", "site-c"])
    repl.run(max_cycles=3, until_idle=True, interval=0.01)
    assert [p for k, p in queue(sink_b, "site-a") if k == "log"] == ["k1=100", "k9=9"]
    assert [p for k, p in queue(sink_c, "site-a") if k == "log"] == ["k9=9"]
    assert final_state(queue(sink_b, "site-a")) == source_state(source)
    repl.close()
    app.close()
