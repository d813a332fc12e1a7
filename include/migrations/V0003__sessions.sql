-- lr schema v3: replication sessions. Source side: clients, the sessions this site is the source
-- of, full-sync requests, the trim mark. Sink side: session metadata, receive queues.
-- Every row a session needs to resume after a crash lives here (never only in Airflow or Spark).

-- Clients that transmit (from the topology). client_id is stored on every log entry so that a
-- session (source, sink, client) reads only its own client's entries.
CREATE TABLE lr.clients (
    client_id   integer GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    client_name text NOT NULL UNIQUE CHECK (client_name ~ '^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$')
);
ALTER TABLE lr.log_entries ADD COLUMN client_id integer NOT NULL DEFAULT 0;

-- Where the log is trimmed: every entry with a commit position <= trim_mark may be gone.
CREATE TABLE lr.log_trim (
    singleton  boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    trim_mark  bigint NOT NULL DEFAULT 0,
    trimmed_at timestamptz
);
INSERT INTO lr.log_trim DEFAULT VALUES;

-- Source side of a session (one per sink per client, derived from the topology). The lease
-- (owner, epoch, expiry) makes one replicator the writer; the epoch fences a stale one at the sink.
CREATE TABLE lr.source_sessions (
    sink_site_id      text NOT NULL REFERENCES lr.remote_sites (site_id) ON DELETE CASCADE,
    client_name       text NOT NULL REFERENCES lr.clients (client_name) ON DELETE CASCADE,
    state             text NOT NULL DEFAULT 'INITIALIZED' CHECK (state IN (
                          'INITIALIZED', 'NEGOTIATING', 'IN_SNAPSHOT_SYNC', 'WAIT_SNAPSHOT_APPLY',
                          'IN_LOG_ENTRY_SYNC', 'STOPPED', 'ERROR')),
    sync_id           uuid,                          -- current full-sync request, if any
    base_position     bigint NOT NULL DEFAULT -1,    -- base of the last snapshot sync
    acked_position    bigint NOT NULL DEFAULT -1,    -- what the sink reported processed
    remaining_entries bigint NOT NULL DEFAULT 0,
    lease_owner       text,
    lease_epoch       bigint NOT NULL DEFAULT 0,
    lease_expires_at  timestamptz,
    attempts          integer NOT NULL DEFAULT 0,    -- consecutive full-sync data timeouts
    last_error        text,
    updated_at        timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (sink_site_id, client_name)
);

