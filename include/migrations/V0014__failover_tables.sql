-- lr schema v14: federated tables in a failover (docs/failover.md, "Federated tables").

-- The old source of a client, once a failover handed its federated tables to the promoted site, is
-- one of their sinks: its capture triggers are replaced by these guards (one statement-level
-- BEFORE trigger per operation, created by engine/tables/handover.py with arguments client name,
-- new source). An application's write there would never be replicated and would be overwritten
-- by key from the new source: it is refused, naming where to write instead, as the old source's
-- routing-queue writers of the client are refused by the new topology. lr's own apply (lr.applying)
-- passes: the table's snapshot and changes from the new source are written through it.
CREATE FUNCTION lr.refuse_table_writes() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF current_setting('lr.applying', true) = 'on' THEN
        RETURN NULL;
    END IF;
    RAISE EXCEPTION 'table %.% of client % is replicated from site % since a failover: write it there (this site is its sink now)',
        TG_TABLE_SCHEMA, TG_TABLE_NAME, TG_ARGV[0], TG_ARGV[1]
        USING ERRCODE = 'read_only_sql_transaction';
END
$$;
