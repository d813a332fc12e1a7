-- lr schema v35: the commit-position trigger, for transactions that are prepared and for those that
-- make it fire before their commit.
--
-- 1. A transaction that writes lr's log may be prepared (PREPARE TRANSACTION) while a stream sleeps.
-- The trigger fires at PREPARE TRANSACTION too (deferred triggers fire when a transaction is
-- prepared), and while a stream of the source sleeps it sends NOTIFY lr_commit to wake it (V0022);
-- PostgreSQL refuses to prepare a transaction that has sent a notification ("cannot PREPARE a
-- transaction that has executed LISTEN, UNLISTEN, or NOTIFY"). So an application's two-phase commit
-- failed whenever `lr sync` happened to be idle, and worked while it was busy or not running. A
-- prepared transaction is not visible before COMMIT PREPARED, which fires no trigger: a notification
-- sent at PREPARE would wake the stream to nothing. So none is sent when the statement being run is
-- PREPARE TRANSACTION (current_query(): the client's statement, whatever track_activities says); the
-- stream finds the transaction once committed within its longest sleep (sleep_max, 50 ms). Only the
-- start and the end of the text are looked at (a 16 MiB payload's transmit in autocommit must not
-- be searched whole); a statement that only mentions the words there misses its wake-up, never an
-- entry.
--
-- 2. An application that checks its deferred constraints before commit (SET CONSTRAINTS ALL
-- IMMEDIATE, which no constraint trigger escapes) made the trigger fire at once: the transaction drew
-- its position before it was done, went on writing after other transactions committed with later
-- positions, and was delivered before them. A federated table's row changed by both ended with the
-- earlier change at the sink. Now the trigger notes the last entry id drawn when it draws (the
-- sequence's last value: every entry the transaction wrote so far is at or below it); an entry above
-- it is one written after the draw, and the transaction's position is drawn again (its row of
-- lr.log_commits moved to a new position, in the same transaction: the first is never seen, and
-- the stream passes it as it passes a rolled-back one). At commit, the rows' events fire after
-- every write, so none is above the mark: a transaction whose trigger stays deferred draws once,
-- as before. Nothing else changes.
CREATE OR REPLACE FUNCTION lr.assign_commit_position() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    drawn text := current_setting('lr.commit_position_assigned', true);
    statement text;
BEGIN
    IF drawn IS NULL OR drawn = '' THEN
        IF current_setting('synchronous_commit') = 'off' THEN
            PERFORM set_config('synchronous_commit', 'local', true);
        END IF;
        PERFORM pg_advisory_xact_lock_shared(1819410434);  -- lr.engine.vocabulary.COMMIT_LOCK_KEY
        INSERT INTO lr.log_commits (position, tx)
        VALUES (nextval('lr.commit_position_seq'), pg_current_xact_id());
        PERFORM set_config('lr.commit_position_assigned', (SELECT s.last_value FROM lr.log_entry_id_seq s)::text, true);
        IF NOT pg_try_advisory_xact_lock_shared(1819410435) THEN  -- STREAM_WAKE_KEY: a stream sleeps
            statement := current_query();
            IF statement IS NULL
               OR (left(statement, 4096) || ' ' || right(statement, 4096)) !~* 'prepare\s+transaction' THEN
                PERFORM pg_notify('lr_commit', '');
            END IF;
        END IF;
    ELSIF drawn <> 'on' AND NEW.entry_id > drawn::bigint THEN  -- written after the draw ('on': drawn by V0029's)
        UPDATE lr.log_commits SET position = nextval('lr.commit_position_seq'), committed_at = clock_timestamp()
        WHERE tx = pg_current_xact_id();
        PERFORM set_config('lr.commit_position_assigned', (SELECT s.last_value FROM lr.log_entry_id_seq s)::text, true);
    END IF;
    RETURN NULL;
END
$$;
