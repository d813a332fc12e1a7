-- lr schema v6: least-privilege roles, enforced by the database (docs/security.md).
--
-- The owner of the lr schema installs and upgrades it and applies the topology. Every other role
-- gets what its kind needs from `lr roles grant` (engine/roles.py), which records it here:
--
-- * replicator: runs every session of the site, as source and as sink (and trims the log);
-- * writer of a client: transmits as that client only (no read of the shared log at all);
-- * consumer of a client: reads and acknowledges that client's receive queues only.
--
-- Table and column privileges say which tables and columns a kind may touch; the row-level
-- security policies below say which clients' rows. They read lr.role_grants, matching the caller
-- through role membership (pg_has_role ... 'USAGE': the privileges a session can use). The schema
-- owner and superusers are not subject to them: their path is unchanged.

CREATE TABLE lr.role_grants (
    role_oid    oid NOT NULL,            -- what the policies match (a renamed role keeps its grants)
    role_name   text NOT NULL,           -- its name when granted, for people
    kind        text NOT NULL CHECK (kind IN ('replicator', 'writer', 'consumer')),
    client_name text NOT NULL DEFAULT '' CHECK ((kind = 'replicator') = (client_name = '')),
    granted_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (role_oid, kind, client_name)
);
-- Each role sees its own grants only (the policies of the other tables read them as the caller).
ALTER TABLE lr.role_grants ENABLE ROW LEVEL SECURITY;
CREATE POLICY own_grants ON lr.role_grants FOR SELECT USING (pg_has_role(role_oid, 'USAGE'));

