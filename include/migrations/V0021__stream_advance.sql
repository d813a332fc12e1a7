-- lr schema v21: a stream's sink transaction in one round trip. A stream knows where each of its
-- sessions stands on the sink (it wrote it there), so instead of reading the session's row under
-- its lock and then writing (two round trips), it sends BEGIN, this guard, its rows, the wake-up
-- and COMMIT together. The guard locks the row and moves the position on from the one the stream
-- expects, under the conditions the general path checks (the same lease epoch, not failed over,
-- consistent at the expected base); anything else raises SQLSTATE LR409, the transaction is rolled
-- back whole, and the stream takes the general path, which reads the row and says what is wrong
-- (engine/store/sink_sessions.py owns the call, engine/sink/writes.py the rule).
CREATE FUNCTION lr.stream_advance(p_source text, p_client text, p_epoch bigint, p_base bigint,
                                  p_after bigint, p_end bigint)
RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    UPDATE lr.sink_sessions s SET last_log_entry_processed = p_end, updated_at = now()
    WHERE s.source_site_id = p_source AND s.client_name = p_client AND s.lease_epoch = p_epoch
      AND s.failed_over_to IS NULL AND s.data_consistent AND s.snapshot_applied = p_base
      AND s.last_log_entry_processed = p_after;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'lr: the sink session %/% is not where its stream left it (position %, epoch %, base %)',
            p_source, p_client, p_after, p_epoch, p_base
            USING ERRCODE = 'LR409';
    END IF;
END
$$;
