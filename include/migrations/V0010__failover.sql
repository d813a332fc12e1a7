-- lr schema v10: failover (role switch) of a source's clients to one of its sinks (docs/failover.md).

-- On the promoted site: one record per failover, written in the transaction that promotes it, so
-- a re-run of `lr failover` resumes from what is recorded here (the positions and the base never
-- move once recorded).
CREATE TABLE lr.failovers (
    failover_id        uuid PRIMARY KEY,
    from_site_id       text NOT NULL,              -- the old source
    to_site_id         text NOT NULL,              -- this site, the new source
    clients            text[] NOT NULL,
    positions          jsonb NOT NULL,             -- client -> the old source's position this site held
    base_position      bigint NOT NULL,            -- this site's commit position its new sessions start after
    topology_config_id text NOT NULL,
    topology           jsonb NOT NULL,             -- the topology the failover applies
    reason             text NOT NULL DEFAULT '',
    status             text NOT NULL DEFAULT 'promoted' CHECK (status IN ('promoted', 'completed')),
    outcome            jsonb NOT NULL DEFAULT '{}',  -- per site: what reconciling it did
    started_at         timestamptz NOT NULL DEFAULT now(),
    completed_at       timestamptz
);

-- On every sink of the old source: its session from the old source is closed for good. A sink
-- transaction refuses any writer of a session with failed_over_to set, whatever its epoch (a
-- stale replicator of a partitioned old source could otherwise move its epoch past any fence).
ALTER TABLE lr.sink_sessions
    ADD COLUMN failed_over_to text,
    ADD COLUMN failover_id uuid,
    ADD COLUMN failover_note text;  -- what reconciling this sink did; NULL: not reconciled yet

-- The highest source position a sink's applications consumed whole, per receive queue: a failover
-- must know whether entries beyond the new source's position were already applied (then they
-- cannot be removed). Consumed rows are deleted, so it is noted as they go: once per deleting
-- statement, not per entry. lr's own removal of extras sets lr.reconciling and is not noted.
CREATE TABLE lr.receive_consumed (
    source_site_id text NOT NULL,
    client_name    text NOT NULL,
    position       bigint NOT NULL,
    PRIMARY KEY (source_site_id, client_name)
);

CREATE FUNCTION lr.note_consumed() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF current_setting('lr.reconciling', true) = 'on' THEN
        RETURN NULL;
    END IF;
    INSERT INTO lr.receive_consumed AS c (source_site_id, client_name, position)
    SELECT source_site_id, client_name, max(source_position) FROM gone WHERE visible GROUP BY 1, 2
    ON CONFLICT (source_site_id, client_name) DO UPDATE SET position = greatest(c.position, EXCLUDED.position);
    RETURN NULL;
END
$$;

CREATE TRIGGER receive_queue_consumed AFTER DELETE ON lr.receive_queue
    REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION lr.note_consumed();
