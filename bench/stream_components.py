"""Where one streamed entry's time goes: the service time of each step, measured in one process.

The model behind the lag figures of ``streaming_bench.py`` (docs/streaming.md "Where the time goes"):
one writer commits one entry at a time and waits until the sink application has it before the
next, so nothing queues and each step's own time shows. Timestamps (``time.perf_counter_ns``) are
taken just before the writer's commit, when it returns, when the stream's routed read starts and
ends, when each sink transaction has committed, and when the subscriber's listener is called.

Servers: 3 embedded PostgreSQL servers (``SiteManager``), PostgreSQL's default durability,
site-a → site-b, site-c, client ``bench``. The replicator streams in this process (``Streamer``,
the stream ``lr sync`` runs) and one ``RoutingQueueSubscriber.run`` thread per sink delivers.

Run: .venv/bin/python bench/stream_components.py [--entries 400] [--keep]
Prints medians and p90 per step; writes bench/results/stream_components.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psycopg2

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))

from airflow_provider_lr.client import RoutingQueueClient  # noqa: E402
from airflow_provider_lr.embedded.sites import SiteManager  # noqa: E402
from airflow_provider_lr.engine.db import schema  # noqa: E402
from airflow_provider_lr.engine.session import stream_writes  # noqa: E402
from airflow_provider_lr.engine.session.settings import SessionSettings  # noqa: E402
from airflow_provider_lr.engine.session.stream import Streamer  # noqa: E402
from airflow_provider_lr.engine.site import topology  # noqa: E402
from airflow_provider_lr.engine.site.replicator import Replicator  # noqa: E402
from airflow_provider_lr.engine.source import routed_read  # noqa: E402
from airflow_provider_lr.engine.store.topology import from_document  # noqa: E402
from airflow_provider_lr.subscriber import RoutingQueueSubscriber  # noqa: E402

SINKS = ["site-b", "site-c"]
CLIENT = "bench"


class Clock:
    """The moments of the entry in flight (one at a time)."""

    def __init__(self) -> None:
        self.marks: dict[str, int] = {}
        self.arrived = threading.Event()
        self.waiting: set[str] = set()

    def mark(self, what: str) -> None:
        self.marks.setdefault(what, time.perf_counter_ns())


def instrument(clock: Clock) -> None:
    """Timestamps around the stream's read and sink writes (wrapping the module's functions)."""
    read = routed_read.read_routed

    def timed_read(*args, **kwargs):
        started = time.perf_counter_ns()
        batch = read(*args, **kwargs)
        if batch is not None and batch.entries:
            clock.marks.setdefault("read_start", started)
            clock.mark("read_end")
        return batch

    routed_read.read_routed = timed_read
    apply = stream_writes.apply_site

    def timed_apply(conn, jobs, source):
        done = apply(conn, jobs, source)
        for member, batch in jobs:
            if batch.entries:
                clock.mark(f"sink_{member.key.sink}")
        return done

    stream_writes.apply_site = timed_apply


class Listener:
    def __init__(self, clock: Clock, sink: str) -> None:
        self.clock, self.sink = clock, sink

    def on_snapshot_sync_start(self, source):
        return True

    def on_snapshot_messages(self, source, payloads):
        return True

    def on_snapshot_sync_complete(self, source):
        return True

    def on_log_entry_messages(self, source, payloads):
        self.clock.mark(f"listener_{self.sink}")
        self.clock.waiting.discard(self.sink)
        if not self.clock.waiting:
            self.clock.arrived.set()
        return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=400)
    parser.add_argument("--gap", type=float, default=0.001, help="seconds between entries (probe pace)")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="lr-stream-components-"))
    manager = SiteManager(home)
    try:
        servers = manager.up(count=3)
        dsns = {s.site_id: s.dsn() for s in servers}
        for s in servers:
            conn = psycopg2.connect(s.dsn())
            schema.init_site(conn, s.site_id, s.region)
            conn.close()
        topo = from_document(
            {
                "sites": [{"id": s.site_id, "region": s.region} for s in servers],
                "replication": [{"source": "site-a", "sinks": SINKS, "clients": [CLIENT]}],
                "providers": {CLIENT: "streaming_common:empty_full_state"},
            }
        )
        for s in servers:
            conn = psycopg2.connect(s.dsn())
            topology.apply_to_site(conn, topo, s.site_id)
            conn.close()
        clock = Clock()
        instrument(clock)
        repl = Replicator(
            topo,
            lambda site: psycopg2.connect(dsns[site]),
            settings=SessionSettings(barrier_timeout=2.0),
            providers={CLIENT: lambda ctx: None},
        )
        stop = threading.Event()
        streamer = Streamer(repl)
        threads = [threading.Thread(target=streamer.run, args=(stop,), kwargs={"interval": 0.05}, daemon=True)]
        for sink in SINKS:
            sub = RoutingQueueSubscriber(dsns[sink], CLIENT)
            threads.append(threading.Thread(target=sub.run, args=(Listener(clock, sink), stop), daemon=True))
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while set(repl.sessions) - streamer.streaming:
            assert time.monotonic() < deadline, "the sessions did not start streaming"
            time.sleep(0.05)
        writer = psycopg2.connect(dsns["site-a"])
        client = RoutingQueueClient(writer, CLIENT)
        samples: list[dict[str, int]] = []
        for i in range(args.entries + 20):  # the first 20 warm up
            clock.marks, clock.waiting = {}, set(SINKS)
            clock.arrived.clear()
            client.transmit_log_entry_message(b"x" * 256, SINKS)
            clock.mark("commit_start")
            writer.commit()
            clock.mark("commit_end")
            assert clock.arrived.wait(10), f"entry {i} did not arrive"
            time.sleep(args.gap)  # between commits, as at a rate of 1/gap
            if i >= 20:
                samples.append(dict(clock.marks))
        stop.set()
        writer.close()
        steps = {
            "writer commit": ("commit_start", "commit_end"),
            "commit → stream's read starts (probe wake-up)": ("commit_end", "read_start"),
            "routed read": ("read_start", "read_end"),
            "sink transaction (first sink done)": ("read_end", "first_sink"),
            "→ subscriber's listener (wake-up, read)": ("first_sink", "first_listener"),
            "commit start → listener (lag)": ("commit_start", "first_listener"),
        }
        figures = {}
        for (
            s
        ) in samples:  # a sample whose sink write was not seen (its entry rode a general-path read) has no sink step
            sinks = [v for k, v in s.items() if k.startswith("sink_")]
            if sinks:
                s["first_sink"] = min(sinks)
            s["first_listener"] = min(v for k, v in s.items() if k.startswith("listener_"))
        for name, (a, b) in steps.items():
            values = sorted((s[b] - s[a]) / 1e6 for s in samples if a in s and b in s)
            figures[name] = {
                "p50_ms": round(statistics.median(values), 3),
                "p90_ms": round(values[int(0.9 * (len(values) - 1))], 3),
            }
            print(f"{name:50s} p50 {figures[name]['p50_ms']:7.3f} ms   p90 {figures[name]['p90_ms']:7.3f} ms")
        out = BENCH / "results" / "stream_components.json"
        out.write_text(json.dumps({"entries": args.entries, "steps": figures}, indent=2) + "\n")
        print(f"wrote {out}")
        repl.close()
        return 0
    finally:
        manager.down(mode="immediate", remove=not args.keep)
        if not args.keep:
            shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
