-- lr schema v31: a federated table closed at its source (lr tables close, or opened again as not
-- federated there) keeps the table id of the federation it ended. Its changes committed before the
-- close stay in the log under that id; a forced full sync of a sink that has not received them yet
-- would pass them (the table, closed, takes no snapshot), so the request waits for the sink to
-- catch up to the close, or is refused saying so (engine/source/full_sync.py). It is read only while
-- the table is closed (no table_id): opened again, the table takes a new snapshot at every sink.
ALTER TABLE lr.registry ADD COLUMN closed_table_id integer;
