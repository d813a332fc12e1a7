-- lr schema v48: a writer reads the source's sessions of its own clients only. Its SELECT on
-- lr.source_sessions (sink, client, acknowledged position: what a wait for delivery reads, docs/delivery.md)
-- covered every row: a writer of alpha read beta's sinks and how far each had acknowledged, though the
-- policies refuse it every other row of beta (its log entries, full-sync requests, delivery guards).
-- The replicator reads and updates every row, as before; the owner (lr init, topology apply, failover)
-- is not subject to the policies; a consumer has no privilege on the table.
ALTER TABLE lr.source_sessions ENABLE ROW LEVEL SECURITY;
CREATE POLICY replicator ON lr.source_sessions
    USING (EXISTS (SELECT 1 FROM lr.role_grants g WHERE g.kind = 'replicator' AND pg_has_role(g.role_oid, 'USAGE')))
    WITH CHECK (EXISTS (SELECT 1 FROM lr.role_grants g WHERE g.kind = 'replicator' AND pg_has_role(g.role_oid, 'USAGE')));
CREATE POLICY writer_read ON lr.source_sessions FOR SELECT
    USING (client_name IN (SELECT g.client_name FROM lr.role_grants g
                           WHERE g.kind = 'writer' AND pg_has_role(g.role_oid, 'USAGE')));
