"""The one handshake every mover runs (engine/session/handshake.py), on real sites: it proceeds with
a Position, skips a session whose lease another holds, refuses a mismatched topology or an unknown
session, and moves its epoch past a higher one the sink has seen."""

from __future__ import annotations

import psycopg2
import pytest

from airflow_provider_lr.engine.session.handshake import Position, Verdict, applied, handshake, reconcile
from airflow_provider_lr.engine.session.negotiation import Decision
from airflow_provider_lr.engine.site.replicator import run_until_idle
from airflow_provider_lr.engine.source import full_sync
from airflow_provider_lr.engine.store.sink_sessions import FencedTransaction
from airflow_provider_lr.engine.vocabulary import RequestStatus, SessionKey, SessionState
from tests.support.session import apply, empty_provider, replicator, wait_for

ONE_SINK = [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}]
KEY = SessionKey("site-a", "site-b", "policy")
SINK_EPOCH = "SELECT lease_epoch FROM lr.sink_sessions WHERE source_site_id = 'site-a' AND client_name = 'policy'"
SOURCE_ROW = (
    "SELECT lease_epoch, lease_owner, state, last_error FROM lr.source_sessions "
    "WHERE sink_site_id = 'site-b' AND client_name = 'policy'"
)


def test_a_first_handshake_proceeds_fenced_with_the_sinks_position(lr_sites):
    source, sink, _ = lr_sites
    apply(lr_sites, ONE_SINK)
    heard = []
    hs = handshake(source.connect(), sink.connect(), KEY, "one", on_lease=heard.append)
    assert hs.verdict is Verdict.PROCEED and hs.proceeds and hs.decision is Decision.SNAPSHOT_SYNC
    assert hs.lease is not None and hs.lease.owner == "one" and heard == [hs.lease]
    assert hs.position == Position.of(hs.meta, hs.lease.epoch) == Position(-1, -1, None, hs.lease.epoch)
    assert sink.query(SINK_EPOCH) == [(hs.lease.epoch,)]  # fenced before anything was decided
    assert hs.left_out(Decision.LOG_ENTRY_SYNC).startswith("needs snapshot_sync (first contact")
    again = handshake(source.connect(), sink.connect(), KEY, "one")  # the holder renews: the same epoch
    assert again.proceeds and again.lease == hs.lease


def test_a_session_whose_lease_another_holds_is_skipped_untouched(lr_sites):
    source, sink, _ = lr_sites
    apply(lr_sites, ONE_SINK)
    first = handshake(source.connect(), sink.connect(), KEY, "one")
    heard = []
    second = handshake(source.connect(), sink.connect(), KEY, "two", on_lease=heard.append)
    assert second.verdict is Verdict.SKIPPED and not second.proceeds and heard == [None]
    assert second.lease is None and second.position is None and second.negotiation is None
    assert second.reason == "another replicator holds this session's lease (one)"
    assert second.left_out(Decision.LOG_ENTRY_SYNC) == second.reason
    assert source.query(SOURCE_ROW)[0][:2] == (first.lease.epoch, "one")
    assert sink.query(SINK_EPOCH) == [(first.lease.epoch,)]


def test_a_mismatched_topology_is_refused_and_recorded_on_the_source(lr_sites):
    source, sink, _ = lr_sites
    apply(lr_sites, ONE_SINK)
    apply(lr_sites, ONE_SINK, settings={"lease_seconds": 30}, only=[source])  # another id on the source only
    hs = handshake(source.connect(), sink.connect(), KEY, "one")
    assert hs.verdict is Verdict.REFUSED and hs.decision is Decision.REFUSE and hs.lease is not None
    assert "topology config id mismatch" in hs.reason and hs.position is not None
    assert hs.left_out(Decision.LOG_ENTRY_SYNC) == f"negotiation refused: {hs.reason}"
    _, owner, state, error = source.query(SOURCE_ROW)[0]
    assert (owner, state) == ("one", SessionState.NEGOTIATING) and error == f"negotiation refused: {hs.reason}"


def test_a_session_the_source_does_not_have_is_refused(lr_sites):
    source, _, sink_c = lr_sites
    apply(lr_sites, ONE_SINK)
    hs = handshake(source.connect(), sink_c.connect(), SessionKey("site-a", "site-c", "policy"), "one")
    assert hs.verdict is Verdict.REFUSED and hs.lease is None and hs.negotiation is None
    assert hs.reason.startswith("site 'site-a': this source has no session to 'site-c'")


