"""Airflow operators for lr: each step of a session's state machine as one task."""

from airflow_provider_lr.operators.failover import LRFailoverOperator
from airflow_provider_lr.operators.maintenance import (
    LRReceiveQueueReportOperator,
    LRStaleLeaseCleanupOperator,
    LRTrimOperator,
)
from airflow_provider_lr.operators.session import (
    LRDiscoverSessionsOperator,
    LRLogEntrySyncOperator,
    LRNegotiateOperator,
    LRRunCheckOperator,
)
from airflow_provider_lr.operators.snapshot_sync import LRSnapshotSyncOperator
from airflow_provider_lr.operators.stream import LRStreamOperator

__all__ = [
    "LRDiscoverSessionsOperator",
    "LRFailoverOperator",
    "LRLogEntrySyncOperator",
    "LRNegotiateOperator",
    "LRReceiveQueueReportOperator",
    "LRRunCheckOperator",
    "LRSnapshotSyncOperator",
    "LRStaleLeaseCleanupOperator",
    "LRStreamOperator",
    "LRTrimOperator",
]
