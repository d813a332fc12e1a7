-- lr schema v20: the replicator processes working a source's sessions (their membership), so they
-- share the sessions and take over a dead one's within seconds instead of a full lease.
-- A member is a replicator process (owner id as in lr.source_sessions.lease_owner: host:pid:uuid).
-- It holds a session-level advisory lock (lr's member class, lock_key) on a connection of its own
-- to this site for as long as it lives: when its process dies, its backend exits and the lock is
-- gone at once. heartbeat_at, moved every fraction of a second, is the backstop for a process
-- that hangs with its connection open: older than dead_after_s (the member's own bound), it is
-- dead too. engine/store/members.py owns the table and says the rule; engine/session/membership.py
-- joins, beats and leaves; a lease whose owner is a dead member is taken at once (its epoch bumped).
CREATE SEQUENCE lr.replicator_member_lock_seq AS integer MINVALUE 1 CYCLE;

CREATE TABLE lr.replicator_members (
    owner        text PRIMARY KEY,
    lock_key     integer NOT NULL,
    joined_at    timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now(),
    dead_after_s double precision NOT NULL CHECK (dead_after_s > 0)
);
