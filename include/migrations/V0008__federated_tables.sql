-- lr schema v8: federated tables (seed 002). A table opened as federated for a client is captured
-- into the shared log by lr itself, in the writer's transaction, and applied at the client's sinks.

-- Stream 3 (LRQ_Send_TableChanges): changes of federated tables. One entry holds up to a few
-- hundred rows of one statement: {"op": "u" | "d" | "t", "rows": [...]}; table_id says which table
-- (and which federation of it: re-opening a table as federated draws a new id).
ALTER TABLE lr.log_entries DROP CONSTRAINT log_entries_stream_check;
ALTER TABLE lr.log_entries ADD CONSTRAINT log_entries_stream_check CHECK (stream IN (1, 2, 3));
ALTER TABLE lr.log_entries ADD COLUMN table_id integer;

-- The registry records tables (kind 'table', stream_name 'schema.table'): on a source, table_id and
-- key_columns of its current federation; on a sink, source_site_id is the source that registered it.
CREATE SEQUENCE lr.table_id_seq;
ALTER TABLE lr.registry ADD COLUMN table_id integer UNIQUE, ADD COLUMN key_columns text[];

-- Capture: one statement-level trigger per operation on each federated table (created by
-- engine/tables/registry.py with arguments client name, table id). Rows travel as to_jsonb()
-- images, chunked by CHUNK rows per entry; an UPDATE sends the deleted keys (old keys no new row
-- has: a primary-key change) before the new rows. Writers of the table need no privilege on lr:
-- the function runs as the schema owner. lr's own sink applies set lr.applying so that what it
-- applies is not captured again.
CREATE FUNCTION lr.capture_table_changes() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    client   text := TG_ARGV[0];
    tid      integer := TG_ARGV[1]::integer;
    cid      integer;
    tags     integer[];
    keys     text[];
    nonkey   text[];
    gen      text[];  -- generated columns: each site computes its own, rows do not carry them
BEGIN
    IF current_setting('lr.applying', true) = 'on' THEN
        RETURN NULL;
    END IF;
    SELECT c.client_id, array_agg(r.tag_id ORDER BY r.tag_id) INTO cid, tags
    FROM lr.clients c
    JOIN lr.source_sessions s ON s.client_name = c.client_name
    JOIN lr.remote_sites r ON r.site_id = s.sink_site_id
    WHERE c.client_name = client
    GROUP BY c.client_id;
    IF tags IS NULL THEN
        RETURN NULL;  -- the client has no sink: nothing to carry
    END IF;
    IF TG_OP = 'TRUNCATE' THEN
        INSERT INTO lr.log_entries (stream, tag_ids, client_id, table_id, message)
        VALUES (3, tags, cid, tid, convert_to('{"op": "t"}', 'UTF8'));
        RETURN NULL;
    END IF;
    SELECT g.key_columns INTO keys FROM lr.registry g WHERE g.table_id = tid;
    SELECT coalesce(array_agg(a.attname::text) FILTER (WHERE a.attname::text <> ALL (keys)), '{}'),
           coalesce(array_agg(a.attname::text) FILTER (WHERE a.attgenerated <> ''), '{}')
    INTO nonkey, gen FROM pg_attribute a
    WHERE a.attrelid = TG_RELID AND a.attnum > 0 AND NOT a.attisdropped;
    IF TG_OP = 'UPDATE' THEN
        INSERT INTO lr.log_entries (stream, tag_ids, client_id, table_id, message)
        SELECT 3, tags, cid, tid, convert_to(jsonb_build_object('op', 'd', 'rows', jsonb_agg(k))::text, 'UTF8')
        FROM (SELECT k, (row_number() OVER () - 1) / 500 AS chunk
              FROM (SELECT to_jsonb(o) - nonkey AS k FROM lr_old o
                    EXCEPT SELECT to_jsonb(n) - nonkey FROM lr_new n) gone) c
        GROUP BY chunk;
    END IF;
    IF TG_OP = 'DELETE' THEN
        INSERT INTO lr.log_entries (stream, tag_ids, client_id, table_id, message)
        SELECT 3, tags, cid, tid, convert_to(jsonb_build_object('op', 'd', 'rows', jsonb_agg(k))::text, 'UTF8')
        FROM (SELECT to_jsonb(o) - nonkey AS k, (row_number() OVER () - 1) / 500 AS chunk FROM lr_old o) c
        GROUP BY chunk;
    ELSE
        INSERT INTO lr.log_entries (stream, tag_ids, client_id, table_id, message)
        SELECT 3, tags, cid, tid, convert_to(jsonb_build_object('op', 'u', 'rows', jsonb_agg(r))::text, 'UTF8')
        FROM (SELECT CASE WHEN gen = '{}' THEN to_jsonb(n) ELSE to_jsonb(n) - gen END AS r,
                     (row_number() OVER () - 1) / 500 AS chunk FROM lr_new n) c
        GROUP BY chunk;
    END IF;
    RETURN NULL;
