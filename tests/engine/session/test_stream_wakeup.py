"""A stream with nothing to read sleeps until a commit wakes it (``session/stream_read``, V0022):
woken at once, never asleep past a commit, and writers notify only while a stream sleeps; a second
replicator's stream of the same source sleeps beside the first (V0024) instead of polling."""

from __future__ import annotations

import select
import threading
import time

import psycopg2

from airflow_provider_lr.client import RoutingQueueClient
from airflow_provider_lr.engine.session.settings import StreamSettings
from airflow_provider_lr.engine.session.stream_read import StreamRead
from airflow_provider_lr.engine.vocabulary import COMMIT_CHANNEL, STREAM_WAKE_KEY, SessionKey
from tests.support.session import Streaming, apply, empty_provider, replicator, sink_queue, wait_for

ONE_SINK = [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}]
TWO_SINKS = [{"source": "site-a", "sinks": ["site-b", "site-c"], "clients": ["policy"]}]
BOTH = ("site-b", "site-c")
# every timer of a stream set to seconds: only a commit's wake-up delivers within one
SLOW = StreamSettings(sleep_max=8.0, poll_min=4.0, poll_max=8.0, check_interval=30.0, ack_interval=30.0)


def _transmit(conn, payload: str, sinks: tuple[str, ...] = ("site-b",)) -> None:
    RoutingQueueClient(conn, "policy").transmit_log_entry_message(payload.encode(), list(sinks))
    conn.commit()


def _latest(source) -> int:
    return source.query("SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM lr.commit_position_seq")[0][0]


def _notified(conn, within: float) -> bool:
    if select.select([conn], [], [], within)[0]:
        conn.poll()
    found = bool(conn.notifies)
    conn.notifies.clear()
    return found


def test_a_sleeping_stream_is_woken_by_the_commit_not_by_its_next_look(lr_sites):
    """Every timer of the stream set to seconds: an entry committed while it sleeps arrives in far
    less (polling alone would take up to ``sleep_max``)."""
    source, sink_b, _ = lr_sites
    topo = apply(lr_sites, ONE_SINK, providers={"policy": "tests.support.session:empty_provider"})
    writer = source.connect()
    with Streaming(replicator(topo, lr_sites, providers={"policy": empty_provider}), SLOW) as streaming:
        streaming.streaming()
        _transmit(writer, "first")
        wait_for(lambda: sink_queue(sink_b, "policy") == [b"first"], 20, "the first entry")
        for n in range(3):
            time.sleep(0.5)  # asleep by now
            started = time.monotonic()
            _transmit(writer, f"e{n}")
            wait_for(lambda n=n: len(sink_queue(sink_b, "policy")) == n + 2, 20, f"entry {n}")
            assert time.monotonic() - started < 2.0, "the commit woke the stream"
    writer.close()


def test_the_stream_does_not_sleep_while_a_writer_is_between_drawing_its_position_and_its_end(lr_sites):
    source, _, _ = lr_sites
    apply(lr_sites, ONE_SINK)
    reads = StreamRead(lambda site: source.connect(), "site-a", 1 << 20)
    committing = source.connect()
    committing.cursor().execute(
        "SELECT pg_advisory_lock_shared(%s)", (STREAM_WAKE_KEY,)
    )  # as a writer's commit holds it
    started = time.monotonic()
    assert reads.wait_for_commit(_latest(source), pause=0.01, longest=10.0) is False
    assert time.monotonic() - started < 2.0, "it paused instead of sleeping"
    committing.close()
    woken: list[bool] = []
    sleeper = threading.Thread(target=lambda: woken.append(reads.wait_for_commit(_latest(source), 0.01, 10.0)))
    sleeper.start()
    time.sleep(0.5)
    assert sleeper.is_alive(), "nothing drawn and nobody committing: it sleeps"
    writer = source.connect()
    started = time.monotonic()
    _transmit(writer, "wake")
    sleeper.join(5)
    assert woken == [True] and time.monotonic() - started < 2.0
    writer.close()
    reads.close()


def test_writers_notify_only_while_a_stream_sleeps(lr_sites):
    source, _, _ = lr_sites
    apply(lr_sites, ONE_SINK)
    listener = source.connect()
    listener.autocommit = True
    listener.cursor().execute(f"LISTEN {COMMIT_CHANNEL}")
    writer = source.connect()
    _transmit(writer, "awake")
    assert not _notified(listener, 0.5), "no stream asleep: the commit costs no NOTIFY"
    sleeping = psycopg2.connect(source.dsn)
    sleeping.autocommit = True
    sleeping.cursor().execute("SELECT pg_advisory_lock(%s)", (STREAM_WAKE_KEY,))  # as a stream asleep holds it
    _transmit(writer, "asleep")
    assert _notified(listener, 5.0), "a stream asleep is woken by the commit"
    for conn in (sleeping, writer, listener):
        conn.close()


def _sleeps(reads: StreamRead, source, longest: float = 10.0) -> tuple[threading.Thread, list[bool]]:
    """``reads`` waiting for a commit on a thread of its own (what it returns lands in the list)."""
    woken: list[bool] = []
    low = _latest(source)
    sleeper = threading.Thread(target=lambda: woken.append(reads.wait_for_commit(low, 0.01, longest)))
    sleeper.start()
    return sleeper, woken


