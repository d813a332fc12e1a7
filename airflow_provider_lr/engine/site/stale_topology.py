"""A replication run whose topology went stale: refused at its start, stopped once it stays so.

``lr sync`` and the ``lr_streaming`` DAG's shards run for long; a failover (or an apply of another
file) makes the topology they read stale, and every session is then refused, cycle after cycle.
``sync_check`` is the start's check; ``StaleWatch`` runs it again on a refused cycle (at most every
``STALE_CHECK_EVERY``) on the topology the run works (``repl.topology``, which follows its file once
some site runs it): when no reachable site has run it, nor its file as it is now, for ``STALE_FOR``
in a row (a session past the handshake's check ends the spell), the run is stopped with the error
its start would have raised (``error``); when only some sites run another (a site a failover
could not reach), that is said once and the other sessions go on.

Two false alarms it once raised: it checked the file as it is now alone, so while an operator's
edit waited for ``lr topology apply`` a session refused for another reason stopped the run; and it
stopped at the first stale check, so a switchover whose ``--out`` was the file being followed
stopped the run in the moment between the sites taking the new topology and the file written.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

import psycopg2.extensions

from airflow_provider_lr.engine.errors import LRError, TopologyMismatchError
from airflow_provider_lr.engine.session.runner import CycleReport
from airflow_provider_lr.engine.site import topology
from airflow_provider_lr.engine.store import topology as topologies

STALE_CHECK_EVERY = 1.0  # seconds: a running run's sites checked again at most this often (on a refusal)
STALE_FOR = 10.0  # seconds: a running run stops once its topology has stayed stale this long

Connector = Callable[[topologies.Topology], Callable[[str], psycopg2.extensions.connection]]


class Working(Protocol):
    @property
    def topology(self) -> topologies.Topology: ...


def sync_check(topo: topologies.Topology, connector: Connector) -> str | None:
    """Refuse (``TopologyMismatchError``) a run from a file no reachable site runs (a stale file, an
    edited one not applied). When only some sites run another topology (a site a failover could not
    reach, before ``lr failover --rejoin``), that is returned to be said once: the sessions on those
    sites are refused cycle by cycle (each one's error names the file), while the others replicate."""
    sites = {site for key in topo.sessions() for site in (key.source, key.sink)}
    recorded = topology.recorded_ids(topo, connector(topo), sites)
    stale = topology.explained(topologies.unheld(topo, recorded), connector(topo))
    if stale is not None:
        raise TopologyMismatchError(stale.message())
    behind = topology.explained(topologies.drift(topo, recorded), connector(topo))  # a failover's old source: rejoined
    return f"{behind.message()}; their sessions are refused" if behind is not None else None


class StaleWatch:
    """Watches a running replication's refused cycles (``seen``) for a stale topology (the module
    docstring); ``say`` is told what a check finds of sites behind the file, once."""

    def __init__(
        self,
        repl: Working,
        stop: threading.Event,
        said: str | None,
        connector: Connector,
        say: Callable[[str], None],
    ) -> None:
        """``said``: what the start said of sites behind the file (not said again)."""
        self.repl, self.stop, self.connector, self.say = repl, stop, connector, say
        self.error: TopologyMismatchError | None = None
        self._said = said
        self._checked = 0.0
        self._stale_since: float | None = None  # the first of the stale checks in a row (monotonic)

    def seen(self, reports: list[CycleReport]) -> None:
        if any(r.skipped or r.decision not in ("", "refuse") for r in reports):
            self._stale_since = None  # a session past the handshake's check: its source runs the topology
        refused = any(r.decision == "refuse" and not r.state for r in reports)  # before negotiation: the file
        if not refused or time.monotonic() - self._checked < STALE_CHECK_EVERY:
            return
        self._checked = time.monotonic()
        try:
            behind = self._check()
        except TopologyMismatchError as exc:
            self._stale_since = self._checked if self._stale_since is None else self._stale_since
            if self._checked - self._stale_since >= STALE_FOR:
                self.error = exc
                self.stop.set()
            return
        except LRError:  # a site that cannot be read now: the cycles report it
            return
        self._stale_since = None
        if behind is not None and behind != self._said:
            self.say(behind)
        self._said = behind

    def _check(self) -> str | None:
        """The start's check of the topology the run works; not stale when its file, as it is now,
        runs somewhere (applied a moment ago: the replicator follows it at its next turn)."""
        working = self.repl.topology
        try:
            return sync_check(working, self.connector)
        except TopologyMismatchError:
            now = topologies.reread(working)
            if now.topology_config_id != working.topology_config_id and topology.runs_somewhere(
                now, self.connector(now)
            ):
                return None
            raise