END
$$;

-- Sink side: each session's tables. state: 'syncing' (a snapshot is being written), 'synced' (log
-- entries apply, less what the split covered), 'conflict' (the sink opened the table with
-- is_federated = false: its data is dropped here), 'refused' (schema mismatch: the session stops).
CREATE TABLE lr.sink_tables (
    source_site_id  text NOT NULL,
    client_name     text NOT NULL,
    table_name      text NOT NULL,
    source_table_id integer NOT NULL,
    state           text NOT NULL CHECK (state IN ('syncing', 'synced', 'conflict', 'refused')),
    run_id          uuid,            -- the snapshot being written (its ranges are recorded under it)
    split_snapshot  text,            -- the snapshot's pg_snapshot and the positions drawn by then:
    split_upto      bigint,          -- entries <= upto visible in it are in the snapshot already
    synced_at_position bigint,       -- the session's position when the snapshot was taken
    rows_copied     bigint,
    detail          text,
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (source_site_id, client_name, table_name)
);

-- Key ranges of a snapshot already written (a retried Spark task skips them: no duplicate).
CREATE TABLE lr.sink_table_ranges (
    run_id     uuid NOT NULL,
    table_name text NOT NULL,
    range_no   integer NOT NULL,
    rows_copied bigint NOT NULL,
    PRIMARY KEY (run_id, table_name, range_no)
);

-- Several sources into one sink table: rows not listed here belong to the table's primary origin
-- (the source that registered it here first, or the sink itself when it opened the table); a row
-- last written by another source is listed with it, so that source's snapshot or TRUNCATE clears
-- only its own rows (CorfuDB #3502). Keys are jsonb objects of the key columns, formed at the sink.
CREATE TABLE lr.table_row_origin (
    table_name     text NOT NULL,
    key            jsonb NOT NULL,
    source_site_id text NOT NULL,
    PRIMARY KEY (table_name, key)
);
CREATE INDEX table_row_origin_source ON lr.table_row_origin (table_name, source_site_id);

CREATE OR REPLACE VIEW lr.shared_log AS
SELECT c.position,
       e.entry_id,
       e.tx,
       CASE e.stream WHEN 1 THEN 'LRQ_Send_LogEntries' WHEN 2 THEN 'LRQ_Send_SnapSync'
                     ELSE 'LRQ_Send_TableChanges' END AS stream,
       ARRAY(SELECT CASE e.stream WHEN 2 THEN 'lrq_snapsync_' ELSE 'lrq_logentry_' END || r.site_id
             FROM lr.remote_sites r WHERE r.tag_id = ANY (e.tag_ids) ORDER BY r.site_id) AS stream_tags,
       length(e.message) AS message_bytes,
       c.committed_at
FROM lr.log_entries e
LEFT JOIN lr.log_commits c ON c.tx = e.tx;
