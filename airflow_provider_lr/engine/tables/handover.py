"""Federated tables in a failover: the promoted site becomes their source, every other sink takes
a snapshot from it, the old source becomes one of their sinks (docs/failover.md).

Table changes are applied to the sinks' tables, not queued, so a sink ahead of the promoted site
(changes of the old source beyond the cut applied) or behind it cannot be cut back by entries.
The rule is therefore a table snapshot from the new source for every other sink: its origin moves
to the new source here, and the next cycle of its session from the new source clears the old
source's rows and copies the new source's (``tables/snapshot``), then applies its changes.

Each step runs inside the failover's own transaction on that site, so it commits with the rest of
that site's part of the failover or not at all:

* ``take_over`` on the promoted site (its promote transaction): each table it holds synced from
  the old source is federated here (capture triggers, a new ``table_id``) and becomes its own; the
  sequences its columns draw from move past its rows (``tables/sequences``), so its applications'
  inserts that rely on a default do not collide with a replicated row;
* ``follow`` on every other sink (its reconcile transaction): the table's origin moves to the new
  source and it waits for that source's snapshot (state ``syncing``, shown by ``lr status``);
* ``retire`` on the old source (when it rejoins, or a planned switchover drains it): its capture
  triggers become guards that refuse its applications' writes (lr's own apply passes), and the
  registry names the new source as the table's origin;
* ``diverged``: every table of a site whose replication is not running (``lr status``).
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg2.errors
import psycopg2.extensions
from psycopg2 import sql

from airflow_provider_lr.engine.db import schema
from airflow_provider_lr.engine.errors import ConfigurationError, LRError
from airflow_provider_lr.engine.source.closed_tables import CLOSED_TABLE_ID_SCHEMA
from airflow_provider_lr.engine.source.moved import sourced_elsewhere
from airflow_provider_lr.engine.store import sink_sessions, source_sessions
from airflow_provider_lr.engine.tables import capturable, closed_notes, registry, sequences
from airflow_provider_lr.engine.tables import sink as sink_tables
from airflow_provider_lr.engine.tables.definition import TableName
from airflow_provider_lr.engine.tables.registry import FederatedTable
from airflow_provider_lr.engine.tables.sink import TableState
from airflow_provider_lr.engine.vocabulary import SessionKey


def held_from(cur: psycopg2.extensions.cursor, source: str, client: str) -> dict[str, str]:
    """The tables this site takes from ``source`` for ``client``: name -> state."""
    cur.execute(
        "SELECT table_name, state FROM lr.sink_tables WHERE source_site_id = %s AND client_name = %s "
        "ORDER BY table_name",
        (source, client),
    )
    return dict(cur.fetchall())


def forgotten_from(cur: psycopg2.extensions.cursor, source: str, client: str) -> dict[str, str]:
    """The tables this site registered from ``source`` for ``client`` whose copy's record a full sync
    of the session forgot (its start does: a new snapshot comes after it) and that none replaced
    yet: name -> ``syncing``. A failover while that sync is under way must hand them over as well."""
    cur.execute(
        "SELECT g.stream_name FROM lr.registry g WHERE g.kind = 'table' AND g.is_federated "
        "AND g.table_id IS NULL AND g.source_site_id = %s AND g.client_name = %s AND NOT EXISTS ("
        "SELECT 1 FROM lr.sink_tables t WHERE t.source_site_id = %s AND t.client_name = %s "
        "AND t.table_name = g.stream_name) ORDER BY g.stream_name",
        (source, client, source, client),
    )
    return {name: TableState.SYNCING for (name,) in cur.fetchall()}


def captured(cur: psycopg2.extensions.cursor, client: str) -> list[str]:
    """The tables this site captures for ``client`` (federated here, not closed)."""
    cur.execute(
        "SELECT stream_name FROM lr.registry WHERE kind = 'table' AND is_federated AND client_name = %s "
        "AND table_id IS NOT NULL ORDER BY stream_name",
        (client,),
    )
    return [name for (name,) in cur.fetchall()]


def captured_for_others(cur: psycopg2.extensions.cursor, client: str, tables: list[str]) -> dict[str, str]:
    """Of ``tables`` (copies this site holds for ``client``), those it captures for another client
    (its copy federated back: both ways): table -> that client. Taking one over for ``client``
    moves its capture to ``client``."""
    cur.execute(
        "SELECT stream_name, client_name FROM lr.registry WHERE kind = 'table' AND is_federated "
        "AND table_id IS NOT NULL AND client_name <> %s AND stream_name = ANY(%s) ORDER BY 1",
        (client, tables),
    )
    return dict(cur.fetchall())


def missing(
    promoted: dict[str, str], others: dict[str, dict[str, str]], source: str = "", at_source: list[str] | None = None
) -> list[str]:
    """Why promoting a site whose tables are ``promoted`` (``held_from`` the old source) would stop
    a table's replication: a table the old source ``source`` captures (``at_source``, when it can be
    read), some other sink takes from it (``others``: sink -> its ``held_from``) or the promoted site
    holds still syncing, that the promoted site does not hold synced. One text per table."""
    holders: dict[str, list[str]] = {}  # table -> the other sinks taking it
    notes: dict[str, list[str]] = {}  # table -> why else
    for sink, held in sorted(others.items()):
        for table, state in held.items():
            if state != TableState.CONFLICT and promoted.get(table) != TableState.SYNCED:
                holders.setdefault(table, []).append(sink)
    for table, state in promoted.items():  # its first snapshot not applied: it holds half a table
        if state == TableState.SYNCING:
            notes.setdefault(table, [])
    for table in at_source or []:
        if promoted.get(table) != TableState.SYNCED:
            notes.setdefault(table, []).append(f"captured at {source}")
    return [
        f"{table} ({promoted.get(table, 'never synced')} there"
        + (f"; held by {', '.join(holders[table])}" if table in holders else "")
        + "".join(f"; {note}" for note in notes.get(table, []))
        + ")"
        for table in sorted(holders.keys() | notes.keys())
    ]


def untaken(
    conns: dict,
    old: psycopg2.extensions.connection | None,
    switch: tuple[str, str],
    sinks: list[str],
    clients: list[str],
    allowed: bool,
) -> list[str]:
    """The federated tables whose replication the failover would stop: captured at the old source
    (``old``, when reachable) or taken from it by another sink, but not synced at the site to promote
    (``switch``: old source, new source), which therefore cannot become their source; one it holds
    half (its snapshot not applied) too. Refused (nothing done) unless ``allowed``; then returned,
    and ``lr status`` marks them diverged."""
    from_site, to_site = switch
    found = []
    for client in clients:
        held = {}
        for site in [to_site, *sinks]:
            with conns[site].cursor() as cur:
                held[site] = held_from(cur, from_site, client)
            conns[site].commit()
        at_source = None
        if old is not None:
            with old.cursor() as cur:
                at_source = captured(cur, client)
            old.commit()
        with conns[to_site].cursor() as cur:  # a copy closed at the old source is not taken over (``take_over``)
            shut = closed_notes.closed_copies(cur, from_site, client)
            synced = [t for t, st in held[to_site].items() if st == TableState.SYNCED and t not in shut]
            onward = captured_for_others(cur, client, synced)
        conns[to_site].commit()
        if onward and not allowed:
            raise ConfigurationError(
                f"site {to_site!r} captures its copy of {', '.join(f'{t} for client {c!r}' for t, c in onward.items())} "
                f"(federated both ways): promoting it for {client!r} would capture the table for {client!r} instead, "
                "and that client's sinks would no longer receive its changes while lr status called their copies "
                f"synced; close it there first (lr tables close {next(iter(onward))} --site {to_site}: its sinks keep "
                "their copy) and fail over again, or allow it (--allow-table-divergence); nothing was done"
            )
        found += [
            f"{client}: {t} (captured at {to_site} for client {c!r}, whose sinks stop receiving it)"
            for t, c in onward.items()
        ]
        found += [f"{client}: {t}" for t in missing(held.pop(to_site), held, from_site, at_source)]
    if found and not allowed:
        raise ConfigurationError(
            f"site {to_site!r} holds no synced copy of federated table(s) of {from_site!r}: {'; '.join(found)}; "
            "promoting it would stop their replication; run lr sync until their snapshot is applied there and "
            "promote it again, or promote a site that holds them, or allow it (--allow-table-divergence: lr status "
            "then marks them DIVERGED); nothing was done"
        )
    return found


def carried(new: psycopg2.extensions.connection, from_site: str, client: str, tables: list[str], allowed: bool) -> None:
    """The tables the drain guards at the old source (read in its transaction: one opened there since
    ``untaken`` read them too) must be held synced by the new source; else refused."""
    with new.cursor() as cur:
        found = missing(held_from(cur, from_site, client), {}, from_site, tables)
    new.commit()
    if found and not allowed:
        raise ConfigurationError(
            f"federated table(s) opened at {from_site!r} during the switchover are not synced at the new source: "
            f"{client}: {'; '.join(found)}; run lr sync until their snapshot is applied there and switch over "
            "again; nothing was done"
        )


def take_over(cur: psycopg2.extensions.cursor, old_source: str, client: str) -> list[FederatedTable]:
    """On the promoted site: each table it holds synced from ``old_source`` for ``client`` is
    captured here from now on (a new federation of it: every sink takes a snapshot of it), its rows
    are this site's own and its sequences are past them. Tables it does not hold synced are left
    as they are."""
    taken = []
    closed = closed_notes.closed_copies(cur, old_source, client)  # closed at the old source: they stay so
    for name, state in held_from(cur, old_source, client).items():
        if state != TableState.SYNCED or name in closed:
            continue
        table = TableName.parse(name)
        cur.execute("SELECT source_site_id FROM lr.registry WHERE stream_name = %s AND kind = 'table'", (name,))
        row = cur.fetchone()
        primary = row is not None and row[0] == old_source
        found = registry.federate(cur, table, client, registry.read(cur, table, lock=True))
        sequences.advance(cur, table)
        if primary:  # the old source's rows were the unlisted ones: now this site's own
            cur.execute("UPDATE lr.registry SET source_site_id = NULL WHERE stream_name = %s", (name,))
            cur.execute(
                "DELETE FROM lr.table_row_origin WHERE table_name = %s AND source_site_id = %s", (name, old_source)
            )
            unlist_primary(cur, name)
        else:  # another origin is primary here: this site's rows stay listed, under itself
            cur.execute(
                "UPDATE lr.table_row_origin SET source_site_id = (SELECT site_id FROM lr.site_info) "
                "WHERE table_name = %s AND source_site_id = %s",
                (name, old_source),
            )
        cur.execute(
            "DELETE FROM lr.sink_tables WHERE source_site_id = %s AND client_name = %s AND table_name = %s",
            (old_source, client, name),
        )
        assert found.table_id is not None
        taken.append(FederatedTable(table, found.table_id))
    return taken


def follow(
    cur: psycopg2.extensions.cursor, old_source: str, new_source: str, client: str, federated: list[FederatedTable]
) -> dict[str, str]:
    """On another sink: each table it takes from ``old_source`` that ``new_source`` now captures
    (``federated``) moves to the new source, whose snapshot replaces the old source's rows at the
    next cycle of the session (the cut of tables). A table the new source does not capture stays
    as it is, and ``diverged`` shows it. Returns table -> what was done."""
    captured = {str(t.table): t for t in federated}
    closed = closed_notes.closed_copies(cur, old_source, client)
    done = {}
    # a copy whose record a full sync from the old source forgot (under way at the failover) moves
    # too: left out, the old source stayed its origin here, and the new source's snapshot came as a
    # second source's, upserted beside the old rows (rows deleted at the old source stayed for good)
    held = {**forgotten_from(cur, old_source, client), **held_from(cur, old_source, client)}
    for name, state in sorted(held.items()):
        table = captured.get(name)
        if table is None:
            if name in closed:
                done[name] = f"closed at {old_source}: this copy is kept, no longer updated"
            elif state != TableState.CONFLICT:
                done[name] = f"diverged: {new_source} does not replicate it (no synced copy there)"
            continue
        cur.execute(
            "DELETE FROM lr.sink_tables WHERE source_site_id = %s AND client_name = %s AND table_name = %s",
            (old_source, client, name),
        )
        cur.execute(
            "UPDATE lr.registry SET source_site_id = %s WHERE stream_name = %s AND kind = 'table' "
            "AND source_site_id = %s",
            (new_source, name, old_source),
        )
        cur.execute(
            "UPDATE lr.table_row_origin SET source_site_id = %s WHERE table_name = %s AND source_site_id = %s",
            (new_source, name, old_source),
        )
        unlist_primary(cur, name)
        _guard_again(cur, name, client, new_source)
        if state == TableState.CONFLICT:
            continue  # not federated here: the new source's snapshot records the conflict again
        sink_tables.record(
            cur,
            new_source,
            client,
            table.table,
            table.table_id,
            TableState.SYNCING,
            run_id=None,
            split_snapshot=None,
            split_upto=None,
            rows_copied=None,
            detail=f"failover: waits for a snapshot from {new_source}, which replaces the rows "
            f"of {old_source} (the cut of tables)",
        )
        done[name] = f"a snapshot from {new_source} replaces {old_source}'s rows at the next cycle"
    return done


def _guard_again(cur: psycopg2.extensions.cursor, name: str, client: str, new_source: str) -> None:
    """An earlier failover's old source (guarded, rejoined) whose table moves on to ``new_source``:
    its guard names the site to write at, so it names the new source now. Left as it was, it sent
    the site's writers to the failed-over site (chained failovers)."""
    cur.execute(
        "SELECT 1 FROM pg_catalog.pg_trigger WHERE tgrelid = to_regclass(%s) AND tgname = %s",
        (TableName.parse(name).ident.as_string(cur), registry.guard_name("INSERT")),
    )
    if cur.fetchone() is not None:
        registry.guard_writes(cur, TableName.parse(name), client, new_source)


