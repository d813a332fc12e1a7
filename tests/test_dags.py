"""The DAGs parse, have the shape users rely on, and replicate real sites end to end (dag.test)."""
from __future__ import annotations

import pytest

from tests.airflow_support import airflow_db, airflow_sites, dagbag, run_dag, states, xcom  # noqa: F401
from tests.session_helpers import App, final_state, queue, source_state


def test_dags_import_without_errors(dagbag):
    assert dagbag.import_errors == {}
    assert {"lr_replication", "lr_full_sync", "lr_maintenance", "example_lr_user_pipeline"} <= set(dagbag.dags)


def test_replication_first_sync_then_deltas(dagbag, airflow_sites):
    source, sink_b, sink_c = airflow_sites.sites
    app = App(source)
    for i in range(5):
        app.put(f"k{i}", i, ["site-b", "site-c"])
    first = run_dag(dagbag, "lr_replication")
    got = states(first)
    print(got)
    assert str(first.state) == "success"
    for sink in (sink_b, sink_c):
        q = queue(sink, "site-a")
        assert q[0] == ("start", "") and q[-1] == ("end", "")
        assert final_state(q) == source_state(source)
    app.put("k1", 100, ["site-b"])
    app.put("k9", 9, ["site-b", "site-c"])
    second = run_dag(dagbag, "lr_replication")
    print(states(second))
    assert [p for k, p in queue(sink_b, "site-a") if k == "log"] == ["k1=100", "k9=9"]
    assert [p for k, p in queue(sink_c, "site-a") if k == "log"] == ["k9=9"]
    app.close()
