"""Pairs of features in lr's default mode (streaming) that no other test puts together: a stream
whose every session is taken away at once, ...

Each test is one scenario, cheap, through the engine's streaming replicator (``lr sync``'s default)
or the ``lr`` CLI."""

from __future__ import annotations

import logging

from airflow_provider_lr.engine.session.settings import StreamSettings
from tests.support.session import App, Streaming, apply, queue, replicator, wait_for

ONE_SINK = [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}]


def logs(sink) -> list[str]:
    return [p for k, p in queue(sink, "site-a") if k == "log"]


def test_a_stream_whose_every_session_is_taken_over_waits_for_the_next_one_without_failing(lr_sites, caplog):
    """Another replicator takes the only streaming session of a source (its lease at a higher
    epoch): the source's stream hands it back and, with no session left, waits for the next one
    instead of failing with a traceback; when the session comes back it streams on the same stream."""
    source, sink_b, _ = lr_sites
    topo = apply(lr_sites, ONE_SINK, providers={"policy": "tests.support.session:empty_provider"})
    app = App(source)
    options = StreamSettings(check_interval=0.1, ack_interval=0.05)
    with caplog.at_level(logging.INFO), Streaming(replicator(topo, lr_sites, lease_seconds=2.0), options) as streaming:
        streaming.streaming()
        stream = streaming.streamer.sources["site-a"]
        app.put("k0", 0, ["site-b"])
        wait_for(lambda: logs(sink_b) == ["k0=0"], 10, "the first entry")
        source.query(  # another replicator's lease, for a second
            "UPDATE lr.source_sessions SET lease_owner = 'another', lease_epoch = lease_epoch + 1, "
            "lease_expires_at = now() + interval '1 second'"
        )
        wait_for(lambda: streaming.streamer.ends, 10, "the session handed back")
        streaming.streaming()  # once the other's lease ran out, the cycles bring it back to the stream
        app.put("k1", 1, ["site-b"])
        wait_for(lambda: logs(sink_b) == ["k0=0", "k1=1"], 10, "the next entry")
        assert streaming.streamer.sources["site-a"] is stream and not stream.finished, "the same stream goes on"
    failures = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not failures, failures
    app.close()