def test_two_streams_of_one_source_both_sleep_and_a_commit_wakes_both(lr_sites):
    source, _, _ = lr_sites
    apply(lr_sites, ONE_SINK)
    first, second = (StreamRead(lambda site: source.connect(), "site-a", 1 << 20) for _ in range(2))
    (a, woken_a), (b, woken_b) = _sleeps(first, source), _sleeps(second, source)
    time.sleep(0.5)
    assert a.is_alive() and b.is_alive(), "the second stream sleeps beside the first instead of pausing"
    writer = source.connect()
    started = time.monotonic()
    _transmit(writer, "wake both")
    a.join(5)
    b.join(5)
    assert woken_a == [True] and woken_b == [True] and time.monotonic() - started < 2.0
    for conn in (writer, first, second):
        conn.close()


def test_the_stream_holding_the_key_wakes_the_one_beside_it_when_it_gives_the_key_back(lr_sites):
    """The one beside relies on writers notifying while the key is held: once it is given back they
    stop, so the holder wakes it (and it looks again: it may hold the key itself now)."""
    source, _, _ = lr_sites
    apply(lr_sites, ONE_SINK)
    first, second = (StreamRead(lambda site: source.connect(), "site-a", 1 << 20) for _ in range(2))
    assert first.wait_for_commit(_latest(source), 0.01, 0.2) is False  # asleep, then timed out: still holding it
    beside, woken = _sleeps(second, source)
    time.sleep(0.5)
    assert beside.is_alive(), "asleep beside the holder"
    started = time.monotonic()
    first.close()  # gives the key back
    beside.join(5)
    assert woken == [True] and time.monotonic() - started < 2.0
    assert second.wait_for_commit(_latest(source), 0.01, 0.2) is False, "it took the key itself and slept"
    probe = source.connect()
    with probe.cursor() as cur:
        cur.execute("SELECT pg_try_advisory_lock_shared(%s)", (STREAM_WAKE_KEY,))
        assert cur.fetchone()[0] is False, "the second stream holds the wake-up key now"
    probe.close()
    second.close()


def test_entries_for_two_replicators_sharing_a_source_are_each_woken_by_the_commit(lr_sites):
    """Two replicators stream one source, a session each: the second's entries arrive as fast as the
    first's (under V0022 it could not sleep and paused ``poll_min``, here 4 s, at each look)."""
    looks = StreamSettings(sleep_max=0.2, poll_min=4.0, poll_max=8.0, check_interval=30.0, ack_interval=30.0)
    source, sink_b, sink_c = lr_sites
    topo = apply(lr_sites, TWO_SINKS, providers={"policy": "tests.support.session:empty_provider"})
    providers = {"policy": empty_provider}
    only = [[SessionKey("site-a", sink, "policy")] for sink in ("site-b", "site-c")]
    writer = source.connect()
    with (
        Streaming(replicator(topo, lr_sites, providers=providers, sessions=only[0], owner="one"), looks) as one,
        Streaming(replicator(topo, lr_sites, providers=providers, sessions=only[1], owner="two"), looks) as two,
    ):
        one.streaming()
        two.streaming()
        _transmit(writer, "first", BOTH)
        for sink in (sink_b, sink_c):
            wait_for(lambda sink=sink: sink_queue(sink, "policy") == [b"first"], 20, "the first entry")
        for n in range(3):
            time.sleep(0.5)  # both asleep by now
            started = time.monotonic()
            _transmit(writer, f"e{n}", BOTH)
            for sink in (sink_b, sink_c):
                wait_for(lambda sink=sink, n=n: len(sink_queue(sink, "policy")) == n + 2, 20, f"entry {n}")
            assert time.monotonic() - started < 2.0, "the commit woke both replicators' streams"
    writer.close()


def test_at_a_modest_rate_the_stream_reads_once_per_commit_and_probes_instead_of_reading_again(lr_sites, monkeypatch):
    """After a round that delivered, a stream below ``reread_rate`` probes (one round trip that
    sleeps when nothing was drawn) instead of reading again to find nothing first."""
    source, sink_b, _ = lr_sites
    topo = apply(lr_sites, ONE_SINK, providers={"policy": "tests.support.session:empty_provider"})
    reads = {"all": 0, "empty": 0}
    real_read = StreamRead.read

    def counted(self, members):
        batch = real_read(self, members)
        reads["all"] += 1
        if batch is not None and not any(batch.records):
            reads["empty"] += 1
        return batch

    monkeypatch.setattr(StreamRead, "read", counted)
    writer = source.connect()
    quiet = StreamSettings(check_interval=30.0, ack_interval=30.0)  # no other reads meanwhile
    with Streaming(replicator(topo, lr_sites, providers={"policy": empty_provider}), quiet) as streaming:
        streaming.streaming()
        _transmit(writer, "first")
        wait_for(lambda: sink_queue(sink_b, "policy") == [b"first"], 20, "the first entry")
        time.sleep(0.3)
        reads.update(all=0, empty=0)
        for n in range(20):
            _transmit(writer, f"e{n}")
            time.sleep(0.03)
        wait_for(lambda: len(sink_queue(sink_b, "policy")) == 21, 20, "every entry")
    writer.close()
    assert reads["all"] <= 24, reads  # one per commit (a wake-up may find a commit not yet visible)
    assert reads["empty"] <= 4, reads
