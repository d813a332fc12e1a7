-- lr schema v14: since when each session's lease is held (lr status shows the holder and since when).
-- lease_owner and lease_expires_at say who holds a lease and until when; a renewal moves the expiry,
-- so neither tells a replicator that has held a session for hours from one that just took it over.
-- Set when an owner takes the lease (from nobody, or from an owner whose lease expired); a renewal
-- by the same owner keeps it. Leases held when this runs show no acquisition time until retaken.
ALTER TABLE lr.source_sessions ADD COLUMN lease_acquired_at timestamptz;
