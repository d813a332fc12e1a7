-- lr schema v34: the database bounds a log entry's size, not only the writer's Python client.
--
-- Every reader of the log (the stream, the session cycles, the tee, the Spark fan-out, the sinks'
-- subscribers) budgets its memory on a payload of at most 16 MiB (settings: max_payload_bytes;
-- docs/memory.md). RoutingQueueClient refuses a larger payload, but a writer role inserts into
-- lr.log_entries with its own SQL too (docs/security.md): a 200 MB entry it inserted took a
-- streaming replicator, which serves every client of the source, to 2.4 GB, and an entry near
-- PostgreSQL's 1 GB limit stops that replicator for everyone. An entry of stream 1 or 2 (a payload
-- and its envelope: destinations, source, client, a full sync's snapshot) is therefore at most
-- 16 MiB + 1 MiB. The capture's table changes (stream 3 with a table_id, which only lr's trigger
-- sets: a writer's INSERT does not cover that column) are exempt: one row larger than that is the
-- application's own (docs/tables.md). NOT VALID: existing rows are not scanned; every new one is
-- checked (octet_length of a bytea being inserted reads its header only).
ALTER TABLE lr.log_entries ADD CONSTRAINT log_entries_message_bounded
    CHECK (octet_length(message) <= 17825792 OR (stream = 3 AND table_id IS NOT NULL)) NOT VALID;
