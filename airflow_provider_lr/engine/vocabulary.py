"""The words every part of lr shares: what is on the wire and in the tables, spelled once.

Stream ids, session states and request statuses are stored in the schema and checked by its
constraints; lock keys are also written as literals in migrations (which are checksummed and
cannot change). ``tests/engine/test_vocabulary.py`` checks every such literal against this module,
so a new state or key is added here and in a new migration, never in one place only.

The destination-stripping rule is here too because it *is* wire vocabulary: the byte layout of a
``RoutingTableEntryMsg`` (``proto/lr.proto``) that the sink form depends on.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from google.protobuf.message import DecodeError

from airflow_provider_lr.engine.errors import ConfigurationError, is_control, shown
from airflow_provider_lr.proto import lr_pb2

# --- streams of the shared log (lr.log_entries.stream; V0008 CHECK (stream IN (1, 2, 3))) -------
STREAM_LOG_ENTRIES = 1
STREAM_SNAP_SYNC = 2
STREAM_TABLE_CHANGES = 3  # federated tables' changes, captured by lr.capture_table_changes()
STREAM_NAMES = {
    STREAM_LOG_ENTRIES: "LRQ_Send_LogEntries",
    STREAM_SNAP_SYNC: "LRQ_Send_SnapSync",
    STREAM_TABLE_CHANGES: "LRQ_Send_TableChanges",
}


class _Word(str, Enum):
    """A stored word: a ``str``, so rows read back compare equal to members and psycopg2 and json
    take members as they are."""

    def __str__(self) -> str:
        return self.value


class SessionState(_Word):
    """Where a session stands, source side (lr.source_sessions.state), after CorfuDB's
    ``LogReplicationStateType``: only the states lr writes (a transferred snapshot waiting for its
    apply stays IN_SNAPSHOT_SYNC; an error is the session's ``last_error``, not a state)."""

    INITIALIZED = "INITIALIZED"  # written by the column's DEFAULT when the topology adds the session
    NEGOTIATING = "NEGOTIATING"
    IN_SNAPSHOT_SYNC = "IN_SNAPSHOT_SYNC"
    IN_LOG_ENTRY_SYNC = "IN_LOG_ENTRY_SYNC"


class RequestStatus(_Word):
    """A full-sync request's status (lr.full_sync_requests.status): written 'pending' by the
    session, 'supplied' by the client's provider, then closed once."""

    PENDING = "pending"
    SUPPLIED = "supplied"
    APPLIED = "applied"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"


class FailoverStatus(_Word):
    """A failover's status on the promoted site (lr.failovers.status, V0010): 'promoted' once the
    new source took over (its sessions, positions and base recorded), 'completed' once every
    involved sink was reconciled and every reachable site has the new topology."""

    PROMOTED = "promoted"
    COMPLETED = "completed"


RECONCILING_SETTING = "lr.reconciling"  # set locally while a failover removes extras (V0010 trigger)


OPEN_STATUSES = (RequestStatus.PENDING, RequestStatus.SUPPLIED)  # an open request holds safe trim
OPEN_STATUSES_SQL = "(" + ", ".join(f"'{s}'" for s in OPEN_STATUSES) + ")"  # for ``status IN ...``


@dataclass(frozen=True, order=True)
class SessionKey:
    """One session: a source, a sink and a client ("one session per remote destination").
    ``str(key)`` — ``source->sink/client`` — is its one spelling in messages, logs, reports and
    result keys."""

    source: str
    sink: str
    client: str

    def __str__(self) -> str:
        return f"{self.source}->{self.sink}/{self.client}"

    @classmethod
    def parse(cls, text: str) -> SessionKey:
        """The key ``str(key)`` spelled (site ids hold no '>' or '/', client names no '/')."""
        source, _, rest = text.partition("->")
        sink, _, client = rest.partition("/")
        if not (source and sink and client):
            raise ValueError(f"not a session (source->sink/client): {text!r}")
        return cls(source, sink, client)


# --- queues -------------------------------------------------------------------------------------
RECEIVE_QUEUE_PREFIX = "LRQ_Recv_"
NOTIFY_CHANNEL = "lr_recv"  # sink NOTIFY on delivery; payload ``wakeup_payload(client, source)``


def receive_queue_name(client: str, source: str) -> str:
    """The sink's receive queue of one client for one source (a name in lr.registry)."""
    return f"{RECEIVE_QUEUE_PREFIX}{client}_{source}"


def wakeup_payload(client: str, source: str) -> str:
    """The NOTIFY payload that wakes the subscribers of one receive queue (client names hold no '/')."""
    return f"{client}/{source}"


def parse_wakeup(payload: str) -> tuple[str, str]:
    """(client, source) of a ``wakeup_payload``."""
    client, _, source = payload.partition("/")
    return client, source


# --- advisory-lock keys (one namespace: 0x6C72 = "lr") -------------------------------------------
SCHEMA_LOCK_KEY = 0x6C72_0001  # pg_advisory_xact_lock(key): schema installs and upgrades
COMMIT_LOCK_KEY = 0x6C72_0002  # shared by every committing writer (V0002 trigger: 1819410434)
# held exclusively by a stream asleep; a committing writer that cannot take it shared NOTIFYs
# COMMIT_CHANNEL (V0022: 1819410435)
STREAM_WAKE_KEY = 0x6C72_0003
# held shared by a stream asleep beside the one holding STREAM_WAKE_KEY: that one NOTIFYs
# COMMIT_CHANNEL when it gives the wake-up key back (V0024: 1819410436)
STREAM_WATCH_KEY = 0x6C72_0004
COMMIT_CHANNEL = "lr_commit"
# two-int keys (class, hashtext(...)) never collide with the one-bigint keys above
CONSUMER_LOCK_CLASS = 0x6C72_7271  # "lrrq": (class, hashtext(queue name)) one consumer per queue
STAGING_LOCK_CLASS = 0x6C72_7366  # "lrsf": (class, hashtext(range)) while a snapshot part stages
MEMBER_LOCK_CLASS = 0x6C72_6D62  # "lrmb": (class, lock key) held by a replicator member while it lives (V0020)

# --- the sink form of an entry: destinations stripped -------------------------------------------
MALFORMED = lr_pb2.NONE  # receive-queue kind of a source entry that does not parse
DESTINATIONS_TAG = 0x0A  # RoutingTableEntryMsg field 1 (destinations), length-delimited
TYPE_TAG = 0x10  # field 2 (type), varint


PAYLOAD_TAG = b"\x1a"  # field 3 (opaque_payload), length-delimited


def varint(value: int) -> bytes:
    """A protobuf varint (a negative int64 as its 10-byte two's complement, as protobuf writes it)."""
    if 0 <= value < 0x80:
        return bytes((value,))
    value &= (1 << 64) - 1
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def sink_form_at(buf: bytes, start: int) -> tuple[int, int]:
    """(kind, offset) of the sink form of the serialized entry that begins at ``buf[start]``: the
    entry minus its leading destination records. Raises IndexError where this byte-level reading
    does not apply (a destination of 128+ bytes, a multi-byte type, a truncated entry): the caller
    then takes ``rewrite_for_sink``.

    Protobuf serializers write known fields in field-number order (``transmit`` serializes every
    log entry with the generated code), so an entry's destinations (field 1) are its leading
    records and its type (field 2) the varint right after them: the sink form is the rest, byte
    for byte what parse + clear + serialize gives. Takes an offset so the fan-out reads entries
    in place inside its COPY rows, with no copy per entry."""
    pos = start
    tag = buf[pos]
    while tag == DESTINATIONS_TAG:
        size = buf[pos + 1]
        if size & 0x80:
            raise IndexError
        pos += 2 + size
        tag = buf[pos]
    if tag == TYPE_TAG:
        kind = buf[pos + 1]
        if kind & 0x80:
            raise IndexError
        return kind, pos
    if tag > TYPE_TAG:  # no type field: the default kind
        return 0, pos
    raise IndexError


def rewrite_for_sink(message: bytes) -> tuple[int, bytes]:
    """The receive-queue form of a source entry, by parsing: destinations cleared. Returns
    (kind, bytes).

    A source entry that does not parse (corrupted in the log) is passed on as it is, with kind
    ``MALFORMED``: every path that writes a receive queue does the same, nothing stops, and the
    subscriber moves it to the sink's dead letters with the error, in its place in the queue."""
    try:
        msg = lr_pb2.RoutingTableEntryMsg.FromString(message)
    except DecodeError:
        return MALFORMED, message
    del msg.destinations[:]
    return msg.type, msg.SerializeToString()


def strip_destinations(message: bytes) -> tuple[int, bytes]:
    """The receive-queue form of a source entry, for every path that writes a receive queue
    (session cycles, the fan-out, snapshot transfers write the same rows): ``sink_form_at`` when it
    applies (~2.5x cheaper per entry), else ``rewrite_for_sink``."""
    try:
        kind, pos = sink_form_at(message, 0)
    except IndexError:
        return rewrite_for_sink(message)
    return kind, message[pos:]


MAX_REASON_CHARS = 500


def checked_reason(reason: object) -> str:
    """A full sync's reason as it is recorded and shown (``lr status``, one line per request): one
    line of text of at most ``MAX_REASON_CHARS``. Refused otherwise (before anything is asked): a
    newline made ``lr status`` print a line of its own that read like another site's, 100 kB one
    line of 100 kB; the CLI, the DAGs' forms and a failover's reason all come here."""
    if isinstance(reason, str) and len(reason) <= MAX_REASON_CHARS and not any(map(is_control, reason)):
        return reason
    shown = (
        f"{reason[:40]!r}... ({len(reason)} characters)"
        if isinstance(reason, str) and len(reason) > 40
        else repr(reason)
    )
    raise ConfigurationError(
        f"a full sync's reason is one line of text of at most {MAX_REASON_CHARS} characters "
        f"(no newline or other control character), not {shown}"
    )


def flattened_reason(reason: str) -> str:
    """A reason lr composes around another (a failover's, from an earlier request's): not refused
    mid-way, but kept on one line, and short. Text only (``request_full_sync(..., reason=None)``
    failed with "'NoneType' object is not iterable")."""
    if not isinstance(reason, str):
        raise ConfigurationError(f"a full sync's reason is one line of text, not {shown(reason)}")
    reason = " ".join("".join(" " if is_control(c) else c for c in reason).split())
    return reason if len(reason) <= 2 * MAX_REASON_CHARS else reason[: 2 * MAX_REASON_CHARS - 3] + "..."