def retire(cur: psycopg2.extensions.cursor, client: str, new_source: str, tables: list[str] | None) -> list[str]:
    """On the old source: the client's tables it captures (``tables``: only those; None: all) are
    no longer captured here; a guard refuses its applications' writes (lr's apply passes), and,
    for ``tables``, the registry names ``new_source`` as their origin. Returns the tables guarded."""
    names = [name for name in captured(cur, client) if tables is None or name in tables]
    for name in names:
        _lock_for_guard(cur, name, client)
        registry.guard_writes(cur, TableName.parse(name), client, new_source)
        if tables is not None:
            over = ", closed_table_id = NULL" if schema.at_least(cur.connection, CLOSED_TABLE_ID_SCHEMA) else ""
            cur.execute(  # an earlier close's table id is over: it named a federation of this site's, not a copy
                f"UPDATE lr.registry SET table_id = NULL, source_site_id = %s{over} WHERE stream_name = %s",
                (new_source, name),
            )
            unlist_primary(cur, name)
    return names


def unlist_primary(cur: psycopg2.extensions.cursor, name: str) -> None:
    """Rows ``lr.table_row_origin`` lists under the table's primary origin (this site, where the
    registry names none) are that origin's: unlisted, as its rows are (``tables/clearing``). A
    failover that made a site the table's origin here where it was a second origin already (it
    federated its copy back: both ways) left its rows listed, and its snapshot, which clears the
    unlisted rows, never cleared them: a row it had deleted stayed here for good."""
    cur.execute(
        "DELETE FROM lr.table_row_origin o USING lr.registry g WHERE g.stream_name = %s AND g.kind = 'table' "
        "AND o.table_name = g.stream_name "
        "AND o.source_site_id = coalesce(g.source_site_id, (SELECT i.site_id FROM lr.site_info i))",
        (name,),
    )


