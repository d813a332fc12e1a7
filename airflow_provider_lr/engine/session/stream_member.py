"""A session as its source's stream holds it (``Member``), why it left the stream (``StreamEnd``), and
the Streamer's requests that it join or leave (``Requests``)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from airflow_provider_lr.engine.session import lease as leases
from airflow_provider_lr.engine.session.handshake import Position
from airflow_provider_lr.engine.source.log_reader import LogReader, TableSplits
from airflow_provider_lr.engine.source.routed_read import Reader
from airflow_provider_lr.engine.vocabulary import SessionKey

STOPPED = "stopped"  # a StreamEnd's reason when its run stopped it (not a hand-back)
REASSIGNED = "reassigned"  # ... when the session left this replicator's share (another one works it now)


@dataclass
class StreamEnd:
    """Why a session left its stream, and what the stream delivered to it."""

    session: str
    reason: str  # why it handed back, STOPPED or REASSIGNED
    delivered: int = 0
    error: str = ""
    fenced: bool = False  # refused by a newer lease holder's fence (``FencedError``)

    @property
    def handed_back(self) -> bool:
        """Ended by the session's state (a hand-back to the cycles), not by its run stopping or the
        session moving to another replicator."""
        return self.reason not in (STOPPED, REASSIGNED)


@dataclass
class Member:
    """One session of a source's stream."""

    key: SessionKey
    lease: leases.Lease
    position: Position  # the handshake's, advanced by every write
    reader: LogReader  # the general read, for a transaction too large for the routed read
    tables: TableSplits  # the synced federated tables, whose changes come along
    topology_id: str | None  # the topology applied when it joined
    read_to: int = -1  # every position up to here was read for it (>= its sink's position)
    durable: int = -1  # its sink's WAL flush has passed the commit of this position (-1: not known yet)
    acked: int = -1
    delivered: int = 0
    registered: bool = False  # its receive queue, by its first write of entries
    ended: bool = field(default=False, repr=False)

    @property
    def after(self) -> int:
        """The sink's position: committed there (perhaps not flushed yet: see ``durable``)."""
        return self.position.after

    def routed(self) -> Reader:
        split = (
            self.position.split if self.position.split is not None and self.position.split.upto > self.read_to else None
        )
        assert self.reader.client_id is not None
        return Reader(self.reader.client_id, self.reader.tag_id, self.read_to, split, self.tables)


Request = tuple[str, SessionKey, "leases.Lease | None"]  # ("join", key, its cycle's lease) or ("leave", key, None)


class Requests:
    """The Streamer's joins and leaves of a stream, put from any thread, taken in order on the
    stream's: a join to a sink site whose write is in flight is held, with its session's later
    requests (a leave after it stays after it), until that write lands (its handshake would wait
    for the write on the stream's thread, and the source's other sinks behind it: a silent sink, a
    row lock, up to the sink deadline); the other sessions' requests are answered meanwhile."""

    def __init__(self) -> None:
        self._put: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._held: list[Request] = []
        self.wake = threading.Event()  # set by every request

    def put(self, what: str, key: SessionKey, lease: leases.Lease | None = None) -> None:
        self._put.put((what, key, lease))
        self.wake.set()

    def take(self, busy: Callable[[], set[str]], final: bool = False) -> Iterator[Request]:
        """The requests to answer now, in order (``busy``: the sink sites whose write is in
        flight); ``final``: every one, held or not (the stream ends)."""
        while not self._put.empty():
            self._held.append(self._put.get())
        if not self._held:  # (every turn of the stream's loop: nothing asked, nothing computed)
            return
        busy_now, blocked = busy(), set()  # blocked: keys with a request held (their order kept)
        ready: list[Request] = []
        kept: list[Request] = []
        for request in self._held:
            what, key, _ = request
            if not final and (key in blocked or (what == "join" and key.sink in busy_now)):
                blocked.add(key)
                kept.append(request)
            else:
                ready.append(request)
        self._held = kept
        yield from ready
