-- lr schema v11: the snapshot transfer stages packed rows (engine/bulk/snapshot_transfer.py).
--
-- Its Spark tasks pack consecutive entries of their entry-id range the way every receive-queue
-- write does (engine/sink/queue_rows.py), so the driver's move into lr.receive_queue is one
-- server-side INSERT ... SELECT of packed rows, and the apply flips those rows, not one per entry.
-- A staged row's source_entry_id is then its last entry's id, entry_count how many it holds.
ALTER TABLE lr.spark_staging ADD COLUMN entry_count integer NOT NULL DEFAULT 1;
