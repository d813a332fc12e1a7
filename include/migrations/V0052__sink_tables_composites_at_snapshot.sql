-- lr schema v52: a sink remembers the user-defined types each table's columns hold (composites'
-- attributes, domains' bases, enums' labels, ranges' subtypes) as its snapshot was taken (the
-- source's: the snapshot refuses a sink whose types differ), as it remembers the columns' types
-- (V0040). A composite the SINK reordered after that (ALTER TYPE ... DROP ATTRIBUTE a, ADD ATTRIBUTE
-- a int) took the source's values by position while the table streamed, fields swapped, silently:
-- only a change of the source's types was seen (V0049). Such a change is now refused, naming the
-- type and both definitions. NULL: a table synced before this version (nothing checked, as before).
ALTER TABLE lr.sink_tables ADD COLUMN composites jsonb;
