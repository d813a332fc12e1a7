"""A new lease holder ends the stale writer that holds a session's row at the sink (a replicator
stopped inside its fenced transaction: ``writes.fence``), finding it by its backend's
``application_name`` (``lr fenced writer, epoch N``), which every login may set on its own backend."""

from __future__ import annotations

import psycopg2

from airflow_provider_lr.engine.sink import writes
from airflow_provider_lr.engine.store.sink_sessions import WRITER
from tests.engine.site.test_roles import info_as, made  # noqa: F401
from tests.support.session import apply, empty_provider, replicator


def test_a_login_naming_its_backend_like_a_fenced_writer_does_not_stop_the_new_holder_ending_the_stale_one(
    lr_sites, made
):
    """Any role that may connect to the sink (no grant of lr's) named its backend like a fenced writer
    of an epoch past bigint's range: the look for stale writers cast every such name's epoch, failed
    ("bigint out of range"), and the new holder could not take the session over for as long as that
    backend stayed. Names whose epoch cannot be one are not looked at."""
    sink = lr_sites[1]
    topo = apply(lr_sites[:2], [{"source": "site-a", "sinks": ["site-b"], "clients": ["policy"]}])
    repl = replicator(topo, lr_sites[:2], providers={"policy": empty_provider})
    try:
        repl.run(max_cycles=2, until_idle=True, interval=0.01)
    finally:
        repl.close()
    (epoch,) = sink.query("SELECT lease_epoch FROM lr.sink_sessions")[0]
    nobody = made.name("nobody")
    sink.query(f'CREATE ROLE "{nobody}" LOGIN')
    squatter = psycopg2.connect(info_as(sink, nobody).dsn, application_name=WRITER + "9" * 30)
    stopped = sink.connect()  # a writer stopped inside its fenced transaction: the row stays locked
    held = writes.SinkTransaction(stopped, "site-a", "policy", epoch)
    held.__enter__()
    conn = psycopg2.connect(sink.dsn, options="-c lock_timeout=500")
    try:
        meta = writes.fence(conn, "site-a", "policy", epoch + 1)
        assert meta.lease_epoch == epoch + 1
    finally:
        conn.close()
        squatter.close()
        stopped.close()
    assert sink.query("SELECT lease_epoch FROM lr.sink_sessions") == [(epoch + 1,)]
