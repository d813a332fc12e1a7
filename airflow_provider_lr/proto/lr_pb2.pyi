from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReplicationType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NONE: _ClassVar[ReplicationType]
    LOG_ENTRY_SYNC: _ClassVar[ReplicationType]
    SNAPSHOT_SYNC: _ClassVar[ReplicationType]
    LAST_FULL_SYNC_ENTRY: _ClassVar[ReplicationType]
    SNAPSHOT_SYNC_START: _ClassVar[ReplicationType]

class ReplicationModel(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROUTING_QUEUES: _ClassVar[ReplicationModel]
    FULL_TABLE: _ClassVar[ReplicationModel]

class SyncType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SYNC_TYPE_UNSPECIFIED: _ClassVar[SyncType]
    SNAPSHOT: _ClassVar[SyncType]
    LOG_ENTRY: _ClassVar[SyncType]

class SyncStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NOT_STARTED: _ClassVar[SyncStatus]
    ONGOING: _ClassVar[SyncStatus]
    COMPLETED: _ClassVar[SyncStatus]
    STOPPED: _ClassVar[SyncStatus]
    ERROR: _ClassVar[SyncStatus]
    NOT_AVAILABLE: _ClassVar[SyncStatus]
NONE: ReplicationType
LOG_ENTRY_SYNC: ReplicationType
SNAPSHOT_SYNC: ReplicationType
LAST_FULL_SYNC_ENTRY: ReplicationType
SNAPSHOT_SYNC_START: ReplicationType
ROUTING_QUEUES: ReplicationModel
FULL_TABLE: ReplicationModel
SYNC_TYPE_UNSPECIFIED: SyncType
SNAPSHOT: SyncType
LOG_ENTRY: SyncType
NOT_STARTED: SyncStatus
ONGOING: SyncStatus
COMPLETED: SyncStatus
STOPPED: SyncStatus
ERROR: SyncStatus
NOT_AVAILABLE: SyncStatus

class RoutingTableEntryMsg(_message.Message):
    __slots__ = ("destinations", "type", "opaque_payload", "source_site_id", "client_name", "snapshot_request_id", "base_snapshot", "base_snapshot_xids", "base_snapshot_upto")
    DESTINATIONS_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    OPAQUE_PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    SOURCE_SITE_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    BASE_SNAPSHOT_XIDS_FIELD_NUMBER: _ClassVar[int]
    BASE_SNAPSHOT_UPTO_FIELD_NUMBER: _ClassVar[int]
    destinations: _containers.RepeatedScalarFieldContainer[str]
    type: ReplicationType
    opaque_payload: bytes
    source_site_id: str
    client_name: str
    snapshot_request_id: str
    base_snapshot: int
    base_snapshot_xids: str
    base_snapshot_upto: int
    def __init__(self, destinations: _Optional[_Iterable[str]] = ..., type: _Optional[_Union[ReplicationType, str]] = ..., opaque_payload: _Optional[bytes] = ..., source_site_id: _Optional[str] = ..., client_name: _Optional[str] = ..., snapshot_request_id: _Optional[str] = ..., base_snapshot: _Optional[int] = ..., base_snapshot_xids: _Optional[str] = ..., base_snapshot_upto: _Optional[int] = ...) -> None: ...

class ReceiveQueueBatch(_message.Message):
    __slots__ = ("entries", "run_positions", "run_counts")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    RUN_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    RUN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedScalarFieldContainer[bytes]
    run_positions: _containers.RepeatedScalarFieldContainer[int]
    run_counts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, entries: _Optional[_Iterable[bytes]] = ..., run_positions: _Optional[_Iterable[int]] = ..., run_counts: _Optional[_Iterable[int]] = ...) -> None: ...

class ReplicationSession(_message.Message):
    __slots__ = ("source_site_id", "sink_site_id", "model", "client_name")
    SOURCE_SITE_ID_FIELD_NUMBER: _ClassVar[int]
    SINK_SITE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    source_site_id: str
    sink_site_id: str
    model: ReplicationModel
    client_name: str
    def __init__(self, source_site_id: _Optional[str] = ..., sink_site_id: _Optional[str] = ..., model: _Optional[_Union[ReplicationModel, str]] = ..., client_name: _Optional[str] = ...) -> None: ...

class ReplicationStatus(_message.Message):
    __slots__ = ("session", "sync_type", "status", "base_snapshot", "last_applied_position", "remaining_entries_to_send", "data_consistent", "topology_config_id")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    SYNC_TYPE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    BASE_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    LAST_APPLIED_POSITION_FIELD_NUMBER: _ClassVar[int]
    REMAINING_ENTRIES_TO_SEND_FIELD_NUMBER: _ClassVar[int]
    DATA_CONSISTENT_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_CONFIG_ID_FIELD_NUMBER: _ClassVar[int]
    session: ReplicationSession
    sync_type: SyncType
    status: SyncStatus
    base_snapshot: int
    last_applied_position: int
    remaining_entries_to_send: int
    data_consistent: bool
    topology_config_id: str
    def __init__(self, session: _Optional[_Union[ReplicationSession, _Mapping]] = ..., sync_type: _Optional[_Union[SyncType, str]] = ..., status: _Optional[_Union[SyncStatus, str]] = ..., base_snapshot: _Optional[int] = ..., last_applied_position: _Optional[int] = ..., remaining_entries_to_send: _Optional[int] = ..., data_consistent: _Optional[bool] = ..., topology_config_id: _Optional[str] = ...) -> None: ...
