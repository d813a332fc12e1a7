-- lr schema v17: drop the reader's scan state. lr.log_scan_state (V0002) recorded how far a refresh of
-- lr.destination_log_state's last transmitted positions had scanned the log; nothing in lr runs that
-- refresh (the readers keep their positions in lr.source_sessions and lr.sink_sessions), so the row
-- only ever held 0. Its grant to replicator roles (engine/site/roles.py) goes with it.
DROP TABLE IF EXISTS lr.log_scan_state;
