-- lr schema v43: the capture of federated tables prints its columns' types with
-- quote_all_identifiers off, whatever the writer's session set. The capture compares the types it
-- prints (format_type) with those noted when the table was opened (lr.capture_column_types) and,
-- when they differ, carries them for each sink to compare with its own; format_type quotes every
-- identifier under quote_all_identifiers = on ("text", "public"."mood"), so a writer with that
-- setting made every change it wrote carry types no sink has (column t is "text" on the source but
-- text on the sink): each sink refused the batch and every later change of the session, for good.
-- lr's own connections set it off too (db/timeouts), so the types noted at the open and read from
-- each site's catalog are printed alike. A later CREATE OR REPLACE of the capture function must
-- keep this setting (it replaces the function's SET clauses), as V0041's lc_monetary.
ALTER FUNCTION lr.capture_table_changes() SET quote_all_identifiers = off;
ALTER FUNCTION lr.capture_column_types(pg_catalog.regclass) SET quote_all_identifiers = off;
