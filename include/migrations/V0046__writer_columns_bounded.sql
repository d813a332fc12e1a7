-- lr schema v46: every column a writer role writes with its own SQL is bounded by the database, as its
-- entries' messages are (V0034): a reader that serves every client of the source reads them.
--
-- * lr.log_entries.tag_ids: a transmit tags an entry with its sinks, one tag each (at most the
--   topology's sites, 4096). A writer's own INSERT stored an entry of 20 million tags in 1 MB (an
--   array of one value compresses), and each read of it by a session not tagged took 1.4 s of the
--   source's server (the array decompressed and scanned whole, per reader, per read): the stream's
--   routed read, one statement for every client of the source, carried that for all of them. An
--   entry may have 268 million tags (1 GB).
-- * lr.full_sync_requests.base_snapshot and note: a writer supplying its client's full sync writes
--   them; the replicator reads the request whole at every cycle of the session (a base snapshot is
--   a pg_snapshot's text, a few kilobytes: its in-progress transactions; a note is a sentence).
-- * lr.delivery_guards.destinations: the sinks a waiting writer names, which lr status reads.
--
-- NOT VALID: existing rows are not scanned; every new or changed one is checked.
ALTER TABLE lr.log_entries ADD CONSTRAINT log_entries_tags_bounded
    CHECK (pg_catalog.cardinality(tag_ids) <= 4096) NOT VALID;
ALTER TABLE lr.full_sync_requests ADD CONSTRAINT full_sync_requests_bounded
    CHECK (pg_catalog.octet_length(base_snapshot) <= 16777216 AND pg_catalog.octet_length(note) <= 65536) NOT VALID;
ALTER TABLE lr.delivery_guards ADD CONSTRAINT delivery_guards_bounded
    CHECK (pg_catalog.cardinality(destinations) <= 4096) NOT VALID;
