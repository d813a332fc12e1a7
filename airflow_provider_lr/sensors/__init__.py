"""Deferrable sensors for lr: new log entries, a full sync's end marker, delivery of an entry, a destination ready."""
from airflow_provider_lr.sensors.session import LRDeliveredSensor, LRNewLogEntriesSensor, LRReadySensor, LRSnapshotEndSensor

__all__ = ["LRDeliveredSensor", "LRNewLogEntriesSensor", "LRReadySensor", "LRSnapshotEndSensor"]
