-- lr schema v28: a site that no longer sources a client refuses that client's writers, and remembers
-- which of its entries of the client nobody will receive (docs/failover.md, "The old source's writers").
--
-- After a failover or a planned switchover, a client object made at the old source before the switch
-- keeps its routes in memory: its transmits (and a federated table's captured changes) would be
-- committed into a log no session reads any more. When a topology is applied on a site, every client
-- the site registered (it was its source once) and does not source now gets this guard: one BEFORE
-- INSERT row trigger on lr.log_entries, created by engine/source/moved.py only on such a site and only
-- for those clients (WHEN client_id = ANY (...)), with arguments (client_id, client_name, where to
-- transmit now) per client. A source that never lost a client has no such trigger: its writers pay
-- nothing. The trigger is rewritten when the set changes, and dropped when the site sources them all
-- again (a fail-back).
CREATE FUNCTION lr.refuse_moved_transmit() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    i integer := 0;
BEGIN
    WHILE i + 2 < TG_NARGS LOOP
        IF TG_ARGV[i]::integer = NEW.client_id THEN
            RAISE EXCEPTION 'client % is not replicated from this site any more: %; nothing was written',
                TG_ARGV[i + 1], TG_ARGV[i + 2]
                USING ERRCODE = 'read_only_sql_transaction';
        END IF;
        i := i + 3;
    END LOOP;
    RETURN NEW;
END
$$;

-- Positions of a client's entries this site committed that nobody received and nobody will: those an
-- old source committed after the cut of a failover, until it rejoined (they are counted then). A
-- ticket of one of them is refused by wait_until_safe and the delivery reads, even once the site is
-- the client's source again (a fail-back), when the new sessions' positions are past them.
CREATE TABLE lr.unreplicated_ranges (
    client_name    text NOT NULL,
    after_position bigint NOT NULL,
    upto_position  bigint NOT NULL,
    note           text NOT NULL,
    recorded_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (client_name, after_position)
);

-- What a producer waiting on a ticket reads (writers may not read the table, as they may not read the log).
CREATE FUNCTION lr.unreplicated_note(p_client text, p_position bigint) RETURNS text
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$ SELECT note FROM lr.unreplicated_ranges
      WHERE client_name = p_client AND p_position > after_position AND p_position <= upto_position LIMIT 1 $$;
