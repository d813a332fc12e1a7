-- Placeholder: V0009 is reserved for another branch (issue 15, delivery states). Migrations must be
-- numbered without gaps, so the failover branch carries this empty one to test V0010.
-- MERGE: delete this file when the other branch's V0009 arrives.
SELECT 1;
