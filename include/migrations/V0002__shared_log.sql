-- lr schema v2: the source side. Remote sites known from the topology, the shared log with
-- per-destination stream tags, and commit positions that order transactions by commit.

-- Sites this site may address. tag_id is the compact form of the stream tags
-- lrq_logentry_<site_id> / lrq_snapsync_<site_id> stored on every log entry.
CREATE TABLE lr.remote_sites (
    site_id  text PRIMARY KEY CHECK (site_id ~ '^[a-z0-9][a-z0-9_-]{0,62}$'),
    tag_id   integer GENERATED ALWAYS AS IDENTITY UNIQUE,
    region   text NOT NULL DEFAULT 'default',
    added_at timestamptz NOT NULL DEFAULT now()
);

-- The topology this site was last configured with (negotiation compares the id).
CREATE TABLE lr.topology (
    singleton          boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    topology_config_id text NOT NULL,
    document           jsonb NOT NULL,
    applied_at         timestamptz NOT NULL DEFAULT now()
);

CREATE SEQUENCE lr.log_entry_id_seq;
CREATE SEQUENCE lr.commit_position_seq;

-- The shared log. One row per transmitted message whatever the number of destinations (stream
-- 1 = LRQ_Send_LogEntries, 2 = LRQ_Send_SnapSync); message is a serialized RoutingTableEntryMsg.
CREATE TABLE lr.log_entries (
    tx       xid8 NOT NULL DEFAULT pg_current_xact_id(),
    entry_id bigint NOT NULL DEFAULT nextval('lr.log_entry_id_seq'),
    stream   smallint NOT NULL CHECK (stream IN (1, 2)),
    tag_ids  integer[] NOT NULL,
    message  bytea NOT NULL,
    PRIMARY KEY (tx, entry_id)
);

-- One row per committed transaction that wrote to the log: its commit position. Positions are
-- drawn at commit time, so two transactions that touch the same application row get positions
-- in their commit order (sequence ids and xids are handed out before commit and are not).
CREATE TABLE lr.log_commits (
    position     bigint PRIMARY KEY,
    tx           xid8 NOT NULL,
    committed_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- Runs once per transaction, at commit (deferred). The shared advisory lock is held until the
-- transaction has ended, so a reader that notes the sequence's last value and then waits for the
-- current holders knows every position up to that value is final (committed or rolled back).
-- Shared locks never conflict with each other: writers are not serialized.
CREATE FUNCTION lr.assign_commit_position() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('lr.commit_position_assigned', true) IS DISTINCT FROM 'on' THEN
        PERFORM set_config('lr.commit_position_assigned', 'on', true);
        PERFORM pg_advisory_xact_lock_shared(1819410434);  -- lr.engine.log.COMMIT_LOCK_KEY
        INSERT INTO lr.log_commits (position, tx)
        VALUES (nextval('lr.commit_position_seq'), pg_current_xact_id());
    END IF;
    RETURN NULL;
END
$$;

CREATE CONSTRAINT TRIGGER log_entries_commit_position
    AFTER INSERT ON lr.log_entries
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION lr.assign_commit_position();

-- Per destination: the last commit position that carried an entry for it (seed 000's "last
-- transmitted id"), maintained incrementally by the reader side, never by transmit (a per-destination
-- row updated by every writer would serialize application transactions).
CREATE TABLE lr.destination_log_state (
    site_id                 text PRIMARY KEY REFERENCES lr.remote_sites (site_id) ON DELETE CASCADE,
    last_transmitted_position bigint NOT NULL DEFAULT 0,
    last_transmitted_entry  bigint NOT NULL DEFAULT 0
);
CREATE TABLE lr.log_scan_state (
    singleton     boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    scanned_up_to bigint NOT NULL DEFAULT 0
);
INSERT INTO lr.log_scan_state DEFAULT VALUES;

-- The shared log as people read it: stream and tag names spelled out.
CREATE VIEW lr.shared_log AS
SELECT c.position,
       e.entry_id,
       e.tx,
       CASE e.stream WHEN 1 THEN 'LRQ_Send_LogEntries' ELSE 'LRQ_Send_SnapSync' END AS stream,
       ARRAY(SELECT CASE e.stream WHEN 1 THEN 'lrq_logentry_' ELSE 'lrq_snapsync_' END || r.site_id
             FROM lr.remote_sites r WHERE r.tag_id = ANY (e.tag_ids) ORDER BY r.site_id) AS stream_tags,
       length(e.message) AS message_bytes,
       c.committed_at
FROM lr.log_entries e
LEFT JOIN lr.log_commits c ON c.tx = e.tx;
