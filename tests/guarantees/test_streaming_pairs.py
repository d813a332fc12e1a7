"""Pairs of features in lr's default mode (streaming) that no other test puts together: a stream
whose every session is taken away at once; `lr sync --until-idle` run beside a streaming `lr sync`;
a json value that jsonb refuses; an application's two-phase commit while the stream sleeps; a full-sync request the cycles do not act on.

Each test is one scenario, cheap, through the engine's streaming replicator (``lr sync``'s default)
or the ``lr`` CLI."""

from __future__ import annotations

import logging
import time

from airflow_provider_lr.client import RoutingQueueClient
from airflow_provider_lr.engine.session.runner import unsettled
from airflow_provider_lr.engine.session.settings import StreamSettings
from airflow_provider_lr.engine.source import full_sync
from airflow_provider_lr.engine.vocabulary import STREAM_WAKE_KEY
from tests.support.session import App, Streaming, apply, queue, replicator, wait_for
from tests.support.tables import federate

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
        wait_for(lambda: streaming.streamer.counters.most_behind(), 10, "the session's lag, counted at a check")
        source.query(  # another replicator's lease, for a second
            "UPDATE lr.source_sessions SET lease_owner = 'another', lease_epoch = lease_epoch + 1, "
            "lease_expires_at = now() + interval '1 second'"
        )
        wait_for(lambda: streaming.streamer.ends, 10, "the session handed back")
        # its lag is no longer this process's to say: the progress line named it, frozen, for good
        assert streaming.streamer.counters.most_behind() is None
        streaming.streaming()  # once the other's lease ran out, the cycles bring it back to the stream
        app.put("k1", 1, ["site-b"])
        wait_for(lambda: logs(sink_b) == ["k0=0", "k1=1"], 10, "the next entry")
        assert streaming.streamer.sources["site-a"] is stream and not stream.finished, "the same stream goes on"
    failures = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not failures, failures
    app.close()


def test_until_idle_beside_a_streaming_replicator_ends_once_the_sessions_it_holds_are_caught_up(lr_sites):
    """`lr sync --until-idle` (a drain in a script) while `lr sync` streams every session: the
    sessions are another replicator's, caught up, so the run ends at once, settled. It used to wait
    out --give-up-after (60 s) and exit 1, calling every session unsettled ("another replicator
    holds this session's lease"), whatever their state."""
    source, sink_b, _ = lr_sites
    topo = apply(lr_sites, ONE_SINK, providers={"policy": "tests.support.session:empty_provider"})
    app = App(source)
    options = StreamSettings(check_interval=0.1, ack_interval=0.05)
    with Streaming(replicator(topo, lr_sites, lease_seconds=30.0), options) as streaming:
        streaming.streaming()
        for i in range(5):
            app.put(f"k{i}", i, ["site-b"])
        wait_for(lambda: len(logs(sink_b)) == 5, 10, "the entries streamed")
        drain = replicator(topo, lr_sites, owner="a-script", lease_seconds=30.0)
        started = time.monotonic()
        reports = drain.run(until_idle=True, give_up_after=5.0, interval=0.05)
        took = time.monotonic() - started
        drain.close()
        assert [r.skipped.startswith("another replicator holds") for r in reports] == [True]
        assert not unsettled(reports) and took < 3.0, (unsettled(reports), took)
    app.close()


def test_a_json_value_jsonb_refuses_is_written_captured_and_streamed_as_it_is(lr_sites):
    """PostgreSQL's json type keeps a "\\u0000" escape that jsonb refuses: the capture trigger built
    the row image with to_jsonb(row), so once the table was federated the writer's own INSERT and
    UPDATE failed ("unsupported Unicode escape sequence"). Needs migration V0025."""
    source, sink_b, _ = lr_sites
    topo = apply(lr_sites, ONE_SINK, providers={"policy": "tests.support.session:empty_provider"})
    source.query("CREATE TABLE public.docs (id int PRIMARY KEY, doc json, n int)")
    federate(source, "public.docs")
    options = StreamSettings(check_interval=0.1, ack_interval=0.05)
    docs = "SELECT id, doc::text, n FROM public.docs ORDER BY id"
    with Streaming(replicator(topo, lr_sites, lease_seconds=30.0), options) as streaming:
        streaming.streaming()
        source.query("""INSERT INTO public.docs VALUES (1, '{"a": "\\u0000",  "a": 2}', 1), (2, '[]', 2)""")
        source.query("""UPDATE public.docs SET id = id + 10, doc = '["\\u0000"]' WHERE id = 2""")
        wait_for(lambda: sink_b.query(docs) == source.query(docs), 10, "the rows at the sink")
    assert [d for _, d, _ in sink_b.query(docs)] == ['{"a": "\\u0000",  "a": 2}', '["\\u0000"]']


