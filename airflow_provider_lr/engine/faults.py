"""Fault points: named places where a test can kill the running process for real.

``LR_FAULT=<name>`` in the environment makes the process SIGKILL itself when it reaches that
point (no cleanup, no rollback message: exactly like a crash); ``LR_FAULT=<name>:stall=<seconds>``
makes it sleep there instead (a slow task or executor, e.g. to make Spark speculate). Unset, a
fault point costs one dictionary lookup and one environment lookup.

In-process race tests use :func:`on_fault` instead: the callback runs at the point (for example a
trim committed on another connection between two batches), deterministically, with no thread.

Every fault point lr has is listed in ``FAULT_POINTS`` (docs/crash-windows.md says what a crash at
each one leaves and why the next cycle repairs it; ``tests/guarantees/test_crash_windows.py`` kills there).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

FAULT_ENV = "LR_FAULT"

# name -> the window it sits in (one row of docs/crash-windows.md each)
FAULT_POINTS: dict[str, str] = {
    "after_lease": "lease taken on the source, the sink not fenced yet",
    "after_fence": "sink fenced at the new epoch, nothing decided on the source yet",
    "after_request": "full-sync request recorded on the source, not supplied yet",
    "during_supply": "the provider's supplying transaction open on the source, not committed",
    "after_snapshot_start": "SNAPSHOT_START committed on the sink, no data transferred",
    "after_snapshot_chunk": "a chunk of full-sync data committed (invisible) on the sink",
    "before_snapshot_apply": "transfer complete on the sink, not applied",
    "after_snapshot_apply": "snapshot applied on the sink, the source's request still open",
    "after_sink_apply": "log-entry batch committed on the sink, the source's ack not recorded",
    "stream_after_sink_apply": "streamed batch committed on the sink, the lazy ack not recorded yet",
    "after_timeout": "request timed out on the source, the next request not made",
    "fanout_mid_write": "fan-out chunk half written into the sinks' open transactions",
    "fanout_after_commit": "fan-out chunk committed on every sink, the source's acks not recorded",
    "fanout_after_stage": "staged fan-out chunk committed (invisible) on the sinks, not published",
    "table_snapshot_before_commit": "a table's snapshot rows written in the sinks' open transactions, not committed",
    "failover_after_fence": "sinks of the old source fenced, the new source not promoted yet",
    "failover_after_promote": "the new source promoted and recorded, no other sink reconciled yet",
    "failover_after_reconcile": "one sink reconciled with the new source, the others not yet",
    "peer_seed_before_commit": "a peer's tables and position written in the sink's open transaction, not committed",
    "after_peer_seed": "the sink seeded from a peer and committed, the source's session not recorded yet",
    "table_range_before_commit": "a Spark task's key range written in the sinks' open transactions, not committed",
}

_hooks: dict[str, Callable[[], None]] = {}


def fault_point(name: str) -> None:
    if _hooks:
        hook = _hooks.get(name)
        if hook is not None:
            hook()
    armed = os.environ.get(FAULT_ENV)
    if armed == name:
        os.kill(os.getpid(), signal.SIGKILL)
    elif armed and armed.startswith(name + ":stall="):
        time.sleep(float(armed.partition(":stall=")[2]))


def hooked() -> bool:
    """Whether an in-process callback waits at some fault point (the fan-out arms its points then)."""
    return bool(_hooks)


@contextmanager
def on_fault(name: str, callback: Callable[[], None]) -> Iterator[None]:
    """Run ``callback`` each time this process reaches fault point ``name`` (tests of races)."""
    _hooks[name] = callback
    try:
        yield
    finally:
        _hooks.pop(name, None)
