"""The progress line of a running stream (``counters.Pulse``), on a clock the test moves: what an
operator reads in `lr sync`'s output and in an `lr_streaming` task's log."""

from __future__ import annotations

import pytest

from airflow_provider_lr.engine import counters as counters_module
from airflow_provider_lr.engine.counters import DeliveryCounters, Pulse


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(counters_module.time, "monotonic", clock)
    return clock


def test_an_idle_stream_says_so_once_then_every_ten_minutes_not_every_30_s(clock):
    """A quiet replicator printed `0 entries in 30s` every 30 s (20 lines per `lr_streaming` run);
    it now says it is idle once, is silent while nothing changes, and speaks again as soon as
    entries flow (counting them since its last line) or when the sessions it streams change."""
    counters, lines = DeliveryCounters(), []
    pulse = Pulse(counters, every=30, emit=lines.append)
    for _ in range(42):  # 10.5 minutes of ticks, 15 s apart
        clock.now += 15
        pulse.tick(2, 2)
    assert lines[0] == (
        "streaming 2 of 2 sessions: 0 entries in 30s (0.0 entries/s, 0 in all), lag 0; "
        "idle: the next line when entries flow, or in 600s"
    )
    assert lines[1:] == ["streaming 2 of 2 sessions: 0 entries in 600s (0.0 entries/s, 0 in all), lag 0"]
    lines.clear()
    clock.now += 100
    counters.delivered("site-a->site-b/policy", 5)
    clock.now += 20
    pulse.tick(2, 2)  # entries flowed: said at the next due tick, counted since the last line
    assert lines == ["streaming 2 of 2 sessions: 5 entries in 120s (0.0 entries/s, 5 in all), lag 0"]
    clock.now += 30
    pulse.tick(2, 2)
    clock.now += 30
    pulse.tick(1, 2)  # a session stopped streaming: said even though nothing flows
    assert lines[1:] == [
        "streaming 2 of 2 sessions: 0 entries in 30s (0.0 entries/s, 5 in all), lag 0; "
        "idle: the next line when entries flow, or in 600s",
        "streaming 1 of 2 sessions: 0 entries in 30s (0.0 entries/s, 5 in all), lag 0",
    ]


def test_a_stalled_stream_with_lag_is_reported_every_period(clock):
    """Nothing delivered but a session behind is not idle: a stall is said every period."""
    counters, lines = DeliveryCounters(), []
    pulse = Pulse(counters, every=30, emit=lines.append)
    counters.lag("site-a->site-c/policy", 7, 42.0)
    for _ in range(3):
        clock.now += 30
        pulse.tick(2, 2)
    assert (
        lines
        == [
            "streaming 2 of 2 sessions: 0 entries in 30s (0.0 entries/s, 0 in all), lag 7 entries / 42.0s (site-a->site-c/policy)"
        ]
        * 3
    )


def test_sessions_waiting_for_a_killed_replicators_lease_are_named_every_period_not_called_idle(clock):
    """An `lr_streaming` task SIGKILLed and retried: its sessions' leases stay held by the dead
    process until they expire (a minute), and the retry's line read `streaming 0 of 2 sessions: 0
    entries ..., lag 0; idle` while the backlog grew. It now names a waiting session and why, every
    period, until the session streams again."""
    from airflow_provider_lr.engine.session.snapshot_sync import CycleReport

    counters, lines = DeliveryCounters(), []
    pulse = Pulse(counters, every=30, emit=lines.append)
    held = "another replicator holds this session's lease (vm:18660:3003db0b)"
    counters.cycle([CycleReport(f"site-a->site-{s}/policy", skipped=held) for s in "bc"])
    for _ in range(2):
        clock.now += 30
        pulse.tick(0, 2)
    assert (
        lines
        == [
            "streaming 0 of 2 sessions: 0 entries in 30s (0.0 entries/s, 0 in all), lag 0; "
            f"not streaming site-a->site-b/policy (and 1 more): {held}"
        ]
        * 2
    )
    counters.cycle([CycleReport(f"site-a->site-{s}/policy") for s in "bc"])  # the lease expired: taken over
    clock.now += 30
    pulse.tick(2, 2)
    assert lines[2] == (
        "streaming 2 of 2 sessions: 0 entries in 30s (0.0 entries/s, 0 in all), lag 0; "
        "idle: the next line when entries flow, or in 600s"
    )
