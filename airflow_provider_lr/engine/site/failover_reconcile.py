"""A failover's third step: each other sink of the failed-over clients cut at the promoted site's
position (``site/failover`` says the whole): pX == pB nothing moves; pX > pB its unconsumed
entries beyond pB are removed (a packed row is cut at pB); pX < pB the gap is copied from the
promoted site's receive queue when the operator says every entry was addressed to all sinks;
otherwise, or when applications consumed what would have to move, a full sync from the new
source is requested with the reason. Then the sink's session from the new source starts at the
base, its tables of those clients move to the new source, and it gets the new topology; all in
one transaction on the sink.
"""

from __future__ import annotations

from bisect import bisect_right

import psycopg2.extensions

from airflow_provider_lr.engine.sink import writes
from airflow_provider_lr.engine.sink.queue_rows import positions, repack, unpack
from airflow_provider_lr.engine.site.failover_record import FailoverResult
from airflow_provider_lr.engine.site.topology import apply_to_site
from airflow_provider_lr.engine.source import full_sync
from airflow_provider_lr.engine.store import receive_queue, sink_sessions
from airflow_provider_lr.engine.tables import handover, registry
from airflow_provider_lr.engine.vocabulary import RECONCILING_SETTING
from airflow_provider_lr.proto import lr_pb2


class _FullSync(Exception):
    """Reconciling a session by entries is impossible: why (the full sync request's reason)."""


def reconcile(
    conn: psycopg2.extensions.connection,
    new: psycopg2.extensions.connection,
    sink: str,
    result: FailoverResult,
    same_destinations: bool,
) -> dict[str, str]:
    """One transaction on the sink: every failed-over client's session from the old source cut at
    pB (extras removed, or the gap copied), its session from the new source set at the base, the
    new topology. Where cutting is impossible a full sync from the new source is requested (on the
    new source, first) with the reason. What the old session holds unapplied (a full sync's rows,
    what Spark jobs staged) is dropped.
    Idempotent: a session reconciled before keeps its note."""
    old, to = result.from_site, result.to_site
    notes: dict[str, str] = {}
    federated = {client: registry.federated_tables(new, client) for client in result.clients}
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT set_config(%s, 'on', true)", (RECONCILING_SETTING,))
            for client in result.clients:
                cut = result.positions[client]
                row = sink_sessions.lock_reconcile(cur, old, client)
                writes.discard_unapplied(cur, old, client)  # fenced: its unapplied sync and staged data never apply
                if row is None:  # its tables registered from the old source move all the same (a rejoined old source)
                    tables = handover.follow(cur, old, to, client, federated[client])
                    notes[client] = f"nothing of {old} held: first contact with {to} (full sync)" + "".join(
                        f"; table {name}: {what}" for name, what in tables.items()
                    )
                    continue
                last, consistent, applied, note, fid = row
                if note is not None and str(fid) == result.failover_id:
                    notes[client] = note
                    continue
                try:
                    if not consistent or applied > cut:
                        what = (
                            "had not applied its full sync" if not consistent else f"applied a full sync at {applied}"
                        )
                        raise _FullSync(f"{sink} {what} from {old}, beyond {to}'s position {cut}")
                    if last > cut:
                        note = _remove_extras(cur, sink, result, client, cut)
                    elif last < cut and not same_destinations:
                        raise _FullSync(
                            f"{sink} lacks {old}'s entries in ({last}, {cut}] and {to} cannot tell which of its "
                            f"own were addressed to {sink} (a sink's copy carries no destinations)"
                        )
                    elif last < cut:
                        note = _copy_gap(cur, new, sink, result, client, last, cut)
                    else:
                        note = f"at {to}'s position {cut}: nothing moved"
                    _start_at_base(cur, result, client)
                    position = cut
                except _FullSync as why:
                    reason = f"failover: {why}"
                    full_sync.request_full_sync(new, sink, client, reason=reason, forced=True)
                    note, position = f"full sync from {to} requested ({reason})", last
                tables = handover.follow(cur, old, to, client, federated[client])
                note += "".join(f"; table {name}: {what}" for name, what in tables.items())
                sink_sessions.close_reconciled(cur, old, client, to, result.failover_id, note, position)
                notes[client] = note
            apply_to_site(conn, result.topology, sink, commit=False)
        conn.commit()
    except BaseException:
        conn.rollback()
        raise
    return notes


