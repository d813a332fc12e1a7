"""Fault points: named places where a test can kill the running process for real.

``LR_FAULT=<name>`` in the environment makes the process SIGKILL itself when it reaches that
point (no cleanup, no rollback message: exactly like a crash). Unset, a fault point costs one
dictionary lookup.
"""
from __future__ import annotations

import os
import signal

FAULT_ENV = "LR_FAULT"


def fault_point(name: str) -> None:
    if os.environ.get(FAULT_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)
