"""Deferrable sensors for lr: new log entries, a full sync's end marker, delivery of an entry."""
from airflow_provider_lr.sensors.session import LRDeliveredSensor, LRNewLogEntriesSensor, LRSnapshotEndSensor

__all__ = ["LRDeliveredSensor", "LRNewLogEntriesSensor", "LRSnapshotEndSensor"]