def _rows_after(cur: psycopg2.extensions.cursor, source: str, client: str, after: int) -> list[tuple]:
    """The visible rows of a session's queue that hold entries after ``after``: (seq, kind, count,
    delivered, entry id, each entry's position or None, entries)."""
    return [
        (seq, kind, count, delivered, entry_id, positions(count, message, position), unpack(count, message))
        for seq, kind, count, delivered, position, entry_id, message in receive_queue.rows_after(
            cur, source, client, after
        )
    ]


def _remove_extras(cur: psycopg2.extensions.cursor, sink: str, result: FailoverResult, client: str, cut: int) -> str:
    old, to = result.from_site, result.to_site
    consumed = receive_queue.consumed_position(cur, old, client)
    if consumed > cut:
        raise _FullSync(f"{sink} had consumed entries of {old} beyond {to}'s position {cut} (up to {consumed})")
    rows, removed = _rows_after(cur, old, client, cut), 0
    plan = []
    for seq, kind, _count, delivered, _, where, entries in rows:
        if kind != lr_pb2.LOG_ENTRY_SYNC:
            raise _FullSync(f"{sink} holds full-sync data of {old} beyond {to}'s position {cut}")
        if where is None:
            raise _FullSync(
                f"a receive-queue row of {sink} written before V0010 holds entries on both sides of "
                f"{to}'s position {cut}"
            )
        keep = bisect_right(where, cut)
        if delivered > keep:
            raise _FullSync(f"{sink} had consumed entries of {old} beyond {to}'s position {cut}")
        plan.append((seq, keep, where, entries))
    for seq, keep, where, entries in plan:
        removed += len(entries) - keep
        if keep == 0:
            receive_queue.cut_row(cur, seq, 0, None, None)
        else:
            receive_queue.cut_row(cur, seq, keep, where[keep - 1], repack(entries[:keep], where[:keep]))
    return f"{removed} extra entries of {old} beyond {to}'s position {cut} removed, unconsumed"


def _copy_gap(
    cur: psycopg2.extensions.cursor,
    new: psycopg2.extensions.connection,
    sink: str,
    result: FailoverResult,
    client: str,
    last: int,
    cut: int,
) -> str:
    """The entries in ``(last, cut]`` the sink lacks, copied from the promoted site's receive queue
    (every entry was addressed to all sinks: ``same_destinations``), or ``_FullSync`` when the
    promoted site's applications consumed some or holds them only as a full sync."""
    old, to = result.from_site, result.to_site
    with new.cursor() as src:
        if receive_queue.consumed_position(src, old, client) > last:
            new.commit()
            raise _FullSync(f"{sink} lacks {old}'s entries in ({last}, {cut}] and {to}'s applications consumed some")
        rows = _rows_after(src, old, client, last)
    new.commit()
    gap = []
    for _, kind, _count, delivered, entry_id, where, entries in rows:
        if kind != lr_pb2.LOG_ENTRY_SYNC or where is None:
            raise _FullSync(
                f"{sink} lacks {old}'s entries in ({last}, {cut}] and {to} holds them only as a full sync "
                "or in a row written before V0010"
            )
        first = bisect_right(where, last)
        if delivered > first:
            raise _FullSync(f"{sink} lacks {old}'s entries in ({last}, {cut}] and {to}'s applications consumed some")
        gap += [(kind, p, entry_id, e) for p, e in zip(where[first:], entries[first:]) if p <= cut]
    copy = writes.SinkTransaction(cur.connection, old, client, 0)
    copy.cur = cur  # this reconciling transaction: the session row is locked already
    copy.insert(gap)
    if gap:
        copy.announce()
    return f"{len(gap)} entries of {old} in ({last}, {cut}] copied from {to} (nothing it already held)"


def _start_at_base(cur: psycopg2.extensions.cursor, result: FailoverResult, client: str) -> None:
    """The sink's session from the new source, consistent at the base: log-entry sync from there."""
    sink_sessions.start_in_log_entry_sync(cur, result.to_site, client, result.topology.topology_config_id, result.base)
