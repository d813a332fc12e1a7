-- lr schema v33: a transaction that writes lr's log may be prepared (PREPARE TRANSACTION) while a
-- stream sleeps.
--
-- The commit-position trigger fires at commit, and also at PREPARE TRANSACTION (deferred triggers
-- fire when a transaction is prepared). While a stream of the source sleeps it sends
-- NOTIFY lr_commit to wake it (V0022), and PostgreSQL refuses to prepare a transaction that has
-- sent a notification: "cannot PREPARE a transaction that has executed LISTEN, UNLISTEN, or
-- NOTIFY". So an application's two-phase commit failed whenever `lr sync` happened to be idle,
-- and worked while it was busy or not running. A prepared transaction is not visible before
-- COMMIT PREPARED anyway, which fires no trigger: a notification sent at PREPARE would wake the
-- stream to nothing. So the trigger sends none when the statement being run is PREPARE TRANSACTION
-- (current_query(): the client's statement, whatever track_activities says); the stream finds the
-- transaction once it is committed within its longest sleep (sleep_max, 50 ms). Only the start
-- and the end of the text are looked at (a 16 MiB payload's transmit in autocommit must not be
-- searched whole); a statement that only mentions the words there misses its wake-up, never an
-- entry. Nothing else changes.
CREATE OR REPLACE FUNCTION lr.assign_commit_position() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    statement text;
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
            statement := current_query();
            IF statement IS NULL
               OR (left(statement, 4096) || ' ' || right(statement, 4096)) !~* 'prepare\s+transaction' THEN
                PERFORM pg_notify('lr_commit', '');
            END IF;
        END IF;
    END IF;
    RETURN NULL;
END
$$;
