"""Negotiation: what a session does next, decided from both ends' metadata and the source trim mark.

A pure function (no I/O), so every rule has a table-driven test. The rules follow CorfuDB LR's
``NegotiatingState`` (reference/corfu_lr.md A3), with positions being source commit positions:

* topology config ids differ (or a site has none)          → REFUSE (retry later, send nothing)
* a forced full sync is requested                           → SNAPSHOT_SYNC
* the sink never started a snapshot (``started == -1``)      → SNAPSHOT_SYNC
* the transfer was interrupted (``started > transferred``)  → SNAPSHOT_SYNC (resumes the same data)
* transferred but not applied (``started == transferred > applied``) → WAIT_SNAPSHOT_APPLY: apply,
  never re-transfer
* consistent, ``last >= started`` and the log still holds everything after ``last``
  (``trim_mark <= last``)                                   → LOG_ENTRY_SYNC from ``last``
* anything else (notably a trim past the sink's position)    → SNAPSHOT_SYNC
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Decision(enum.Enum):
    REFUSE = "refuse"
    SNAPSHOT_SYNC = "snapshot_sync"
    WAIT_SNAPSHOT_APPLY = "wait_snapshot_apply"
    LOG_ENTRY_SYNC = "log_entry_sync"


@dataclass(frozen=True)
class SourceView:
    topology_config_id: str | None
    trim_mark: int = 0
    forced_full_sync: bool = False


@dataclass(frozen=True)
class SinkView:
    topology_config_id: str | None
    snapshot_started: int = -1
    snapshot_transferred: int = -1
    snapshot_applied: int = -1
    last_log_entry_processed: int = -1
    data_consistent: bool = False


@dataclass(frozen=True)
class Negotiation:
    decision: Decision
    reason: str
    resume_from: int = -1  # LOG_ENTRY_SYNC: the position the sink has processed up to


MISMATCH = "topology config id mismatch"  # a refusal's words (``handshake`` names a rejoin instead of its advice)
APPLY_BOTH = " (apply the same topology on both sites)"


def negotiate(source: SourceView, sink: SinkView) -> Negotiation:
    if source.topology_config_id is None or sink.topology_config_id is None:
        missing = "source" if source.topology_config_id is None else "sink"
        return Negotiation(Decision.REFUSE, f"no topology applied on the {missing} (run `lr topology apply`)")
    if source.topology_config_id != sink.topology_config_id:
        return Negotiation(
            Decision.REFUSE,
            f"{MISMATCH}: source {source.topology_config_id}, sink {sink.topology_config_id}{APPLY_BOTH}",
        )
    if source.forced_full_sync:
        return Negotiation(Decision.SNAPSHOT_SYNC, "a full sync was requested")
    started, transferred, applied = sink.snapshot_started, sink.snapshot_transferred, sink.snapshot_applied
    if started == -1:
        return Negotiation(Decision.SNAPSHOT_SYNC, "first contact: the sink has no snapshot")
    if started > transferred or transferred == -1:
        return Negotiation(Decision.SNAPSHOT_SYNC, "snapshot transfer was interrupted")
    if started == transferred and (applied == -1 or applied < transferred):
        return Negotiation(Decision.WAIT_SNAPSHOT_APPLY, "snapshot transferred but not applied")
    last = sink.last_log_entry_processed
    if started == transferred == applied and sink.data_consistent and last >= started:
        if source.trim_mark <= last:
            return Negotiation(Decision.LOG_ENTRY_SYNC, f"continue after position {last}", resume_from=last)
        return Negotiation(
            Decision.SNAPSHOT_SYNC, f"the log was trimmed to {source.trim_mark}, past the sink's position {last}"
        )
    return Negotiation(Decision.SNAPSHOT_SYNC, "sink metadata is not consistent")
