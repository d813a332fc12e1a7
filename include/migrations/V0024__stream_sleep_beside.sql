-- lr schema v24: every stream of a source sleeps, not only the first. Under V0022 one stream asleep
-- holds the wake-up key 1819410435 (lr.engine.vocabulary.STREAM_WAKE_KEY) exclusively; a second
-- stream (another replicator's, sharing the source's sessions) could not take it and polled.
-- A stream that finds another asleep sleeps beside it: while that one holds the key every committing
-- writer NOTIFYs lr_commit (V0022), and a stream giving the key back NOTIFYs too when anyone sleeps
-- beside it, which it knows by the watch key 1819410436 (STREAM_WATCH_KEY) that those hold shared.
-- No commit is missed: the one beside took the watch key before it found the wake-up key held, so
-- the holder, which gives the wake-up key back before it looks at the watch key, either sees the
-- watch key held and notifies, or gave the wake-up key back before it was looked for (then the one
-- beside does not sleep). V0022's lr.stream_may_sleep stays for a replicator not yet upgraded.

-- (asleep, beside, latest): asleep when the stream took the wake-up key (beside false) or sleeps
-- beside a stream that holds it (beside true: it holds the watch key shared); then ``latest``, the
-- last drawn commit position, read after either was taken. Every lock is tried: none ever waits.
CREATE FUNCTION lr.stream_may_sleep_beside(OUT asleep boolean, OUT beside boolean, OUT latest bigint)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    beside := false;
    FOR attempt IN 1..3 LOOP  -- a holder giving the key back between the tries: try again
        asleep := pg_try_advisory_lock(1819410435);
        EXIT WHEN asleep OR NOT pg_try_advisory_lock_shared(1819410436);
        IF NOT pg_try_advisory_lock_shared(1819410435) THEN  -- held exclusively: a stream sleeps
            asleep := true;
            beside := true;
            EXIT;
        END IF;
        -- shared: writers hold it (a commit is in flight, nobody sleeps), or its holder just gave it back
        PERFORM pg_advisory_unlock_shared(1819410435);
        PERFORM pg_advisory_unlock_shared(1819410436);
    END LOOP;
    SELECT CASE WHEN s.is_called THEN s.last_value ELSE 0 END INTO latest FROM lr.commit_position_seq s;
END
$$;

-- A stream that slept holding the wake-up key gives it back, and wakes those asleep beside it
-- (after that, writers take the key shared and notify nobody).
CREATE FUNCTION lr.stream_awake() RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM pg_advisory_unlock(1819410435);
    IF pg_try_advisory_lock(1819410436) THEN
        PERFORM pg_advisory_unlock(1819410436);
    ELSE
        PERFORM pg_notify('lr_commit', '');
    END IF;
END
$$;
