-- lr schema v9: delivery guards (seed 001, Qpid HA's QueueGuard).
-- A producer that waits for its transmit to become safe (client.wait_until_safe / wait_until_ready)
-- records a guard: its entries are *delayed* until safe, and a destination's *first guarded
-- position* (the lowest guard naming it) is what readiness is judged against. Nothing is written
-- per transmit: a guard exists only while somebody waits, and is removed when the wait ends (a
-- waiter that died leaves one behind until expires_at).
CREATE TABLE lr.delivery_guards (
    guard_id     uuid PRIMARY KEY,
    client_name  text NOT NULL,
    position     bigint NOT NULL,            -- the first guarded commit position
    destinations text[] NOT NULL,            -- the sinks the waiter waits for
    created_at   timestamptz NOT NULL DEFAULT now(),
    expires_at   timestamptz NOT NULL
);
CREATE INDEX delivery_guards_client ON lr.delivery_guards (client_name, position);

-- A writer guards (and removes) only its own clients' waits; the replicator and lr status read all.
ALTER TABLE lr.delivery_guards ENABLE ROW LEVEL SECURITY;
CREATE POLICY replicator ON lr.delivery_guards
    USING (EXISTS (SELECT 1 FROM lr.role_grants g WHERE g.kind = 'replicator' AND pg_has_role(g.role_oid, 'USAGE')));
CREATE POLICY writer ON lr.delivery_guards
    USING (client_name IN (SELECT g.client_name FROM lr.role_grants g
                           WHERE g.kind = 'writer' AND pg_has_role(g.role_oid, 'USAGE')))
    WITH CHECK (client_name IN (SELECT g.client_name FROM lr.role_grants g
                                WHERE g.kind = 'writer' AND pg_has_role(g.role_oid, 'USAGE')));

-- A transaction's commit position, for a producer waiting on its ticket: writers may not read
-- lr.log_commits (nor the log), only look up one transaction's position.
CREATE FUNCTION lr.commit_position_of(txid xid8) RETURNS bigint
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$ SELECT position FROM lr.log_commits WHERE tx = txid $$;
