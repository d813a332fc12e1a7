-- lr schema v4: staging on a sink for the Spark jobs (spark_jobs/lr_fanout.py, lr_snapshot_transfer.py).
--
-- Spark partitions write their share of a range here in parallel, each partition's range replaced
-- in one transaction (delete, then binary COPY, then its range record), so a task retry, a
-- speculative duplicate or a rerun of the whole job writes nothing twice. Then one fenced sink
-- transaction per session checks that the range records cover the whole range, moves the rows
-- into lr.receive_queue in source order (seq follows it) together with the session's metadata,
-- and deletes them here. Nothing in these tables is visible to subscribers.
--
-- UNLOGGED on purpose: the rows are written twice on the sink (here, then into the receive
-- queue), and only the second write must survive a crash. A sink server crash empties both
-- tables together, so the commit finds the range records missing and refuses; the job is rerun.

CREATE UNLOGGED TABLE lr.spark_staging (
    source_site_id  text COLLATE "C" NOT NULL,
    client_name     text COLLATE "C" NOT NULL,
    sync_id         uuid,                -- snapshot transfer: the full sync; NULL for log entries
    source_position bigint NOT NULL,
    source_entry_id bigint NOT NULL,
    kind            smallint NOT NULL,   -- lr.ReplicationType
    message         bytea NOT NULL,      -- RoutingTableEntryMsg, destinations stripped
    -- integers first: cheap comparisons while partitions COPY in, ranges scanned in source order
    PRIMARY KEY (source_position, source_entry_id, source_site_id, client_name)
);

-- One row per (session, job plan, partition range) that is completely staged. Ranges are commit
-- positions (lo, hi] for log entries, source entry ids (lo, hi] for snapshot data.
CREATE UNLOGGED TABLE lr.spark_staged_ranges (
    source_site_id text NOT NULL,
    client_name    text NOT NULL,
    plan_id        uuid NOT NULL,
    range_lo       bigint NOT NULL,
    range_hi       bigint NOT NULL CHECK (range_hi > range_lo),
    staged_rows    bigint NOT NULL,
    staged_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (source_site_id, client_name, plan_id, range_lo)
);