-- Full-sync requests (CorfuDB's LogReplicationEventTable). The server writes 'pending'; the
-- client's provider supplies the data in one transaction that also records the base snapshot
-- and the split of the log ('supplied'); the session transfers and applies it.
CREATE TABLE lr.full_sync_requests (
    request_id     uuid PRIMARY KEY,
    sink_site_id   text NOT NULL REFERENCES lr.remote_sites (site_id) ON DELETE CASCADE,
    client_name    text NOT NULL,
    forced         boolean NOT NULL DEFAULT false,
    reason         text NOT NULL DEFAULT '',
    status         text NOT NULL DEFAULT 'pending' CHECK (status IN (
                       'pending', 'supplied', 'applied', 'cancelled', 'timed_out')),
    requested_at   timestamptz NOT NULL DEFAULT now(),
    data_deadline  timestamptz NOT NULL,
    supplied_at    timestamptz,
    supplied_tx    xid8,                 -- the provider's transaction: markers and data
    base_position  bigint,               -- commit barrier noted before the provider's snapshot
    base_snapshot  text,                 -- pg_snapshot of the provider's transaction
    base_upto      bigint,               -- commit positions drawn when that snapshot was taken
    entries        integer,
    finished_at    timestamptz,
    note           text
);
CREATE INDEX full_sync_requests_open ON lr.full_sync_requests (sink_site_id, client_name)
    WHERE status IN ('pending', 'supplied');
CREATE INDEX log_commits_tx ON lr.log_commits (tx);

-- Sink side of a session (CorfuDB's ReplicationMetadata): all positions are source commit
-- positions, -1 until set. lease_epoch is the highest epoch seen: older writers are refused.
CREATE TABLE lr.sink_sessions (
    source_site_id           text NOT NULL,
    client_name              text NOT NULL,
    topology_config_id       text,
    snapshot_request_id      uuid,
    snapshot_started         bigint NOT NULL DEFAULT -1,
    snapshot_transferred     bigint NOT NULL DEFAULT -1,
    snapshot_applied         bigint NOT NULL DEFAULT -1,
    snapshot_transferred_seq bigint NOT NULL DEFAULT -1,  -- messages received of the current snapshot
    snapshot_last_entry      bigint NOT NULL DEFAULT -1,  -- source entry id they end at (resume point)
    base_snapshot            text,                        -- split of the log at the base (see full_sync_requests)
    base_upto                bigint,
    last_log_entry_processed bigint NOT NULL DEFAULT -1,
    data_consistent          boolean NOT NULL DEFAULT false,
    lease_epoch              bigint NOT NULL DEFAULT 0,
    snapshot_completed_at    timestamptz,
    updated_at               timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (source_site_id, client_name)
);

-- Receive queues LRQ_Recv_<client>_<source>, one table for all: seq is the sink-side order (full
-- sync data stays ahead of the deltas that follow it). Rows of a snapshot being transferred are
-- invisible until its apply flips them in one transaction; subscribers read visible rows only.
CREATE TABLE lr.receive_queue (
    seq              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    source_site_id   text NOT NULL,
    client_name      text NOT NULL,
    kind             smallint NOT NULL,  -- lr.ReplicationType
    source_position  bigint NOT NULL,
    source_entry_id  bigint NOT NULL,
    sync_id          uuid,               -- snapshot rows: the full sync they belong to
    visible          boolean NOT NULL,
    message          bytea NOT NULL,     -- RoutingTableEntryMsg, destinations stripped
    received_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX receive_queue_delivery ON lr.receive_queue (client_name, source_site_id, seq) WHERE visible;
CREATE INDEX receive_queue_pending ON lr.receive_queue (source_site_id, client_name, sync_id) WHERE NOT visible;

-- Entries a subscriber could not decode, moved aside with the error so delivery goes on.
CREATE TABLE lr.receive_dead_letters (
    seq             bigint PRIMARY KEY,
    source_site_id  text NOT NULL,
    client_name     text NOT NULL,
    kind            smallint NOT NULL,
    message         bytea NOT NULL,
    error           text NOT NULL,
    moved_at        timestamptz NOT NULL DEFAULT now()
);

ALTER TABLE lr.registry ADD COLUMN source_site_id text, ADD COLUMN client_name text;

-- ReplicationStatus on both ends: a site is the source of some sessions and the sink of others.
CREATE VIEW lr.replication_status AS
SELECT 'source'::text AS role,
       (SELECT site_id FROM lr.site_info) AS source_site_id,
       s.sink_site_id,
       s.client_name,
       CASE WHEN s.state IN ('IN_SNAPSHOT_SYNC', 'WAIT_SNAPSHOT_APPLY') THEN 'SNAPSHOT'
            WHEN s.state = 'IN_LOG_ENTRY_SYNC' THEN 'LOG_ENTRY' END AS sync_type,
       CASE WHEN s.state = 'INITIALIZED' THEN 'NOT_STARTED'
            WHEN s.state = 'STOPPED' THEN 'STOPPED'
            WHEN s.state = 'ERROR' OR s.last_error IS NOT NULL THEN 'ERROR'
            ELSE 'ONGOING' END AS status,
       s.base_position AS base_snapshot,
       s.acked_position AS last_applied_position,
       s.remaining_entries AS remaining_entries_to_send,
       NULL::boolean AS data_consistent,
       s.state,
       s.last_error,
       s.updated_at
FROM lr.source_sessions s
UNION ALL
SELECT 'sink',
       k.source_site_id,
       (SELECT site_id FROM lr.site_info),
       k.client_name,
       CASE WHEN k.snapshot_started >= 0 AND (k.snapshot_applied < k.snapshot_started OR k.snapshot_applied = -1)
            THEN 'SNAPSHOT' WHEN k.data_consistent THEN 'LOG_ENTRY' END,
       CASE WHEN k.snapshot_started = -1 THEN 'NOT_STARTED' ELSE 'ONGOING' END,
       k.snapshot_applied,
       k.last_log_entry_processed,
       NULL::bigint,
       k.data_consistent,
       NULL::text,
       NULL::text,
       k.updated_at
FROM lr.sink_sessions k;
