"""Deferrable sensors for lr: new log entries, a full sync's end marker, a full sync applied,
delivery of an entry, a destination ready."""

from airflow_provider_lr.sensors.session import (
    LRDeliveredSensor,
    LRFullSyncAppliedSensor,
    LRNewLogEntriesSensor,
    LRReadySensor,
    LRSnapshotEndSensor,
)

__all__ = [
    "LRDeliveredSensor",
    "LRFullSyncAppliedSensor",
    "LRNewLogEntriesSensor",
    "LRReadySensor",
    "LRSnapshotEndSensor",
]
