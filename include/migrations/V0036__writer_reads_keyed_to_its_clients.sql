-- lr schema v36: the SECURITY DEFINER reads a writer's waits make (lr.sinks_lacking_tables, V0027;
-- lr.unreplicated_note, V0028) answer only about a client the caller may read: one it is a writer
-- of, any client for a replicator or the lr schema's owner. Before, a writer of one client
-- could ask them about any other client: which of its sinks do not hold its tables yet, its failover
-- notes (docs/security.md: a writer may not see another client's session state). Any other caller
-- is refused with insufficient_privilege, naming the client.
--
-- A SECURITY DEFINER function runs as its owner, so the caller is known by session_user (the role
-- that logged in, whose privileges a SET ROLE can always return to), matched against lr.role_grants
-- by role membership as the row-level security policies do.

CREATE FUNCTION lr.caller_reads_client(p_client text) RETURNS boolean
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp
AS $$
    SELECT pg_has_role(session_user, n.nspowner, 'MEMBER')
        OR EXISTS (SELECT 1 FROM lr.role_grants g
                   WHERE pg_has_role(session_user, g.role_oid, 'MEMBER')
                     AND (g.kind = 'replicator' OR (g.kind = 'writer' AND g.client_name = p_client)))
    FROM pg_namespace n WHERE n.nspname = 'lr'
$$;
REVOKE EXECUTE ON FUNCTION lr.caller_reads_client(text) FROM PUBLIC;

CREATE OR REPLACE FUNCTION lr.sinks_lacking_tables(lr_client text, lr_position bigint) RETURNS SETOF text
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF NOT lr.caller_reads_client(lr_client) THEN
        RAISE EXCEPTION 'permission denied: % may not read the sessions of client %', session_user, lr_client
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    RETURN QUERY
    SELECT s.sink_site_id FROM lr.source_sessions s
    WHERE s.client_name = lr_client AND s.tables_settled_upto < (
        CASE WHEN lr_position IS NULL THEN (
            SELECT max(g.table_id) FROM lr.registry g
            WHERE g.kind = 'table' AND g.is_federated AND g.client_name = lr_client)
        ELSE (
            SELECT max(e.table_id) FROM lr.log_commits c JOIN lr.log_entries e ON e.tx = c.tx
            JOIN lr.clients k ON k.client_id = e.client_id AND k.client_name = lr_client
            JOIN lr.remote_sites r ON r.tag_id = ANY (e.tag_ids) AND r.site_id = s.sink_site_id
            WHERE c.position = lr_position AND e.stream = 3)
        END);
END
$$;

CREATE OR REPLACE FUNCTION lr.unreplicated_note(p_client text, p_position bigint) RETURNS text
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF NOT lr.caller_reads_client(p_client) THEN
        RAISE EXCEPTION 'permission denied: % may not read the failover notes of client %', session_user, p_client
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    RETURN (SELECT note FROM lr.unreplicated_ranges
            WHERE client_name = p_client AND p_position > after_position AND p_position <= upto_position LIMIT 1);
END
$$;
