"""What an application hands the client that cannot mean what was meant: refused at once, saying
what to give, in a message of bounded size, nothing written."""

from __future__ import annotations

import pytest

from airflow_provider_lr.client import RoutingQueueClient
from airflow_provider_lr.engine.errors import ConfigurationError, TransmitError
from airflow_provider_lr.engine.source import full_sync
from tests.support.session import apply


def test_huge_lists_of_destinations_are_refused_in_a_short_message_and_a_bad_supply_at_once(lr_sites):
    """100,000 unknown destinations came back whole in the refusal (a message of a megabyte, in
    every log line that quoted it), 100,000 destinations one of which is not a string too, and
    100,000 unknown destinations to wait for. A
    full-sync supply given no function was found out only once a request came (noted as that
    request's failure), and ``max_requests=0`` or ``-1`` supplied nothing, silently."""
    source = lr_sites[0]
    apply(lr_sites)
    conn = source.connect()
    try:
        client = RoutingQueueClient(conn, "policy")
        for destinations, said in (
            ([f"s{i}" for i in range(100_000)], "unknown destination\\(s\\) 's0', 's1', .*, 's9' and 99990 more for"),
            (["site-b"] * 99_999 + [None], "not \\['site-b', .*, 'site-b' and 99990 more\\]; nothing was written"),
        ):
            with pytest.raises(TransmitError, match=said) as refused:
                client.transmit_log_entry_message(b"x", destinations)
            assert len(str(refused.value)) < 500, len(str(refused.value))
        conn.rollback()
        with pytest.raises(ConfigurationError, match="s0, s1, s10, .*, and 99990 more: not sinks of") as refused:
            client.wait_until_ready([f"s{i}" for i in range(100_000)], timeout=1)
        assert len(str(refused.value)) < 500, len(str(refused.value))
        for provider, max_requests, said in (
            (None, None, "the full-sync provider must be a function of the request's context \\(ctx\\), not None"),
            ("pkg.mod:provide", None, "not 'pkg.mod:provide'"),
            (lambda ctx: None, 0, "max_requests must be a whole number of at least 1, not 0"),
            (lambda ctx: None, -1, "max_requests must be a whole number of at least 1, not -1"),
        ):
            with pytest.raises(ConfigurationError, match=said):
                client.serve_full_sync_requests(provider, max_requests)
        for reason in (None, 5):  # an engine caller's request: a TypeError from inside lr
            with pytest.raises(ConfigurationError, match=f"a full sync's reason is one line of text, not {reason!r}"):
                full_sync.request_full_sync(conn, "site-b", "policy", reason)
        for timeout in (1e300, float("nan"), float("inf"), 0, -5, "60", True):  # 1e300: "interval out of range"
            with pytest.raises(ConfigurationError, match="data_timeout must be a number of seconds above 0"):
                full_sync.request_full_sync(conn, "site-b", "policy", "x", data_timeout=timeout)
        assert source.query("SELECT count(*) FROM lr.log_entries") == [(0,)]
        assert source.query("SELECT count(*) FROM lr.full_sync_requests WHERE forced") == [(0,)]
    finally:
        conn.close()