class TableBusyError(LRError):
    """An application's transaction holds a table whose writes a failover must refuse here."""


def _lock_for_guard(cur: psycopg2.extensions.cursor, name: str, client: str) -> None:
    """Lock the table for its guard, waiting at most the connection's ``lock_timeout`` (5 s when it
    has none). An application's open transaction on it (a writer the failover is to refuse) gets a
    refusal naming the table and its holders; before, the failover stopped on ``lock_timeout``
    with no table named, the promoted site's new topology file not written."""
    cur.execute("SELECT current_setting('lock_timeout')")
    if cur.fetchone()[0] in ("0", "0ms"):
        cur.execute("SET LOCAL lock_timeout = '5s'")
    cur.execute("SAVEPOINT lr_guard")
    try:
        cur.execute(sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(TableName.parse(name).ident))
    except (psycopg2.errors.LockNotAvailable, psycopg2.errors.DeadlockDetected) as exc:
        # deadlock: a writer holding the table waits for this transaction too (its transmit for the
        # drain's lock of lr.clients, its next table for one guarded already), and PostgreSQL chose us
        why = "lock_timeout" if isinstance(exc, psycopg2.errors.LockNotAvailable) else "deadlock"
        cur.execute("ROLLBACK TO SAVEPOINT lr_guard")
        cur.execute(
            "SELECT string_agg(DISTINCT pid::text, ', ') FROM pg_locks WHERE relation = to_regclass(%s) "
            "AND granted AND pid <> pg_backend_pid()",
            (name,),
        )
        holders = cur.fetchone()[0] or "unknown"
        cur.execute("SELECT site_id FROM lr.site_info")
        raise TableBusyError(
            f"table {name} of client {client} is held by open transaction(s) at {cur.fetchone()[0]} (pid "
            f"{holders}): its "
            f"writes could not be refused ({why}), nothing was changed on this site; stop this site's "
            "writers of the table (their changes reach nobody since the failover) and run it again"
        ) from None
    cur.execute("RELEASE SAVEPOINT lr_guard")


