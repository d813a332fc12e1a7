"""One client's writer of the shared log: its routes, one validated row per message, the insert.

Log-entry transmit (``transmit``) and the full-sync supply (``full_sync``) both write the shared log
through it, so neither imports the other's rules. Each message becomes exactly one row of
``lr.log_entries`` whatever the number of destinations, carrying a compact tag per destination and a
serialized ``RoutingTableEntryMsg``. The caller commits or rolls back: lr never commits here. The
writer takes no lock and updates no shared row, so concurrent application transactions are not
serialized; the commit position is drawn at commit by a deferred trigger (see the migration).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import psycopg2.extensions

from airflow_provider_lr.engine.db import grants
from airflow_provider_lr.engine.db.schema import site_identity
from airflow_provider_lr.engine.db.topology_schema import valid_client_name
from airflow_provider_lr.engine.errors import (
    ConfigurationError,
    TransmitError,
    listing,
    require_counts,
    shown,
    shown_all,
)
from airflow_provider_lr.engine.source import moved
from airflow_provider_lr.engine.store import source_sessions
from airflow_provider_lr.engine.store.topology import applied_document, applied_max_payload_bytes
from airflow_provider_lr.engine.vocabulary import PAYLOAD_TAG, STREAM_LOG_ENTRIES, varint
from airflow_provider_lr.proto import lr_pb2

DEFAULT_MAX_PAYLOAD_BYTES = 16 * 1024 * 1024
PREPARED_INSERT = "lr_transmit_v3"  # versioned: a new lr with another insert uses a new name
# Everything here runs in the application's transaction under its search_path: every function and
# type is qualified, so a schema of the application's (put before pg_catalog) with a function or type
# named like one of them (pg_current_xact_id, text, bytea) cannot stand in for it.
#
# The entries, and the transaction's id in the same statement (a ticket names it). RETURNING names no
# column of the log, so it needs no SELECT privilege and no SELECT policy: a writer role, which may
# not read the log, uses it too, and row-level security still checks every row it inserts.
_RETURNING_TX = " RETURNING pg_catalog.pg_current_xact_id()::pg_catalog.text"
_INSERT = "INSERT INTO lr.log_entries (stream, tag_ids, client_id, message) VALUES "
_PAGE_ROWS = 1000  # entries per INSERT when many are written at once (a full sync's supply)
MAX_ROUTES = 1024  # lists of destinations a writer keeps checked (``LogWriter.route``)


def values_row(stream: int, tags: list[int], message: bytes, client_id: int) -> str:
    """One entry as a row of literals, built by lr rather than the driver's quoting (on the writer's hot
    path that quoting cost more than the rest of a transmit): integers lr holds and the message's hex
    digits, which need no escaping. The literals take their column's type (an INSERT's VALUES, or the
    prepared insert's declared parameter types), so the search_path resolves nothing, and
    ``E'\\\\x…'`` reads as bytea's hex form whatever the session's ``standard_conforming_strings``."""
    tag_list = ",".join(f"{tag:d}" for tag in tags)  # integers only (``:d`` refuses anything else)
    return f"({stream:d}, '{{{tag_list}}}', {client_id:d}, E'\\\\x{message.hex()}')"


@dataclass(frozen=True)
class Route:
    """One list of destinations of a log entry, checked once per writer: its sinks' tags, the
    destinations a ticket names, and the entry's serialized fields around its payload. A log entry
    is ``head``, the payload's record, ``tail``: byte for byte what the generated code serializes
    (fields in number order: destinations, type | opaque_payload | source site, client), which the
    sinks' byte-level reading relies on (``vocabulary.sink_form_at``); only the payload's record is
    made per entry."""

    tags: list[int]
    named: tuple[str, ...]  # sorted, each once
    head: bytes
    tail: bytes

    def message(self, payload: bytes) -> bytes:
        if not payload:  # proto3 leaves an empty bytes field out
            return self.head + self.tail
        return b"".join((self.head, PAYLOAD_TAG, varint(len(payload)), payload, self.tail))


# A client's id by its name (a ``%s``), for a reader that takes one client's entries of a transaction:
# a writer sets its full-sync request's supplied_tx (it supplies in its own transaction); pointed at
# another client's supply, that client's full-sync payloads reached this client's sink queues.
CLIENT_ID_OF = "(SELECT k.client_id FROM lr.clients k WHERE k.client_name = %s)"


def _destinations(destinations: Iterable[str]) -> tuple[str, ...]:
    """``destinations`` as a tuple, read once (any iterable of site ids: a generator is read once only);
    ``TransmitError`` (nothing written) for one string, a non-iterable, nothing, or an item not a string."""
    if isinstance(destinations, (str, bytes)):
        named: tuple = ()
    else:
        try:
            named = tuple(destinations)
        except TypeError:
            raise TransmitError(
                f"destinations must be a non-empty list of site ids, not {type(destinations).__name__}; "
                "nothing was written"
            ) from None
    if not named:
        raise TransmitError("destinations must be a non-empty list of site ids; nothing was written")
    if not all(isinstance(d, str) for d in named):
        raise TransmitError(
            f"destinations must be site ids (strings), not [{shown_all(list(named))}]; nothing was written"
        )
    return named


def usable(conn: psycopg2.extensions.connection) -> None:
    """``TransmitError`` for a closed connection or one whose transaction already failed (an earlier
    statement's error: PostgreSQL ignores every statement until the rollback), before any write."""
    if conn.closed:
        raise TransmitError("the application's connection is closed: give an open one; nothing was written")
    if conn.info.transaction_status == psycopg2.extensions.TRANSACTION_STATUS_INERROR:
        raise TransmitError(
            "the application's transaction has already failed (an earlier statement's error): roll it back "
            "and redo its work; nothing was written"
        )


class LogWriter:
    """Writes one client's entries into the shared log, inside the caller's transaction.

    ``conn`` is the application's open psycopg2 connection; nothing is committed here.
    """

    def __init__(
        self,
        conn: psycopg2.extensions.connection,
        client_name: str,
        max_payload_bytes: int | None = None,
        prepared: bool = True,
    ) -> None:
        if not isinstance(
            conn, psycopg2.extensions.connection
        ):  # a DSN, say: transmits ride in the caller's transaction
            raise ConfigurationError(
                f"the client writes in the application's own transaction: give its open psycopg2 connection, "
                f"not a {type(conn).__name__} (a DSN or site id names a site; connect to it first)"
            )
        if not valid_client_name(client_name):  # as the topology's: str.isalnum let 'pólicy' and any length by
            raise TransmitError(
                f"invalid client name {shown(client_name)}: a topology's client names are ASCII letters, "
                "digits, '-' or '_' (not first), at most 63 characters"
            )
        require_counts(max_payload_bytes=max_payload_bytes)
        usable(conn)
        self.conn = conn
        self.client_name = client_name
        self.max_payload_bytes = DEFAULT_MAX_PAYLOAD_BYTES
        idle = conn.get_transaction_status() == psycopg2.extensions.TRANSACTION_STATUS_IDLE
        self.source_site_id, _ = site_identity(conn)
        self.client_id = 0
        self._tag_ids: dict[str, int] = {}  # the sinks this client replicates to -> their tag
        self._routes: dict[tuple[str, ...], Route] = {}  # destinations as given -> checked (``route``)
        self._may_write = False  # the role's grants were read (at the first transmit)
        self._load_routes(topology_limit=True)
        limit, self.max_payload_bytes = self.max_payload_bytes, max_payload_bytes or self.max_payload_bytes
        self.prepared = prepared
        if prepared and self.max_payload_bytes <= limit:
            self._prepare()
        if idle:
            conn.rollback()  # leave the caller's connection as we found it (read only so far)
        if self.max_payload_bytes > limit:  # every reader's memory budget assumes the limit (docs/memory.md)
            raise ConfigurationError(
                f"max_payload_bytes={self.max_payload_bytes} is above the topology's limit of {limit} bytes "
                f"(settings: max_payload_bytes, at most {DEFAULT_MAX_PAYLOAD_BYTES}): give a lower one, or none"
            )

    def _load_routes(self, topology_limit: bool = False) -> None:
        """The client's id and its sinks (and, when asked, the payload limit: the topology's
        ``max_payload_bytes``), from the topology applied to this site."""
        with self.conn.cursor() as cur:
            if topology_limit:
                self.max_payload_bytes = applied_max_payload_bytes(cur) or DEFAULT_MAX_PAYLOAD_BYTES
            cur.execute(
                "SELECT client_id FROM lr.clients WHERE client_name OPERATOR(pg_catalog.=) %s", (self.client_name,)
            )
            row = cur.fetchone()
            self.client_id = row[0] if row else 0
            self._tag_ids = source_sessions.sink_tags(cur, self.client_name)
        self._routes.clear()

    def _prepare(self) -> None:
        """Prepare the single-entry insert once per connection: parse and plan are most of what an
        extra INSERT costs the server in a small application transaction. Prepared statements are
        per session and survive rollback. Pass ``prepared=False`` behind a pooler that discards
        session state (``DISCARD ALL``) between transactions."""
        with self.conn.cursor() as cur:
            cur.execute(
                "SELECT 1 FROM pg_catalog.pg_prepared_statements WHERE name OPERATOR(pg_catalog.=) %s",
                (PREPARED_INSERT,),
            )
            if cur.fetchone() is None:
                cur.execute(
                    f"PREPARE {PREPARED_INSERT} (pg_catalog.int2, pg_catalog.int4[], pg_catalog.int4, "
                    "pg_catalog.bytea) AS " + _INSERT + "($1, $2, $3, $4)" + _RETURNING_TX
                )

    def _payload(self, payload: bytes) -> bytes:
        """``payload`` as bytes; ``TransmitError``, nothing written, when it is refused."""
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise TransmitError(f"payload must be bytes, not {type(payload).__name__}; nothing was written")
        size = payload.nbytes if isinstance(payload, memoryview) else len(payload)  # bytes, not items
        if size > self.max_payload_bytes:
            raise TransmitError(
                f"payload of {size} bytes exceeds the maximum of {self.max_payload_bytes} bytes "
                f"(client {self.client_name!r}); nothing was written"
            )
        return bytes(payload)

    def log_entry(self, payload: bytes, destinations: Sequence[str]) -> tuple[tuple[int, list[int], bytes], Route]:
        """One log entry's row (stream, tag ids, serialized message) and its route: the payload
        checked every time, the destinations once per list (``route``); ``TransmitError``, with
        nothing written, when either is refused."""
        payload = self._payload(payload)
        route = self.route(destinations)
        return (STREAM_LOG_ENTRIES, route.tags, route.message(payload)), route

    def _row(
        self,
        stream: int,
        payload: bytes,
        destinations: Sequence[str],
        kind: lr_pb2.ReplicationType,
        *,
        snapshot_request_id: str = "",
        base_snapshot: int = 0,
        base_snapshot_xids: str = "",
        base_snapshot_upto: int = 0,
    ) -> tuple[int, list[int], bytes]:
        """One full-sync message as a log row (stream, tag ids, serialized message); ``TransmitError``,
        with nothing written, when the payload or its destinations are refused."""
        payload = self._payload(payload)
        unique = self._checked(destinations)
        message = lr_pb2.RoutingTableEntryMsg(
            destinations=unique,
            type=kind,
            opaque_payload=payload,
            source_site_id=self.source_site_id,
            client_name=self.client_name,
            snapshot_request_id=snapshot_request_id,
            base_snapshot=base_snapshot,
            base_snapshot_xids=base_snapshot_xids,
            base_snapshot_upto=base_snapshot_upto,
        )
        return stream, [self._tag_ids[d] for d in unique], message.SerializeToString()

    def route(self, destinations: Sequence[str]) -> Route:
        """``destinations`` of a log entry, checked (``TransmitError`` when refused): once per list."""
        key = _destinations(destinations)  # read once: a generator would be empty the second time
        if not self._may_write:  # once; a log entry's only (a full sync's supply may be the replicator's)
            usable(self.conn)  # (the grants are read on it: a failed transaction said only that it failed)
            grant = grants.held(self.conn, "lr.log_entries", ("writer",), self.client_name)
            if grant is not None and not grant.may:  # a policy violation said nothing of the grant it lacks
                doing = f"transmit as client {self.client_name!r}"
                raise TransmitError(
                    grant.refusal(doing, "writer", self.client_name, repr(self.source_site_id), "; nothing was written")
                )
            self._may_write = True
        found = self._routes.get(key)
        if found is None:
            unique = self._checked(key)
            head = lr_pb2.RoutingTableEntryMsg(destinations=unique, type=lr_pb2.LOG_ENTRY_SYNC).SerializeToString()
            tail = lr_pb2.RoutingTableEntryMsg(
                source_site_id=self.source_site_id, client_name=self.client_name
            ).SerializeToString()
            found = Route([self._tag_ids[d] for d in unique], tuple(sorted(unique)), head, tail)
            whole = lr_pb2.RoutingTableEntryMsg(
                destinations=unique,
                type=lr_pb2.LOG_ENTRY_SYNC,
                opaque_payload=b"lr",
                source_site_id=self.source_site_id,
                client_name=self.client_name,
            )
            assert found.message(b"lr") == whole.SerializeToString(), "a log entry is what protobuf serializes"
            if len(self._routes) >= MAX_ROUTES:  # an application naming ever new lists: bounded all the same
                self._routes.clear()
            self._routes[key] = found
        return found

    def _checked(self, destinations: Sequence[str]) -> list[str]:
        """``destinations`` each once, in order; ``TransmitError`` (nothing written) when refused."""
        unique = list(dict.fromkeys(_destinations(destinations)))
        if self.source_site_id in unique:
            raise TransmitError(f"site {self.source_site_id!r} cannot transmit to itself; nothing was written")
        unknown = [d for d in unique if d not in self._tag_ids]
        if unknown:
            self._load_routes()  # the topology may have been applied since this client started
            unknown = [d for d in unique if d not in self._tag_ids]
        if unknown:
            if not self.client_id:
                raise TransmitError(self._not_a_source())
            with self.conn.cursor() as cur:
                elsewhere = moved.not_sourced_here(cur, self.client_name)
            if elsewhere is not None and not self._tag_ids:  # a failover moved it: no topology edit brings it back
                raise TransmitError(
                    f"client {self.client_name!r} is not replicated from site {self.source_site_id!r} any more: "
                    f"{elsewhere}; nothing was written"
                )
            raise TransmitError(
                f"unknown destination(s) {shown_all(unknown)} for client {self.client_name!r} at source "
                f"{self.source_site_id!r}: the topology replicates it to {sorted(self._tag_ids)} "
                f"(edit the topology and run `lr topology apply`); nothing was written"
            )
        return unique

    def _not_a_source(self) -> str:
        """Why this site may not transmit for the client it does not source. A sink of it (a writer
        moved there before a failover promoted the site) is told where to transmit and how this site
        becomes the source: adding the client to a replication from here would make it the source of
        a client another site sources, which is what `lr failover` does, with the cut."""
        here, client = self.source_site_id, self.client_name
        with self.conn.cursor() as cur:
            document = applied_document(cur) or {}
        replications = [r for r in document.get("replication") or [] if client in (r.get("clients") or [])]
        sources = sorted({str(r.get("source")) for r in replications})
        if not sources:
            return (
                f"client {client!r} is not in the topology applied to {here!r} "
                f"(add it to a replication and run `lr topology apply`); nothing was written"
            )
        sink = any(here in (r.get("sinks") or []) for r in replications)
        return (
            f"client {client!r} is replicated from site {listing(sources)}, not from {here!r}"
            + (" (one of its sinks)" if sink else "")
            + ": transmit there"
            + (f", or make {here!r} its source with `lr failover --promote {here}`" if sink else "")
            + "; nothing was written"
        )

    def _insert(self, rows: list[tuple[int, list[int], bytes]]) -> int:
        """Insert rows made by ``_row``, in order, in the caller's transaction; returns the
        transaction's id (what a delivery ticket names: its commit position is drawn at commit)."""
        usable(self.conn)
        if self.conn.autocommit and len(rows) > _PAGE_ROWS:  # one transaction, as on any other connection:
            return self._insert_whole(rows)  # each page was one of its own, the ticket naming the last
        with self.conn.cursor() as cur:
            if len(rows) == 1 and self.prepared:
                cur.execute(f"EXECUTE {PREPARED_INSERT} " + values_row(*rows[0], self.client_id))
                return int(cur.fetchone()[0])
            # entry ids follow the VALUES order: transmit order within the transaction is kept.
            for start in range(0, len(rows), _PAGE_ROWS):
                page = rows[start : start + _PAGE_ROWS]
                cur.execute(_INSERT + ",".join(values_row(*row, self.client_id) for row in page) + _RETURNING_TX)
            return int(cur.fetchone()[0])

    def _insert_whole(self, rows: list[tuple[int, list[int], bytes]]) -> int:
        """``_insert`` on a connection in autocommit mode of more rows than one statement writes: in
        one transaction, committed (what autocommit does with each statement), then autocommit again."""
        self.conn.autocommit = False
        try:
            tx = self._insert(rows)
            self.conn.commit()
            return tx
        except BaseException:
            if not self.conn.closed:  # lost: its own error says why
                self.conn.rollback()
            raise
        finally:
            if not self.conn.closed:
                self.conn.autocommit = True
