"""The topology: validated from YAML, versioned by its config id, recorded on and read back from sites."""

from __future__ import annotations

import subprocess
import sys

import pytest

from airflow_provider_lr.engine.errors import ConfigurationError
from airflow_provider_lr.engine.site import topology
from airflow_provider_lr.engine.store import topology as topologies

DOC = {
    "sites": [{"id": "site-a", "region": "eu"}, {"id": "site-b", "region": "us"}, {"id": "site-c"}],
    "replication": [{"source": "site-a", "sinks": ["site-b", "site-c"], "clients": ["policy", "audit"]}],
}


def test_sessions_are_one_per_destination_and_client():
    topo = topologies.from_document(DOC)
    assert [str(k) for k in topo.sessions()] == [
        "site-a->site-b/audit",
        "site-a->site-b/policy",
        "site-a->site-c/audit",
        "site-a->site-c/policy",
    ]
    assert topo.sessions(source="site-b") == []


def test_any_change_gives_a_new_config_id_and_key_order_does_not():
    base = topologies.from_document(DOC).topology_config_id
    reordered = {"replication": DOC["replication"], "sites": DOC["sites"]}
    assert topologies.from_document(reordered).topology_config_id == base
    moved = {**DOC, "sites": [{**DOC["sites"][0], "region": "asia"}, *DOC["sites"][1:]]}
    assert topologies.from_document(moved).topology_config_id != base


@pytest.mark.parametrize(
    "doc, error",
    [
        ({"sites": []}, "sites: \\[\\] should be non-empty"),
        ({"sites": [{"id": "Site A"}]}, "sites\\[0\\].id: 'Site A' is not a valid site id"),
        ({"sites": [{"id": "a"}, {"id": "a"}]}, "appears twice"),
        (
            {"sites": [{"id": "a"}], "replication": [{"source": "a", "sinks": ["b"], "clients": ["c"]}]},
            "unknown site 'b'",
        ),
        ({"sites": [{"id": "a"}], "replication": [{"source": "a", "sinks": ["a"], "clients": ["c"]}]}, "to itself"),
        (
            {"sites": [{"id": "a"}, {"id": "b"}], "replication": [{"source": "a", "sinks": ["b"]}]},
            "'clients' is a required property",
        ),
        (
            {
                "sites": [{"id": "a"}, {"id": "b"}],
                "replication": [{"source": "a", "sinks": ["b"], "clients": ["x'; DROP TABLE t;--"]}],
            },
            "is not a valid client name",
        ),
        ({"sites": [{"id": "a"}], "providers": {"c": "no_colon"}}, "package.module:function"),
        (
            {
                "sites": [{"id": "s"}, {"id": "b_c"}, {"id": "c"}],
                "replication": [
                    {"source": "b_c", "sinks": ["s"], "clients": ["a"]},
                    {"source": "c", "sinks": ["s"], "clients": ["a_b"]},
                ],
            },
            "one receive queue 'LRQ_Recv_a_b_c'",
        ),
        # Airflow reads a connection id from AIRFLOW_CONN_<ID upper-cased>: lr_a and LR_A are one database
        (
            {"sites": [{"id": "a", "conn_id": "lr_a"}, {"id": "b", "conn_id": "LR_A"}]},
            "sites 'a' and 'b' name connections 'lr_a' and 'LR_A', one database .*AIRFLOW_CONN_LR_A",
        ),
        ({"sites": [{"id": "a"}, {"id": "b", "conn_id": "A"}]}, "sites\\[1\\].conn_id: sites 'a' and 'b' name"),
        ({"sites": [{"id": "a", "conn_id": "x"}, {"id": "b", "conn_id": "x"}]}, "name one connection 'x'"),
        # client names are case-sensitive: two equal but for case are refused as a typo, naming both
        (
            {
                "sites": [{"id": "a"}, {"id": "b"}],
                "replication": [{"source": "a", "sinks": ["b"], "clients": ["policy", "Policy"]}],
            },
            "clients 'policy' and 'Policy' differ only in case",
        ),
        (
            {
                "sites": [{"id": "a"}, {"id": "b"}],
                "replication": [{"source": "a", "sinks": ["b"], "clients": ["policy"]}],
                "providers": {"POLICY": "m:f"},
            },
            "providers.POLICY: clients 'policy' and 'POLICY' differ only in case",
        ),
    ],
)
def test_bad_topologies_are_refused_with_the_reason(doc, error):
    with pytest.raises(ConfigurationError, match=error):
        topologies.from_document(doc)


def test_dsns_differing_in_case_are_two_databases():
    # a DSN is read as written (no AIRFLOW_CONN_ variable): database names are case-sensitive
    doc = {"sites": [{"id": "a", "conn_id": "host=h dbname=lr"}, {"id": "b", "conn_id": "host=h dbname=LR"}]}
    assert topologies.from_document(doc).conn_id("b") == "host=h dbname=LR"


def test_missing_file_names_the_override(tmp_path):
    with pytest.raises(ConfigurationError, match="LR_TOPOLOGY"):
        topologies.load(tmp_path / "nope.yaml")


def test_applied_topology_is_read_back_from_the_site(lr_sites):
    doc = {**DOC, "sites": [{"id": s.site_id, "region": s.region} for s in lr_sites]}
    topo = topologies.from_document(doc)
    conn = lr_sites[0].connect()
    with pytest.raises(ConfigurationError, match="lr topology apply"):
        topologies.from_site(conn)
    topology.apply_to_site(conn, topo, "site-a")
    back = topologies.from_site(conn)
    assert back.topology_config_id == topo.topology_config_id and back.sessions() == topo.sessions()
    sessions = lr_sites[0].query("SELECT sink_site_id, client_name FROM lr.source_sessions ORDER BY 1, 2")
    assert sessions == [(k.sink, k.client) for k in topo.sessions()]
    conn.close()


# a writer whose files may not grow past 64 bytes (a disk that fills): its writes fail half-way
_WRITE_UNDER_A_FULL_DISK = """
import resource, signal, sys
from airflow_provider_lr.engine.store import topology as topologies
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))
doc = {"sites": [{"id": "site-a", "region": "asia"}, {"id": "site-b"}],
       "replication": [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}]}
topologies.write_document(topologies.from_document(doc), sys.argv[1])
"""


def test_a_topology_file_whose_write_fails_half_way_leaves_the_last_whole_one(tmp_path):
    """The topology a failover writes is whole or absent: a write that fails half-way (a real one:
    its process may not write past 64 bytes) leaves the file that was there, and no fragment."""
    first = topologies.from_document(DOC)
    out = topologies.write_document(first, tmp_path / "new" / "topology.yaml")
    failed = subprocess.run(
        [sys.executable, "-c", _WRITE_UNDER_A_FULL_DISK, str(out)], capture_output=True, text=True, timeout=60
    )
    assert failed.returncode != 0 and "File too large" in failed.stderr, failed.stderr
    assert topologies.load(out).topology_config_id == first.topology_config_id
    assert sorted(p.name for p in out.parent.iterdir()) == ["topology.yaml"]
