"""What every lr Spark job's driver shares: its Spark session, logging, and the ``LR_RESULT`` line.

Runs only on the driver (the jobs' partition functions reference the engine and pyspark, never
this module, so executors need nothing but the installed package). Credentials: a job resolves
sites through ``engine.topology.site_conninfo`` (``AIRFLOW_CONN_<ID>`` or ``$LR_CONNECTIONS_FILE``),
never from its arguments; DSNs reach the executors inside the pickled task closure only, and what
is logged or printed goes through ``ConnInfo.safe_dsn`` or names sites by id.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession

from airflow_provider_lr.engine.bulk.peak_memory import process_peak_kb
from airflow_provider_lr.engine.db.explained import failure, refused_kind
from airflow_provider_lr.engine.errors import ConfigurationError, LRError, require_counts
from airflow_provider_lr.engine.store import topology as topologies

RESULT_PREFIX = "LR_RESULT "
DEFAULT_MASTER = "local[*]"

log = logging.getLogger("lr.spark")


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--topology",
        default=None,
        help=f"topology YAML (default: ${topologies.TOPOLOGY_ENV} or the shipped include/topology.yaml)",
    )
    p.add_argument(
        "--result-file",
        default=None,
        help="also write the result's JSON to this file (how LRSparkFanOutOperator reads it)",
    )
    return p


def count(text: str) -> int:
    """An argument that counts something (chunks, tasks, entries): refused before Spark starts
    unless a whole number of at least 1 (``errors.require_counts``)."""
    try:
        value = int(text)
        require_counts(value=value)
    except (ValueError, ConfigurationError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1") from None
    return value


def spark_session(app_name: str) -> SparkSession:
    """The session spark-submit configured (its ``--master``), else ``local[*]``."""
    builder = SparkSession.builder.appName(app_name)
    if "PYSPARK_GATEWAY_PORT" not in os.environ:  # run by plain python, not by spark-submit
        builder = builder.master(os.environ.get("LR_SPARK_MASTER", DEFAULT_MASTER))
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel(os.environ.get("LR_SPARK_LOG_LEVEL", "WARN"))
    return session


def warm_up(spark: SparkSession) -> float:
    """Start the Python workers and import the engine in them before the timed work (a fresh
    context's first job pays ~2 s for that); returns the seconds it took. Part of the Spark start."""
    started = time.monotonic()
    n = spark.sparkContext.defaultParallelism

    def load(_: object) -> int:
        import airflow_provider_lr.engine.bulk.fanout  # noqa: F401

        return 1

    spark.sparkContext.parallelize(range(n), n).map(load).collect()
    return round(time.monotonic() - started, 3)


def jvm_peak_kb(spark: SparkSession) -> int:
    """Peak resident memory of the driver's JVM (in local mode it runs the executors too)."""
    try:
        pid = int(spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid())
    except Exception:
        return 0
    return process_peak_kb(pid)


def run(main: Callable[[argparse.Namespace], dict[str, Any]], args: argparse.Namespace) -> int:
    """Run a job body: print ``LR_RESULT {json}`` (and write the JSON to ``--result-file``), and
    return the exit code (0 only when ok)."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        result = main(args)
    except LRError as exc:
        log.error("%s", exc)
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "error_kind": refused_kind(exc)}
    except Exception as exc:  # report it in the result line too; the traceback goes to stderr
        traceback.print_exc()
        # ``failure``: a missing grant names the role and the grant to give; ``error_kind``: whether a
        # retry mends it, for the operator's one rule (``operators/common.refused_for_good``)
        result = {"ok": False, "error": failure(exc), "error_kind": refused_kind(exc)}
    line = json.dumps(result, sort_keys=True, default=str)
    print(RESULT_PREFIX + line, flush=True)
    if args.result_file:
        Path(args.result_file).write_text(line)
    return 0 if result.get("ok") else 1


def load_topology(path: str | None) -> topologies.Topology:
    return topologies.load(path)
