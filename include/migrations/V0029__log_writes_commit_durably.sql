-- lr schema v29: a transaction that writes lr's log commits durably, whatever its application's
-- synchronous_commit says.
--
-- lr reads a committed entry at once (the stream reads the final prefix as soon as it shows) and
-- delivers it. An application that commits with synchronous_commit = off returns, and its
-- transaction is visible, before its commit record is on disk: a crash of the source's server then
-- forgets a transaction lr may already have delivered. The sinks hold what the source says never
-- happened (a routing queue's replay differs from the source's state; a federated table's next
-- changes are refused or applied over rows the source no longer has), and nothing repairs it.
-- PostgreSQL's own logical replication sends only what the sender's WAL flush has passed; lr reads
-- through SQL, so it makes the commit wait for its flush instead: when the transaction draws its
-- commit position (at commit, deferred), 'off' is raised to 'local' for that transaction only. Any
-- other setting (on, local, remote_write, remote_apply) already flushes locally and is kept. An
-- application that commits synchronously (PostgreSQL's default) pays nothing.
CREATE OR REPLACE FUNCTION lr.assign_commit_position() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF current_setting('lr.commit_position_assigned', true) IS DISTINCT FROM 'on' THEN
        PERFORM set_config('lr.commit_position_assigned', 'on', true);
        IF current_setting('synchronous_commit') = 'off' THEN
            PERFORM set_config('synchronous_commit', 'local', true);
        END IF;
        PERFORM pg_advisory_xact_lock_shared(1819410434);  -- lr.engine.vocabulary.COMMIT_LOCK_KEY
        INSERT INTO lr.log_commits (position, tx)
        VALUES (nextval('lr.commit_position_seq'), pg_current_xact_id());
        IF NOT pg_try_advisory_xact_lock_shared(1819410435) THEN  -- STREAM_WAKE_KEY: a stream sleeps
            PERFORM pg_notify('lr_commit', '');
        END IF;
    END IF;
    RETURN NULL;
END
$$;
