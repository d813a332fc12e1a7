"""A session as its source's stream holds it (``Member``), and why it left the stream (``StreamEnd``)."""

from __future__ import annotations

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
