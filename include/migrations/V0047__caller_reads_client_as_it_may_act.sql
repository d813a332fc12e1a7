-- lr schema v47: lr.caller_reads_client (V0036: may the role that logged in read a client's sessions,
-- failover notes and commit positions, through lr.sinks_lacking_tables, lr.unreplicated_note and
-- lr.commit_position_of) counts a grant the login can act with: one whose privileges it inherits
-- (USAGE, as the row-level security policies match), or one it may SET ROLE to. It counted any
-- membership ('MEMBER'). On PostgreSQL 16 and later a membership may carry neither (GRANT ... WITH
-- INHERIT FALSE, SET FALSE; what a CREATEROLE role that is not a superuser is given in each role it
-- creates, to administer it): a writer of alpha holding such a membership in a writer of beta, which the
-- policies refuse every row of beta, read which of beta's transactions wrote to the log and their
-- commit order, and beta's sinks and notes. Before 16 every member may SET ROLE: MEMBER stays.
DO $$
DECLARE
    may text := CASE WHEN pg_catalog.current_setting('server_version_num')::int >= 160000
                     THEN '(pg_catalog.pg_has_role(session_user, %1$s, ''USAGE'') OR pg_catalog.pg_has_role(session_user, %1$s, ''SET''))'
                     ELSE 'pg_catalog.pg_has_role(session_user, %1$s, ''MEMBER'')' END;
BEGIN
    EXECUTE pg_catalog.format($f$
CREATE OR REPLACE FUNCTION lr.caller_reads_client(p_client text) RETURNS boolean
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp
AS $b$
    SELECT %1$s
        OR EXISTS (SELECT 1 FROM lr.role_grants g
                   WHERE %2$s
                     AND (g.kind = 'replicator' OR (g.kind = 'writer' AND g.client_name = p_client)))
    FROM pg_namespace n WHERE n.nspname = 'lr'
$b$ $f$, pg_catalog.format(may, 'n.nspowner'), pg_catalog.format(may, 'g.role_oid'));
END
$$;
