"""Airflow operators for lr: each step of a session's state machine as one task."""
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
    LRSnapshotSyncOperator,
)

__all__ = [
    "LRDiscoverSessionsOperator",
    "LRLogEntrySyncOperator",
    "LRNegotiateOperator",
    "LRReceiveQueueReportOperator",
    "LRRunCheckOperator",
    "LRSnapshotSyncOperator",
    "LRStaleLeaseCleanupOperator",
    "LRTrimOperator",
]
