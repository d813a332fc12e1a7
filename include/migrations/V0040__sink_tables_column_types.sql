-- lr schema v40: a sink remembers the column types of each table as its snapshot was taken (the
-- source's: the snapshot refuses a sink table whose types differ). A sink column narrowed after
-- that (ALTER TABLE ... ALTER COLUMN ... TYPE numeric(12,2) where the source has numeric(12,4),
-- varchar(5) for varchar(20), timestamp(0) for timestamp(6)) took the source's changes by its own
-- type: numbers and times rounded, silently, for good (a too-long text failed with PostgreSQL's
-- raw error). A change of such a column is now refused, naming it, as one whose type changed at
-- the source is (V0038). NULL: a table synced before this version (nothing checked, as before).
ALTER TABLE lr.sink_tables ADD COLUMN column_types jsonb;
