-- lr schema v7: when each session last completed a step without error (lr status shows its age).
ALTER TABLE lr.source_sessions ADD COLUMN last_success_at timestamptz;
