-- lr schema v51: what each session of this source still has to deliver (lr.session_backlogs), read
-- as the schema's owner for a caller that may read the session's client (lr.caller_reads_client:
-- a writer of it, a replicator, the owner). A writer's client.wait_until_ready read the sessions'
-- state, lr.log_commits and lr.log_entries itself, none of which a writer may read: it failed with
-- "permission denied for table source_sessions" (docs/security.md lists it among the application's
-- waits). The rows are those engine/store/source_sessions.backlog_rows read before (the one rule of
-- "remaining": committed, a log entry or a table change tagged for the sink, of the session's
-- client, after the sink's acknowledged position; the oldest p_at_most of them when given), less
-- the sessions of clients the caller may not read (a client it names and may not read is refused);
-- that function reads this one on a site that has it.
CREATE FUNCTION lr.session_backlogs(p_sink text, p_client text, p_at_most bigint)
RETURNS TABLE (sink text, client text, state text, acked bigint, entries bigint, highest bigint,
               lag double precision, first_guarded bigint, before_guard bigint)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
BEGIN
    -- a client named that the caller may not read is refused, as lr.sinks_lacking_tables refuses it
    -- (an empty answer would read as "nothing left to deliver": every sink ready)
    IF p_client IS NOT NULL AND NOT lr.caller_reads_client(p_client) THEN
        RAISE EXCEPTION 'permission denied: % may not read the sessions of client %', session_user, p_client
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    RETURN QUERY
    SELECT s.sink_site_id, s.client_name, s.state, s.acked_position, p.n, p.highest, p.lag, g.first, p.before
    FROM lr.source_sessions s
    JOIN lr.remote_sites r ON r.site_id = s.sink_site_id
    LEFT JOIN lr.clients k ON k.client_name = s.client_name
    CROSS JOIN LATERAL (  -- the first guarded position (docs/delivery.md): producers waiting
        SELECT min(d.position) AS first FROM lr.delivery_guards d
        WHERE d.client_name = s.client_name AND s.sink_site_id = ANY (d.destinations) AND d.expires_at > now()
    ) g
    CROSS JOIN LATERAL (
        SELECT count(*) AS n, coalesce(max(c.position), -1) AS highest,
               round(greatest(extract(epoch FROM now() - min(c.committed_at)), 0)::numeric, 1)::float8 AS lag,
               count(*) FILTER (WHERE g.first IS NULL OR c.position < g.first) AS before
        FROM (
            SELECT c.position, c.committed_at FROM lr.log_commits c
            CROSS JOIN LATERAL (
                SELECT 1 FROM lr.log_entries e
                WHERE e.tx = c.tx AND e.stream IN (1, 3) AND e.tag_ids @> ARRAY[r.tag_id]
                  AND e.client_id = k.client_id
                OFFSET 0  -- per-commit index lookups, driven by the position range
            ) e
            WHERE c.position > greatest(s.acked_position, 0)
            ORDER BY c.position LIMIT p_at_most  -- NULL: no limit
        ) c
    ) p
    WHERE (p_sink IS NULL OR s.sink_site_id = p_sink)
      AND (p_client IS NULL OR s.client_name = p_client)
      -- (a replicator or the owner reads every client: asked once, not for each session)
      AND ((SELECT lr.caller_reads_client(NULL)) OR lr.caller_reads_client(s.client_name))
    ORDER BY 1, 2;
END
$$;
REVOKE EXECUTE ON FUNCTION lr.session_backlogs(text, text, bigint) FROM PUBLIC;
-- the roles granted before it (lr roles grant writer / replicator) read it as those granted after
DO $$
DECLARE g record;
BEGIN
    FOR g IN SELECT DISTINCT r.rolname FROM lr.role_grants rg JOIN pg_catalog.pg_roles r ON r.oid = rg.role_oid
             WHERE rg.kind IN ('writer', 'replicator') LOOP
        EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION lr.session_backlogs(text, text, bigint) TO %I', g.rolname);
    END LOOP;
END
$$;