-- Commit positions are drawn by the schema owner: a writer needs no privilege on lr.log_commits
-- or lr.commit_position_seq, so it can neither forge a position nor take one another transaction
-- will draw. Its search_path is pinned (a caller's search_path cannot redirect what it calls).
ALTER FUNCTION lr.assign_commit_position() SECURITY DEFINER SET search_path = pg_catalog, pg_temp;

-- The shared log. A writer inserts entries of the clients it writes for (its INSERT privilege
-- covers stream, tag_ids, client_id and message: tx and entry_id always take their defaults);
-- a replicator reads and trims everything and inserts full-sync data only (the topology's
-- providers supply it inside the replicator's connection).
ALTER TABLE lr.log_entries ENABLE ROW LEVEL SECURITY;
CREATE POLICY replicator ON lr.log_entries
    USING (EXISTS (SELECT 1 FROM lr.role_grants g WHERE g.kind = 'replicator' AND pg_has_role(g.role_oid, 'USAGE')))
    WITH CHECK (stream = 2 AND EXISTS (SELECT 1 FROM lr.role_grants g
                                       WHERE g.kind = 'replicator' AND pg_has_role(g.role_oid, 'USAGE')));
CREATE POLICY writer ON lr.log_entries FOR INSERT
    WITH CHECK (client_id IN (SELECT c.client_id FROM lr.clients c JOIN lr.role_grants g ON g.client_name = c.client_name
                              WHERE g.kind = 'writer' AND pg_has_role(g.role_oid, 'USAGE')));

-- Full-sync requests: the replicator makes and closes them; a writer sees and supplies those of
-- its clients (serve_full_sync_requests) and can only leave them pending or supplied.
ALTER TABLE lr.full_sync_requests ENABLE ROW LEVEL SECURITY;
CREATE POLICY replicator ON lr.full_sync_requests
    USING (EXISTS (SELECT 1 FROM lr.role_grants g WHERE g.kind = 'replicator' AND pg_has_role(g.role_oid, 'USAGE')))
    WITH CHECK (EXISTS (SELECT 1 FROM lr.role_grants g WHERE g.kind = 'replicator' AND pg_has_role(g.role_oid, 'USAGE')));
CREATE POLICY writer_read ON lr.full_sync_requests FOR SELECT
    USING (client_name IN (SELECT g.client_name FROM lr.role_grants g
                           WHERE g.kind = 'writer' AND pg_has_role(g.role_oid, 'USAGE')));
CREATE POLICY writer_supply ON lr.full_sync_requests FOR UPDATE
    USING (client_name IN (SELECT g.client_name FROM lr.role_grants g
                           WHERE g.kind = 'writer' AND pg_has_role(g.role_oid, 'USAGE')))
    WITH CHECK (status IN ('pending', 'supplied')
                AND client_name IN (SELECT g.client_name FROM lr.role_grants g
                                    WHERE g.kind = 'writer' AND pg_has_role(g.role_oid, 'USAGE')));

-- Receive queues: the replicator writes every client's; a consumer reads its clients' rows (the
-- invisible ones too: they hold delivery back) and acknowledges visible ones only.
ALTER TABLE lr.receive_queue ENABLE ROW LEVEL SECURITY;
CREATE POLICY replicator ON lr.receive_queue
    USING (EXISTS (SELECT 1 FROM lr.role_grants g WHERE g.kind = 'replicator' AND pg_has_role(g.role_oid, 'USAGE')))
    WITH CHECK (EXISTS (SELECT 1 FROM lr.role_grants g WHERE g.kind = 'replicator' AND pg_has_role(g.role_oid, 'USAGE')));
CREATE POLICY consumer_read ON lr.receive_queue FOR SELECT
    USING (client_name IN (SELECT g.client_name FROM lr.role_grants g
                           WHERE g.kind = 'consumer' AND pg_has_role(g.role_oid, 'USAGE')));
CREATE POLICY consumer_ack ON lr.receive_queue FOR UPDATE
    USING (visible AND client_name IN (SELECT g.client_name FROM lr.role_grants g
                                       WHERE g.kind = 'consumer' AND pg_has_role(g.role_oid, 'USAGE')))
    WITH CHECK (visible AND client_name IN (SELECT g.client_name FROM lr.role_grants g
                                            WHERE g.kind = 'consumer' AND pg_has_role(g.role_oid, 'USAGE')));
CREATE POLICY consumer_delete ON lr.receive_queue FOR DELETE
    USING (visible AND client_name IN (SELECT g.client_name FROM lr.role_grants g
                                       WHERE g.kind = 'consumer' AND pg_has_role(g.role_oid, 'USAGE')));

-- Dead letters: a consumer moves its clients' malformed entries aside, reads and removes them;
-- the replicator counts them (status).
ALTER TABLE lr.receive_dead_letters ENABLE ROW LEVEL SECURITY;
CREATE POLICY replicator_read ON lr.receive_dead_letters FOR SELECT
    USING (EXISTS (SELECT 1 FROM lr.role_grants g WHERE g.kind = 'replicator' AND pg_has_role(g.role_oid, 'USAGE')));
CREATE POLICY consumer ON lr.receive_dead_letters
    USING (client_name IN (SELECT g.client_name FROM lr.role_grants g
                           WHERE g.kind = 'consumer' AND pg_has_role(g.role_oid, 'USAGE')))
    WITH CHECK (client_name IN (SELECT g.client_name FROM lr.role_grants g
                                WHERE g.kind = 'consumer' AND pg_has_role(g.role_oid, 'USAGE')));

-- The registry: the replicator registers receive queues; a consumer discovers its clients' ones.
ALTER TABLE lr.registry ENABLE ROW LEVEL SECURITY;
CREATE POLICY replicator ON lr.registry
    USING (EXISTS (SELECT 1 FROM lr.role_grants g WHERE g.kind = 'replicator' AND pg_has_role(g.role_oid, 'USAGE')))
    WITH CHECK (EXISTS (SELECT 1 FROM lr.role_grants g WHERE g.kind = 'replicator' AND pg_has_role(g.role_oid, 'USAGE')));
CREATE POLICY consumer_read ON lr.registry FOR SELECT
    USING (kind = 'receive_queue' AND client_name IN (SELECT g.client_name FROM lr.role_grants g
                                                      WHERE g.kind = 'consumer' AND pg_has_role(g.role_oid, 'USAGE')));
