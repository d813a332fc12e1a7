-- lr schema v19: drop lr.destination_log_state (V0002). It was to hold, per destination, the last
-- commit position that carried an entry for it; the readers never kept it (a session's position is
-- lr.source_sessions.acked_position and lr.sink_sessions.last_log_entry_processed), so its rows only
-- ever held 0 since the topology created them. Its grant to replicator roles goes with it.
DROP TABLE IF EXISTS lr.destination_log_state;
