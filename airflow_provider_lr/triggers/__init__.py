"""Triggers for lr's deferrable sensors and operators (shipped in the package: the triggerer
imports them by class path, never from the DAG bundle)."""

from airflow_provider_lr.triggers.session import (
    LRDeliveredTrigger,
    LRFullSyncOutcomeTrigger,
    LRNewLogEntriesTrigger,
    LRReadyTrigger,
    LRSnapshotEndTrigger,
)

__all__ = [
    "LRDeliveredTrigger",
    "LRFullSyncOutcomeTrigger",
    "LRNewLogEntriesTrigger",
    "LRReadyTrigger",
    "LRSnapshotEndTrigger",
]
