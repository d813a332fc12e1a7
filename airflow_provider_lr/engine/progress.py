"""Progress of long work (a full sync's supply, transfer and apply; a large catch-up), with rate
and ETA, for whoever shows it.

The engine reports; it does not decide how progress is shown. By default progress goes to the
``airflow_provider_lr.progress`` logger at most every ``LOG_EVERY`` seconds (so an Airflow task
log gets a line every few seconds, never one per batch); the ``lr`` command replaces that with
progress bars on a terminal (``listen``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("airflow_provider_lr.progress")
LOG_EVERY = 5.0  # seconds between two log lines of one task


@dataclass
class Progress:
    """One piece of long work: ``done`` of ``total`` (None: not known in advance) ``unit``."""

    task: str
    total: int | None = None
    unit: str = "entries"
    done: int = 0
    finished: bool = False
    stopped: bool = False  # finished short of its end: the rest is left for later (a paused transfer, a stop)
    started: float = field(default_factory=time.monotonic)

    @property
    def rate(self) -> float:
        elapsed = time.monotonic() - self.started
        return self.done / elapsed if elapsed > 0 else 0.0

    @property
    def eta_seconds(self) -> float | None:
        if self.total is None or not self.rate or self.done >= self.total:
            return None
        return (self.total - self.done) / self.rate

    def describe(self) -> str:
        of = f" of {self.total:,}" if self.total is not None else ""
        eta = f", ETA {self.eta_seconds:.0f}s" if self.eta_seconds is not None else ""
        took = time.monotonic() - self.started
        if self.finished:  # a transfer paused at 90,000 of 160,002 said "done in 5.1s"
            state = f"stopped after {took:.1f}s, the rest later" if self.stopped else f"done in {took:.1f}s"
        else:
            state = f"{self.rate:,.0f} {self.unit}/s{eta}"
        return f"{self.task}: {self.done:,}{of} {self.unit} ({state})"


Listener = Callable[[Progress], None]
_listeners: list[Listener] = []
_lock = threading.Lock()


class LogEvery:
    """A listener writing to ``logger``: a line per piece of work every ``every`` seconds, and one
    at its end when it took a second or more (short work says nothing). The default listener, and
    the one an Airflow task points at its own log."""

    def __init__(self, logger: logging.Logger | Any = log, every: float = LOG_EVERY, prefix: str = "") -> None:
        self.logger, self.every, self.prefix = logger, every, prefix
        self.last: dict[int, float] = {}

    def __call__(self, progress: Progress) -> None:
        now = time.monotonic()
        key = id(progress)
        if progress.finished:
            self.last.pop(key, None)
            if now - progress.started >= 1.0:
                self.logger.info("%s%s", self.prefix, progress.describe())
        elif now - self.last.setdefault(key, progress.started) >= self.every:
            self.last[key] = now
            self.logger.info("%s%s", self.prefix, progress.describe())


_default = LogEvery()


def _notify(progress: Progress) -> None:
    with _lock:
        listeners = list(_listeners) or [_default]
    for listener in listeners:
        listener(progress)


class Tracker:
    """What the engine holds while it works: ``advance``/``update`` as work gets done, ``finish``."""

    def __init__(self, task: str, total: int | None = None, unit: str = "entries") -> None:
        self.progress = Progress(task, total, unit)
        _notify(self.progress)

    def update(self, done: int, total: int | None = None) -> None:
        self.progress.done = done
        if total is not None:
            self.progress.total = total
        _notify(self.progress)

    def advance(self, n: int) -> None:
        self.update(self.progress.done + n)

    def finish(self, stopped: bool = False) -> None:
        """The work ended: all of it, or (``stopped``) paused or stopped short of its end."""
        if not self.progress.finished:
            self.progress.finished, self.progress.stopped = True, stopped
            _notify(self.progress)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()


def track(task: str, total: int | None = None, unit: str = "entries") -> Tracker:
    return Tracker(task, total, unit)


@contextmanager
def listen(listener: Listener) -> Iterator[None]:
    """Show progress with ``listener`` instead of the default log lines, while in this block."""
    with _lock:
        _listeners.append(listener)
    try:
        yield
    finally:
        with _lock:
            _listeners.remove(listener)
