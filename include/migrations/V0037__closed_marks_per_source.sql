-- lr schema v37: a sink's note that a source closed the federation of a table it holds a copy of
-- (lr tables close tells each sink it reaches: engine/tables/registry.note_closed_copy) is kept on
-- that source's row of lr.sink_tables, not on the table's one registry row. A sink table may hold
-- the rows of several sources (docs/tables.md, Two sources, one table); a snapshot from one of them
-- ends only that source's note. Before (V0031), the note was one table id on the registry row,
-- and any source's snapshot of the table cleared it: a second source's snapshot made the sink
-- forget the first one's close, and a failover promoting the sink federated the closed table again.
ALTER TABLE lr.sink_tables ADD COLUMN closed_at_source boolean NOT NULL DEFAULT false;

-- the notes made before: on the row of the source whose table id they name
UPDATE lr.sink_tables t SET closed_at_source = true FROM lr.registry g
WHERE g.stream_name = t.table_name AND g.kind = 'table' AND g.table_id IS NULL
  AND g.closed_table_id = t.source_table_id;
