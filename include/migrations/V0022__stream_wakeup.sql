-- lr schema v22: a stream that has nothing to read sleeps until a commit wakes it, instead of
-- polling the commit-position sequence, at no cost to writers while it is awake.
-- A stream about to sleep takes the wake-up key 1819410435 (lr.engine.vocabulary.STREAM_WAKE_KEY)
-- exclusively (session level, try: it never waits), then reads the last drawn position, in that
-- order (lr.stream_may_sleep). A writer's commit, when it draws its position, takes the same key
-- shared until it ends (try: it never waits either). Writers never conflict with one another; a
-- writer that cannot take it (a stream sleeps) sends NOTIFY lr_commit, delivered when it commits.
-- So a stream asleep misses no commit: one that drew its position before the stream took the key
-- either still holds the key (the stream could not take it, and does not sleep) or shows in the
-- position the stream reads after taking it; one that draws after it notifies.
CREATE OR REPLACE FUNCTION lr.assign_commit_position() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF current_setting('lr.commit_position_assigned', true) IS DISTINCT FROM 'on' THEN
        PERFORM set_config('lr.commit_position_assigned', 'on', true);
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

-- (the wake-up key taken, the last drawn position read after it): the stream sleeps only when it
-- took the key and nothing was drawn past what it has read.
CREATE FUNCTION lr.stream_may_sleep(OUT asleep boolean, OUT latest bigint)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    asleep := pg_try_advisory_lock(1819410435);
    SELECT CASE WHEN s.is_called THEN s.last_value ELSE 0 END INTO latest FROM lr.commit_position_seq s;
END
$$;
