"""``NotifyChannel``: the LISTEN connection the sink's tap is made of, on any channel (a source-side
process woken by commits would use it too)."""

from __future__ import annotations

import threading
import time

import pytest

from airflow_provider_lr.engine.notify import NotifyChannel


def notify(site, channel: str, *payloads: str) -> None:
    """Send ``payloads`` on ``channel`` in one transaction (delivered together at commit)."""
    conn = site.connect()
    with conn.cursor() as cur:
        for payload in payloads:
            cur.execute("SELECT pg_notify(%s, %s)", (channel, payload))
    conn.commit()
    conn.close()


def wait_for(channel: NotifyChannel, timeout: float = 5.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = channel.wait(0.2)
        if got:
            return got
    return []


def test_a_channel_of_its_own_deduplicates_and_says_when_it_may_have_missed_some(sites) -> None:
    site = sites[0]
    channel = NotifyChannel(site.connect, "lr_test_commits")
    try:
        assert channel.wait(1.0) is None, "just opened: notifications sent before were not seen"
        assert channel.listening
        notify(site, "lr_test_other", "elsewhere")
        notify(site, "lr_test_commits", "a", "b", "a", "a")
        assert wait_for(channel) == ["a", "b"]
        channel.wanted = False
        assert channel.wait(0.1) == [] and not channel.listening
        channel.wanted = True
        assert channel.wait(0.1) is None and channel.listening, "reopened: a full pass is due"
    finally:
        channel.close()
    assert not channel.listening
    channel.interrupt()  # after close: a no-op, never a write to a reused fd


def test_interrupt_wakes_a_wait_from_another_thread(sites) -> None:
    channel = NotifyChannel(sites[0].connect, "lr_test_commits")
    try:
        assert channel.wait(1.0) is None
        threading.Timer(0.2, channel.interrupt).start()
        started = time.monotonic()
        assert channel.wait(30.0) == []
        assert time.monotonic() - started < 10
    finally:
        channel.close()


def test_a_channel_name_that_would_need_quoting_is_refused() -> None:
    with pytest.raises(ValueError):
        NotifyChannel(lambda: None, "lr-recv; DROP TABLE x")  # type: ignore[arg-type,return-value]
