"""A replicator in its own process, so a fault point (``LR_FAULT``) can SIGKILL it for real.

Run as ``python -m tests.support.crash_runner '<json>'`` with ``{"topology": doc, "dsns": {site: dsn},
"providers": {client: "module:function"}, "owner": str, "lease_seconds": float, "cycles": int,
"settings": {SessionSettings field: value}, "stream": seconds, "check_interval": seconds}`` (settings override the defaults
below; with ``stream``, the replicator runs in streaming mode, as ``lr sync`` does, for that long).
"""

from __future__ import annotations

import json
import sys
import threading

import psycopg2

from airflow_provider_lr.engine.session.settings import SessionSettings, StreamSettings
from airflow_provider_lr.engine.session.stream import Streamer
from airflow_provider_lr.engine.site.replicator import Replicator
from airflow_provider_lr.engine.source.full_sync import load_provider
from airflow_provider_lr.engine.store import topology


def main(spec: dict) -> int:
    dsns = spec["dsns"]
    repl = Replicator(
        topology.from_document(spec["topology"]),
        lambda site_id: psycopg2.connect(dsns[site_id]),
        owner=spec.get("owner", "crash-runner"),
        settings=SessionSettings(
            **{"lease_seconds": spec.get("lease_seconds", 1.0), "barrier_timeout": 2.0, **spec.get("settings", {})}
        ),
        providers={c: load_provider(t) for c, t in spec.get("providers", {}).items()},
    )
    if spec.get("stream"):
        stop = threading.Event()
        threading.Timer(spec["stream"], stop.set).start()
        reports: list = []
        Streamer(repl, StreamSettings(check_interval=spec.get("check_interval", 0.2))).run(
            stop, interval=0.05, on_cycle=reports.extend
        )
    else:
        reports = repl.run(max_cycles=spec.get("cycles", 5), until_idle=True, interval=0.01)
    repl.close()
    print(json.dumps([r.__dict__ for r in reports], default=str))
    return 1 if any(r.error for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