@dataclass(frozen=True)
class Divergence:
    """A federated table of this site whose replication is not running, and why."""

    table: str
    client: str | None
    why: str

    def describe(self) -> str:
        return f"{self.table} DIVERGED (client {self.client or '-'}): {self.why}"


def diverged(conn: psycopg2.extensions.connection) -> list[Divergence]:
    """Every federated table of this site that is not replicating:

    * as a sink: it holds the table (synced or syncing) from a session that was failed over (and
      the promoted site, which did not hold it, did not take it over) or that no longer exists;
    * as a source: it is captured here (a ``table_id``) but its capture triggers are gone, it was
      made part of a partition or inheritance hierarchy since (its triggers miss writes naming
      another member), or its client has no sink session from this site (the triggers then
      capture nothing)."""
    found = []
    with conn.cursor() as cur:
        rows = sink_sessions.tables_of_closed_sessions(cur, (TableState.SYNCED, TableState.SYNCING))
        cur.execute("SELECT site_id FROM lr.site_info")
        here = cur.fetchone()[0]
        closed: dict[tuple[str, str], set[str]] = {}  # (source, client) -> its closed copies, read once
        for name, client, source, gone, to in rows:
            if (source, client) not in closed:
                closed[source, client] = closed_notes.closed_copies(cur, source, client)
            if name in closed[source, client]:
                continue  # closed at its source (lr tables close): kept on purpose, not a divergence
            session = SessionKey(source, here, client)
            why = (
                f"its session {session} is gone"
                if gone
                else f"its session {session} was failed over to {to}, which does not replicate it"
            )
            found.append(Divergence(name, client, f"{why}; its rows stay as {source} left them"))
        with_sinks = source_sessions.clients_with_sessions(cur)
        cur.execute(
            "SELECT g.stream_name, g.client_name, g.table_id FROM lr.registry g "
            "WHERE g.kind = 'table' AND g.is_federated AND g.table_id IS NOT NULL ORDER BY 1"
        )
        captured = cur.fetchall()
        renamed = {  # renamed at the source: its capture goes on under the new name
            (t.table, t.table_id): t
            for tables in registry.federated_tables_of(conn, {client for _, client, _ in captured}).values()
            for t in tables
            if t.renamed_to
        }
        sourced = {client: sourced_elsewhere(cur, client) for client in {client for _, client, _ in captured}}
        for name, client, table_id in captured:
            has_sink = client in with_sinks
            moved = renamed.get((TableName.parse(name), table_id))
            elsewhere = sourced[client]
            if elsewhere is not None:  # its client failed over from here without it: reopening here cannot help
                found.append(Divergence(name, client, _left_behind(name, client, elsewhere, here)))
            elif moved is not None:
                found.append(Divergence(name, client, moved.renamed()))
            elif not registry.capturing(cur, TableName.parse(name)):
                found.append(
                    Divergence(
                        name,
                        client,
                        "captured here but its capture triggers are gone: changes are "
                        "not replicated (reopen it: lr tables open)",
                    )
                )
            elif skipped := registry.capture_skipped(cur, TableName.parse(name)):
                found.append(
                    Divergence(
                        name,
                        client,
                        f"captured here but its capture trigger(s) {', '.join(skipped)} are disabled: changes are "
                        "not replicated (reopen it: lr tables open, which enables them; or its owner: ALTER TABLE "
                        f"{name} ENABLE ALWAYS TRIGGER ...)",
                    )
                )
            elif (hierarchy := capturable.not_capturable(cur, TableName.parse(name))) is not None:
                fix = (  # made unlogged since it was opened (the reason says how to undo it)
                    "the sinks may miss the rows a crash empties it of. Make it logged again"
                    if "unlogged" in hierarchy  # else made a partition, or given an inheritance parent or child
                    else "the sinks hold the table's own rows and may miss changes. Take it out of the "
                    "hierarchy (ALTER TABLE ... NO INHERIT, DETACH PARTITION)"
                )
                found.append(
                    Divergence(
                        name,
                        client,
                        f"captured here, but {hierarchy}: it became so after lr tables open, which refuses such a "
                        f"table; {fix} or close it (lr tables close)",
                    )
                )
            elif not has_sink:
                found.append(
                    Divergence(
                        name,
                        client,
                        f"captured here but client {client!r} has no sink from this site: changes are not replicated",
                    )
                )
    conn.commit()
    return found


def _left_behind(name: str, client: str, sources: list[str], here: str) -> str:
    """Why a table captured at a client's old source is replicated nowhere, and what to do there."""
    at = " and ".join(sources) or "no site (the topology applied here names no source of it)"
    return (
        f"captured here, but client {client!r} is replicated from {at} now and the failover did not carry "
        f"this table: it is replicated nowhere; open it at the client's source (lr tables open {name} --client "
        f"{client} there: every sink takes a snapshot of it), or close it here (lr tables close {name} --site {here})"
    )
