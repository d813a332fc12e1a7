"""spark-submit of the fan-out job to a real standalone cluster (``spark://``), the way Airflow's
SparkSubmitOperator runs it: sites from ``$LR_CONNECTIONS_FILE``, nothing secret in argv, Spark
conf or output, and a Python worker killed mid-write on a cluster executor (Spark retries the
task) still delivers every entry exactly once."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest

from tests.support.session import sink_queue
from tests.support.spark_env import (
    QUICK_JIT,
    REPO_ROOT,
    SPARK_HOME,
    StandaloneCluster,
    expected_queue,
    in_log_entry_sync,
    spark_env,
    transmit_backlog,
    write_connections_file,
)

pytestmark = pytest.mark.slow


def test_submit_to_cluster_with_killed_worker_keeps_credentials_out(
    spark_cluster: StandaloneCluster, lr_sites, tmp_path, monkeypatch
):
    password = f"pw-{uuid.uuid4().hex}"
    conns = write_connections_file(tmp_path / "connections.json", lr_sites, password=password)
    monkeypatch.setenv("LR_CONNECTIONS_FILE", str(conns))
    topo = in_log_entry_sync(lr_sites)
    topology_file = tmp_path / "topology.json"
    topology_file.write_text(json.dumps(topo.document))
    transmit_backlog(lr_sites[0], 2000, per_txn=200)

    env = {
        **spark_env(),
        "LR_CONNECTIONS_FILE": str(conns),
        "LR_SPARK_LOG_LEVEL": "INFO",
        "LR_FAULT": "fanout_mid_write_p0_a0",
    }  # the first attempt of partition 0 dies mid-write
    cmd = [
        str(SPARK_HOME / "bin" / "spark-submit"),
        "--verbose",
        "--master",
        spark_cluster.url,
        "--conf",
        "spark.ui.enabled=false",
        "--conf",
        "spark.cores.max=1",
        "--conf",
        "spark.executor.memory=512m",
        "--conf",
        f"spark.executor.extraJavaOptions={QUICK_JIT}",
        "--conf",
        "spark.driver.host=127.0.0.1",
        "--conf",
        f"spark.executorEnv.PYTHONPATH={REPO_ROOT}",
        "--conf",
        f"spark.pyspark.python={sys.executable}",
        "--conf",
        "spark.task.maxFailures=3",
        str(REPO_ROOT / "spark_jobs" / "lr_fanout.py"),
        "--source",
        "site-a",
        "--topology",
        str(topology_file),
        "--partitions",
        "2",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]

    assert password not in " ".join(cmd)
    assert password not in output, "a password reached the job's output"
    assert "Spark properties used" in output and "spark.master" in output  # --verbose printed the conf
    assert "Python worker exited unexpectedly" in output or "Lost task 0.0" in output, "the fault fired"

    result = json.loads([line for line in proc.stdout.splitlines() if line.startswith("LR_RESULT ")][-1][10:])
    assert result["ok"] and result["partitions"] == 2
    for sink in lr_sites[1:]:
        assert sink_queue(sink, "policy") == expected_queue(lr_sites[0], sink.site_id, "policy")
    assert result["total_deliveries"] == sum(len(sink_queue(s, "policy")) for s in lr_sites[1:])
    assert result["peak_rss_kb"]["executor_python"] > 0 and result["peak_rss_kb"]["driver"] > 0
