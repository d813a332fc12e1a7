-- lr schema v50: each replicator member says which sites it cannot reach now. Members shared a
-- source's sessions by the source alone: a member cut off from a sink (a stalled or half-open link,
-- a firewall) while it still reached the source kept that sink's sessions for as long as the cut
-- lasted, its cycles failing and retried, while a member beside it that reached the sink never took
-- them. A member now writes, with each heartbeat, the sites its connections failed to reach and
-- has not reached since; every member gives a session whose sink its member cannot reach to one of
-- the source's members that can (engine/session/assignment.assign), the same answer everywhere.
-- engine/store/members.py owns the column.
ALTER TABLE lr.replicator_members ADD COLUMN unreached text[] NOT NULL DEFAULT '{}';
