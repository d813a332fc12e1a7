"""The work whose memory tests/guarantees/test_memory_bounds.py measures, in a process of its own, so the peak
resident memory the kernel records for it (``VmHWM``, ``ru_maxrss``) is that work's and nothing else's.

Run as ``python -m tests.support.memory_runner '<json>'`` with ``{"mode": "sync" | "subscribe", ...}``:

* ``sync``: a Replicator over ``topology`` / ``dsns`` runs until idle (``settings``: SessionSettings
  overrides, e.g. ``tee_min_backlog`` 0 for the session path only, 1 for the read-once tee);
* ``subscribe``: a RoutingQueueSubscriber on ``dsn`` polls ``client`` until a pass delivers nothing
  (``subscriber``: constructor keywords, e.g. ``batch_size``); the listener checks every payload
  (``payload`` below: index order, size) and keeps none of them.

Prints one JSON line: ``{"peak_rss_kib": ..., "seconds": ..., ...}``.
"""

from __future__ import annotations

import json
import resource
import struct
import sys
import time

import psycopg2

HEAD = struct.Struct(">QQ")  # (index, size) at the front of every payload


def payload(index: int, size: int, filler: bytes) -> bytes:
    """Entry ``index`` of ``size`` bytes: its index and size, then ``filler`` (random: no TOAST
    compression, so the bytes on the wire are the bytes counted)."""
    return HEAD.pack(index, size) + filler[: size - HEAD.size]


def large_provider(ctx) -> None:
    """Full-sync provider: ``$LR_MEMORY_PROVIDER`` ("count:size") messages of ``payload`` form,
    made one at a time (the provider itself holds one)."""
    import os
    import random

    count, size = (int(v) for v in os.environ["LR_MEMORY_PROVIDER"].split(":"))
    filler = random.Random(23).randbytes(size)
    for n in range(count):
        ctx.transmit(payload(n, size, filler))


def peak_rss_kib() -> int:
    """This process's peak resident set (KiB): ``VmHWM``, or ``ru_maxrss`` where /proc is missing."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


class Checker:
    """A listener that checks each source's payloads arrive in index order with their stated size,
    and drops them (what a sink application applying them as they come would hold: nothing)."""

    def __init__(self) -> None:
        self.next: dict[str, int] = {}
        self.bytes = 0
        self.calls = 0
        self.largest_call = 0  # payload bytes of the largest callback
        self.errors: list[str] = []

    def _check(self, source: str, payloads: list[bytes]) -> bool:
        self.calls += 1
        size = 0
        for p in payloads:
            index, stated = HEAD.unpack_from(p)
            expected = self.next.get(source, 0)
            if index != expected or len(p) != stated:
                self.errors.append(f"{source}: got #{index} ({len(p)} B, says {stated}), expected #{expected}")
            self.next[source] = index + 1
            size += len(p)
        self.bytes += size
        self.largest_call = max(self.largest_call, size)
        return True

    def on_snapshot_sync_start(self, source: str) -> None: ...
    def on_snapshot_sync_complete(self, source: str) -> None: ...

    def on_snapshot_messages(self, source: str, payloads: list[bytes]) -> bool:
        return self._check(source, payloads)

    def on_log_entry_messages(self, source: str, payloads: list[bytes]) -> bool:
        return self._check(source, payloads)


def sync(spec: dict) -> dict:
    from airflow_provider_lr.engine.session.settings import SessionSettings
    from airflow_provider_lr.engine.site.replicator import Replicator
    from airflow_provider_lr.engine.store import topology

    dsns = spec["dsns"]
    repl = Replicator(
        topology.from_document(spec["topology"]),
        lambda site: psycopg2.connect(dsns[site]),
        owner="memory-runner",
        settings=SessionSettings(**{"barrier_timeout": 2.0, **spec.get("settings", {})}),
    )
    try:
        reports = repl.run(max_cycles=spec.get("cycles", 1000), until_idle=True, interval=0.01)
        delivered = dict(repl.teed)
    finally:
        repl.close()
    errors = [r.error for r in reports if r.error]
    return {"errors": errors, "teed": delivered, "states": [r.state for r in reports]}


def subscribe(spec: dict) -> dict:
    from airflow_provider_lr.subscriber import RoutingQueueSubscriber

    checker = Checker()
    with RoutingQueueSubscriber(
        spec["dsn"], client_name=spec.get("client", "policy"), **spec.get("subscriber", {})
    ) as sub:
        delivered = 0
        while True:
            n = sub.poll(checker, max_messages=spec.get("max_messages"))
            delivered += n
            if not n:
                break
        stats = sub.stats
    return {
        "delivered": delivered,
        "bytes": checker.bytes,
        "calls": checker.calls,
        "largest_call": checker.largest_call,
        "next": checker.next,
        "errors": checker.errors + stats.errors,
        "failures": stats.failures,
    }


def main(spec: dict) -> int:
    started = time.monotonic()
    out = {"sync": sync, "subscribe": subscribe}[spec["mode"]](spec)
    out.update(seconds=round(time.monotonic() - started, 1), peak_rss_kib=peak_rss_kib())
    print(json.dumps(out))
    return 1 if out["errors"] else 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