def test_the_epoch_moves_past_a_higher_one_the_sink_has_seen(lr_sites):
    """A session removed and added back: the source forgot the epochs the sink has seen."""
    source, sink, _ = lr_sites
    apply(lr_sites, ONE_SINK)
    sink.query(
        "INSERT INTO lr.sink_sessions (source_site_id, client_name, lease_epoch) VALUES ('site-a', 'policy', 41) "
        "ON CONFLICT (source_site_id, client_name) DO UPDATE SET lease_epoch = 41"
    )
    heard = []
    hs = handshake(source.connect(), sink.connect(), KEY, "one", on_lease=heard.append)
    assert hs.proceeds and hs.lease.epoch == 42 and hs.position.epoch == 42
    assert [lease.epoch for lease in heard] == [heard[0].epoch, 42] and heard[0].epoch < 41
    assert sink.query(SINK_EPOCH) == [(42,)] and source.query(SOURCE_ROW)[0][:2] == (42, "one")


def test_a_stopped_holders_sink_transaction_is_ended_by_the_next_holder_which_proceeds(lr_sites):
    """A replicator stopped (SIGSTOP, a hung process) inside a sink transaction keeps the session's
    row at the sink locked: a table snapshot's COPY waiting for its client is ended by no timeout
    (``lr sync`` SIGSTOPped mid-snapshot held its successor off for as long as it was stopped,
    every retry failing on lock_timeout). Its lease ran out and the next holder took it: that
    holder ends the fenced transaction of the older epoch and fences the sink; the stopped one
    finds its connection gone. (Any other transaction holding the row is waited for:
    ``test_hangs.py::test_a_sink_lock_held_elsewhere_…``.)"""
    source, sink, _ = lr_sites
    apply(lr_sites, ONE_SINK)
    first = handshake(source.connect(), sink.connect(), KEY, "one", lease_seconds=0.2)
    stopped = sink.connect()
    FencedTransaction(stopped, "site-a", "policy", first.lease.epoch).open()  # and the process stopped here
    wait_for(
        lambda: source.query("SELECT lease_expires_at < now() FROM lr.source_sessions WHERE sink_site_id = 'site-b'")[
            0
        ][0],
        10,
        "the first holder's lease to run out",
    )
    bounded = psycopg2.connect(sink.dsn, options="-c lock_timeout=300")  # lr's bound, shortened
    second = handshake(source.connect(), bounded, KEY, "two")
    assert second.proceeds and second.lease.epoch > first.lease.epoch
    assert sink.query(SINK_EPOCH) == [(second.lease.epoch,)]
    with pytest.raises(psycopg2.OperationalError):
        stopped.cursor().execute("SELECT 1")  # continued, it writes nothing more


def test_a_request_closed_already_is_not_reconciled_again(lr_sites):
    """Reconcile closes an open request the sink applied (a crash between the sink's apply and the
    source's record); a request closed already keeps its outcome and the session row is not
    written again (the snapshot transfer asks by id after the handshake reconciled it)."""
    source, sink, _ = lr_sites
    topo = apply(lr_sites, ONE_SINK)
    repl = replicator(topo, lr_sites, providers={"policy": empty_provider}, sessions=[KEY])
    run_until_idle(repl)
    repl.close()  # its lease released: the handshake below takes it
    src = source.connect()
    (request_id,) = source.query("SELECT request_id FROM lr.full_sync_requests WHERE status = 'applied'")[0]
    request = full_sync.get_request(src, request_id)
    hs = handshake(src, sink.connect(), KEY, "one")
    assert hs.proceeds and hs.decision is Decision.LOG_ENTRY_SYNC and applied(hs.meta)
    assert hs.meta.snapshot_request_id == request_id and request.status == RequestStatus.APPLIED
    source.query("UPDATE lr.source_sessions SET attempts = 7 WHERE sink_site_id = 'site-b' AND client_name = 'policy'")
    assert not reconcile(src, KEY, hs.lease, "one", hs.meta, request)
    assert source.query(
        "SELECT attempts FROM lr.source_sessions WHERE sink_site_id = 'site-b' AND client_name = 'policy'"
    ) == [(7,)]
