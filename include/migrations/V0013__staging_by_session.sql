-- lr schema v13: what Spark jobs left staged for a session is found without scanning the table.
--
-- Staged rows are never visible; whatever a failed, abandoned or superseded job leaves in
-- lr.spark_staging is dead weight once the session moves on. Before v13 some stayed for good: an
-- abandoned snapshot transfer's data (rows keyed by sync), and fan-out packs a session cycle then
-- passed over (below the sink's position, where the staging key's range scans never look).
-- engine/sink/writes.discard_staged now drops a session's staged rows wherever it moves on; the
-- staging key leads with the source position, so it needs this index (one entry per staged pack).
CREATE INDEX spark_staging_of_session ON lr.spark_staging (source_site_id, client_name, sync_id);
