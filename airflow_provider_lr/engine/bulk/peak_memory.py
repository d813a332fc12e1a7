"""Peak resident memory of the processes a bulk run goes through (Linux ``ru_maxrss`` and
``/proc``): the fan-out and the snapshot transfer report it in their results, so their memory
bounds (docs/memory.md) are checked on every run, not assumed."""

from __future__ import annotations

import os
import resource


def peak_rss_kb() -> int:
    """This process's peak resident memory (KiB, Linux ``ru_maxrss``)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def _status(pid: int) -> dict[str, str]:
    """``/proc/<pid>/status`` as a dict (``Name``, ``PPid``, ``VmHWM``, ...)."""
    with open(f"/proc/{pid}/status") as handle:
        return dict(line.split(":", 1) for line in handle.read().splitlines() if ":" in line)


def _vm_hwm(status: dict[str, str]) -> int:
    return int(status.get("VmHWM", "0 kB").split()[0])


def process_peak_kb(pid: int) -> int:
    """Peak resident memory (KiB) of process ``pid`` (e.g. the driver's JVM); 0 if /proc cannot tell."""
    try:
        return _vm_hwm(_status(pid))
    except (OSError, ValueError):
        return 0


def ancestor_peak_kb(command: str) -> int:
    """Peak resident memory (KiB) of the nearest ancestor process named ``command`` (e.g. the
    executor JVM above a Spark Python worker); 0 if there is none or /proc is unreadable."""
    pid = os.getppid()
    try:
        while pid > 1:
            status = _status(pid)
            if status.get("Name", "").strip() == command:
                return _vm_hwm(status)
            pid = int(status.get("PPid", "0").strip())
    except (OSError, ValueError):
        pass
    return 0