def test_a_transaction_that_transmits_is_prepared_while_the_stream_sleeps_and_arrives_in_commit_order(lr_sites):
    """PREPARE TRANSACTION fires the commit-position trigger, which NOTIFYs a sleeping stream, and
    PostgreSQL refuses to prepare a transaction that notified ("cannot PREPARE a transaction that has
    executed ... NOTIFY"): an application's two-phase commit failed whenever `lr sync` was idle. Now
    it is prepared; a transaction committed after it waits behind its position, and COMMIT PREPARED
    delivers both, the prepared one first. Needs migration V0035; and V0045 for an application whose
    session reads a backslash in a string as an escape (``standard_conforming_strings = off``): the
    trigger's pattern ``'prepare\\s+transaction'`` read ``prepares+transaction`` there, and its
    two-phase commit was refused again."""
    source, sink_b, _ = lr_sites
    topo = apply(lr_sites, ONE_SINK, providers={"policy": "tests.support.session:empty_provider"})
    app = App(source)
    asleep = (
        "SELECT count(*) FROM pg_catalog.pg_locks WHERE locktype = 'advisory' AND granted "
        "AND mode = 'ExclusiveLock' AND classid = 0 AND objid = %s AND objsubid = 1"
    )
    options = StreamSettings(check_interval=0.1, ack_interval=0.05)
    with Streaming(replicator(topo, lr_sites, lease_seconds=30.0), options) as streaming:
        streaming.streaming()
        app.put("k0", 0, ["site-b"])
        wait_for(lambda: logs(sink_b) == ["k0=0"], 10, "the first entry")
        two_phase = source.connect()
        with two_phase.cursor() as cur:  # a legacy application's session: '\s' in a string is 's' (V0045)
            cur.execute("SET standard_conforming_strings = off")
        RoutingQueueClient(two_phase, "policy").transmit_log_entry_message(b"prepared=1", ["site-b"])
        wait_for(lambda: source.query(asleep, (STREAM_WAKE_KEY,)) == [(1,)], 10, "the stream asleep")
        with two_phase.cursor() as cur:
            cur.execute("PREPARE TRANSACTION 'lr-app-gid'")  # refused before V0035
        two_phase.close()
        try:
            app.put("k1", 1, ["site-b"])
            time.sleep(0.3)
            assert logs(sink_b) == ["k0=0"], "nothing is read past the prepared transaction's position"
        finally:
            admin = source.connect()
            admin.autocommit = True
            with admin.cursor() as cur:
                cur.execute("COMMIT PREPARED 'lr-app-gid'")
            admin.close()
        wait_for(lambda: logs(sink_b) == ["k0=0", "prepared=1", "k1=1"], 10, "both, in commit order")
    app.close()


def test_a_full_sync_request_the_cycles_do_not_act_on_leaves_the_session_streaming(lr_sites):
    """``full_sync.request_full_sync`` without ``forced`` (its default: the request a session's own
    negotiation makes) on a session in log-entry sync: negotiation acts only on a forced request, but
    the stream handed the session back at every check for any open one, and the cycle sent it
    straight back: hundreds of hand-backs a minute, each printed by `lr sync`. Now the stream looks
    for what negotiation acts on; a forced request is still honoured."""
    source, sink_b, _ = lr_sites
    topo = apply(lr_sites, ONE_SINK, providers={"policy": "tests.support.session:empty_provider"})
    app = App(source)
    options = StreamSettings(check_interval=0.05, ack_interval=0.05)
    with Streaming(replicator(topo, lr_sites, lease_seconds=30.0), options) as streaming:
        streaming.streaming()
        full_sync.request_full_sync(source.connect(), "site-b", "policy", reason="not forced")
        app.put("k0", 0, ["site-b"])
        wait_for(lambda: logs(sink_b) == ["k0=0"], 10, "the entry")
        time.sleep(0.5)  # ten checks
        assert streaming.streamer.ends == [], streaming.streamer.ends
        full_sync.request_full_sync(source.connect(), "site-b", "policy", reason="forced", forced=True)
        wait_for(lambda: [k for k, _ in queue(sink_b, "site-a")].count("start") == 2, 10, "the forced full sync")
        assert [e.reason for e in streaming.streamer.ends] == ["a full sync was requested"]
    app.close()
