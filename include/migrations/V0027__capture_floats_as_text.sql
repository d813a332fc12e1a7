-- lr schema v27: the capture trigger of federated tables (V0026) carries a primary key's real and
-- double precision columns (and domains over them) as their text form, as it does arrays and json
-- (V0015). to_jsonb prints a float -0 as 0 (JSON numbers are numerics, which have no -0): a row keyed
-- -0 arrived at the sinks keyed 0 (equal, so found, but printed otherwise), and a key changed from 0
-- to -0 (or back) was no key change for the trigger (their jsonb images are equal), so every sink
-- kept the old form. The text form ('-0', 'NaN', 'Infinity', every digit with extra_float_digits = 1)
-- casts back to the same value, and two keys of another text form are a key change: the old one is
-- deleted, the new one upserted, as the source holds them. Only key columns: a table's image built
-- column by column costs its writers about a third more per statement (measured with single-row
-- inserts into a table of two double precision columns), and a float -0 that is not a key only
-- prints otherwise at the sink (it equals 0).
CREATE OR REPLACE FUNCTION lr.capture_table_changes() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET TimeZone = 'UTC'
SET extra_float_digits = 1
SET DateStyle = 'ISO'
SET IntervalStyle = 'postgres'
SET bytea_output = 'hex'
AS $$
#variable_conflict use_variable
DECLARE
    lr_table_id  integer := TG_ARGV[1]::integer;
    lr_client_id integer;
    lr_tags      integer[];
    lr_keys      text[];
    lr_nonkey    text[];
    lr_generated text[];  -- generated columns: each site computes its own, rows do not carry them
    lr_text      text[];  -- columns carried as their text form
    lr_columns   text[];  -- every column, in the table's order
    lr_image     text;    -- a row image (of transition table row lr_row) with those columns as text
    lr_extra     jsonb;   -- what an entry says besides op and rows
BEGIN
    IF pg_catalog.current_setting('lr.applying', true) = 'on' THEN
        RETURN NULL;
    END IF;
    SELECT lr_c.client_id, pg_catalog.array_agg(lr_r.tag_id ORDER BY lr_r.tag_id)
    INTO lr_client_id, lr_tags
    FROM lr.clients lr_c
    JOIN lr.source_sessions lr_s ON lr_s.client_name = lr_c.client_name
    JOIN lr.remote_sites lr_r ON lr_r.site_id = lr_s.sink_site_id
    WHERE lr_c.client_name = TG_ARGV[0]
    GROUP BY lr_c.client_id;
    IF lr_tags IS NULL THEN
        RETURN NULL;  -- the client has no sink: nothing to carry
    END IF;
    IF TG_OP = 'TRUNCATE' THEN
        INSERT INTO lr.log_entries (stream, tag_ids, client_id, table_id, message)
        VALUES (3, lr_tags, lr_client_id, lr_table_id, pg_catalog.convert_to('{"op": "t"}', 'UTF8'));
        RETURN NULL;
    END IF;
    -- the key as the table has it now: its primary key's columns by their current names (the
    -- registry's key_columns, noted when the table was opened, only when it has none any more)
    SELECT pg_catalog.array_agg(lr_a.attname::text ORDER BY lr_a.attnum) INTO lr_keys
    FROM pg_catalog.pg_index lr_i
    JOIN pg_catalog.pg_attribute lr_a ON lr_a.attrelid = lr_i.indrelid AND lr_a.attnum = ANY (lr_i.indkey)
    WHERE lr_i.indrelid = TG_RELID AND lr_i.indisprimary;
    IF lr_keys IS NULL THEN
        SELECT lr_g.key_columns INTO lr_keys FROM lr.registry lr_g WHERE lr_g.table_id = lr_table_id;
    END IF;
    WITH RECURSIVE lr_base (attname, attgenerated, typid, depth, attnum) AS (
        SELECT lr_a.attname::text, lr_a.attgenerated, lr_a.atttypid, 0, lr_a.attnum
        FROM pg_catalog.pg_attribute lr_a
        WHERE lr_a.attrelid = TG_RELID AND lr_a.attnum > 0 AND NOT lr_a.attisdropped
        UNION ALL  -- a domain's base type (domains over domains too)
        SELECT lr_b.attname, lr_b.attgenerated, lr_t.typbasetype, lr_b.depth + 1, lr_b.attnum
        FROM lr_base lr_b JOIN pg_catalog.pg_type lr_t ON lr_t.oid = lr_b.typid
        WHERE lr_t.typtype = 'd' AND lr_b.depth < 10
    )
    SELECT coalesce(pg_catalog.array_agg(lr_b.attname ORDER BY lr_b.attnum) FILTER (WHERE lr_b.depth = 0), '{}'),
           coalesce(pg_catalog.array_agg(lr_b.attname) FILTER (WHERE lr_b.depth = 0 AND lr_b.attname <> ALL (lr_keys)), '{}'),
           coalesce(pg_catalog.array_agg(lr_b.attname) FILTER (WHERE lr_b.depth = 0 AND lr_b.attgenerated <> ''), '{}'),
           coalesce(pg_catalog.array_agg(DISTINCT lr_b.attname) FILTER (
               WHERE lr_b.attgenerated = '' AND (lr_t.typcategory = 'A' OR lr_t.typtype = 'c'
                                                 OR lr_t.oid IN ('pg_catalog.json'::regtype, 'pg_catalog.jsonb'::regtype)
                                                 OR (lr_t.oid IN ('pg_catalog.float4'::regtype, 'pg_catalog.float8'::regtype)
                                                     AND lr_b.attname = ANY (lr_keys)))), '{}')
    INTO lr_columns, lr_nonkey, lr_generated, lr_text
    FROM lr_base lr_b JOIN pg_catalog.pg_type lr_t ON lr_t.oid = lr_b.typid;
    IF lr_text <> '{}' THEN
        SELECT pg_catalog.string_agg(pg_catalog.format(
                   CASE WHEN lr_col = ANY (lr_text) THEN 'pg_catalog.jsonb_build_object(%L, lr_row.%I::pg_catalog.text)'
                        ELSE 'pg_catalog.jsonb_build_object(%L, pg_catalog.to_jsonb(lr_row.%I))' END, lr_col, lr_col),
                   ' || ' ORDER BY lr_ord)
        INTO lr_image FROM pg_catalog.unnest(lr_columns) WITH ORDINALITY lr_c(lr_col, lr_ord);
        lr_extra := pg_catalog.jsonb_build_object('text', lr_text);
        -- the same statements as below, with text columns; $1..$6 are the variables they use
        IF TG_OP = 'UPDATE' THEN
            EXECUTE pg_catalog.format($q$
                INSERT INTO lr.log_entries (stream, tag_ids, client_id, table_id, message)
                SELECT 3, $1, $2, $3, pg_catalog.convert_to((pg_catalog.jsonb_build_object(
                    'op', 'd', 'rows', pg_catalog.jsonb_agg(lr_gone.lr_key ORDER BY lr_gone.lr_seq)) || $6)::text, 'UTF8')
                FROM (SELECT lr_k.lr_key, pg_catalog.row_number() OVER (ORDER BY lr_k.lr_seq) AS lr_seq
                      FROM (SELECT (%1$s) - $4 AS lr_key, pg_catalog.row_number() OVER () AS lr_seq
                            FROM lr_old lr_row) lr_k
                      JOIN (SELECT (%1$s) - $4 AS lr_key, pg_catalog.row_number() OVER () AS lr_seq
                            FROM lr_new lr_row) lr_m ON lr_m.lr_seq OPERATOR(pg_catalog.=) lr_k.lr_seq
                      WHERE lr_m.lr_key OPERATOR(pg_catalog.<>) lr_k.lr_key) lr_gone
                GROUP BY (lr_gone.lr_seq - 1) / 500
                ORDER BY (lr_gone.lr_seq - 1) / 500 $q$, lr_image)
            USING lr_tags, lr_client_id, lr_table_id, lr_nonkey, lr_generated, lr_extra;
        END IF;
        EXECUTE pg_catalog.format($q$
            INSERT INTO lr.log_entries (stream, tag_ids, client_id, table_id, message)
            SELECT 3, $1, $2, $3, pg_catalog.convert_to((pg_catalog.jsonb_build_object(
                'op', %2$L, 'rows', pg_catalog.jsonb_agg(lr_changed.lr_image ORDER BY lr_changed.lr_seq)) || $6)::text, 'UTF8')
            FROM (SELECT (%1$s) - %3$s AS lr_image, pg_catalog.row_number() OVER () AS lr_seq
                  FROM %4$s lr_row) lr_changed
            GROUP BY (lr_changed.lr_seq - 1) / 500
            ORDER BY (lr_changed.lr_seq - 1) / 500 $q$,
            lr_image, CASE TG_OP WHEN 'DELETE' THEN 'd' ELSE 'u' END,
            CASE TG_OP WHEN 'DELETE' THEN '$4' ELSE '$5' END, CASE TG_OP WHEN 'DELETE' THEN 'lr_old' ELSE 'lr_new' END)
        USING lr_tags, lr_client_id, lr_table_id, lr_nonkey, lr_generated, lr_extra;
        RETURN NULL;
    END IF;
    IF TG_OP = 'UPDATE' THEN  -- the old key of every row whose key changed goes first
        INSERT INTO lr.log_entries (stream, tag_ids, client_id, table_id, message)
        SELECT 3, lr_tags, lr_client_id, lr_table_id,
               pg_catalog.convert_to(pg_catalog.jsonb_build_object(
                   'op', 'd', 'rows', pg_catalog.jsonb_agg(lr_gone.lr_key ORDER BY lr_gone.lr_seq))::text, 'UTF8')
        FROM (SELECT lr_k.lr_key, pg_catalog.row_number() OVER (ORDER BY lr_k.lr_seq) AS lr_seq
              FROM (SELECT pg_catalog.to_jsonb(lr_o.*) - lr_nonkey AS lr_key, pg_catalog.row_number() OVER () AS lr_seq
                    FROM lr_old lr_o) lr_k
              JOIN (SELECT pg_catalog.to_jsonb(lr_n.*) - lr_nonkey AS lr_key, pg_catalog.row_number() OVER () AS lr_seq
                    FROM lr_new lr_n) lr_m ON lr_m.lr_seq OPERATOR(pg_catalog.=) lr_k.lr_seq
              WHERE lr_m.lr_key OPERATOR(pg_catalog.<>) lr_k.lr_key) lr_gone
        GROUP BY (lr_gone.lr_seq - 1) / 500
        ORDER BY (lr_gone.lr_seq - 1) / 500;
    END IF;
    IF TG_OP = 'DELETE' THEN
        INSERT INTO lr.log_entries (stream, tag_ids, client_id, table_id, message)
        SELECT 3, lr_tags, lr_client_id, lr_table_id,
               pg_catalog.convert_to(pg_catalog.jsonb_build_object(
                   'op', 'd', 'rows', pg_catalog.jsonb_agg(lr_gone.lr_key ORDER BY lr_gone.lr_seq))::text, 'UTF8')
        FROM (SELECT pg_catalog.to_jsonb(lr_o.*) - lr_nonkey AS lr_key,
                     pg_catalog.row_number() OVER () AS lr_seq FROM lr_old lr_o) lr_gone
        GROUP BY (lr_gone.lr_seq - 1) / 500
        ORDER BY (lr_gone.lr_seq - 1) / 500;
    ELSE
        INSERT INTO lr.log_entries (stream, tag_ids, client_id, table_id, message)
        SELECT 3, lr_tags, lr_client_id, lr_table_id,
               pg_catalog.convert_to(pg_catalog.jsonb_build_object(
                   'op', 'u', 'rows', pg_catalog.jsonb_agg(lr_changed.lr_row ORDER BY lr_changed.lr_seq))::text, 'UTF8')
        FROM (SELECT pg_catalog.to_jsonb(lr_n.*) - lr_generated AS lr_row,
                     pg_catalog.row_number() OVER () AS lr_seq FROM lr_new lr_n) lr_changed
        GROUP BY (lr_changed.lr_seq - 1) / 500
        ORDER BY (lr_changed.lr_seq - 1) / 500;
    END IF;
    RETURN NULL;
END
$$;

-- And each session's row at the source notes the highest table_id of its client's federated tables
-- that its sink held (synced, or a conflict it keeps) when a cycle last looked. A table opened while
-- a stream runs is read past (its changes are not the sink's until its snapshot) before the stream
-- sees it and hands the session to a cycle that takes the snapshot: the session's acknowledged
-- position passes a change of it the sink does not hold yet. A writer's wait for durability
-- (wait_until_safe) counts such a change as safe at a sink only once its table is at or below this.
ALTER TABLE lr.source_sessions ADD COLUMN tables_settled_upto integer;

-- The sinks of client lr_client whose session has not noted holding the tables of the table changes
-- at commit position lr_position (NULL: of every table the client federates here now). A writer's
-- waits (wait_until_safe, wait_until_ready) ask it: a writer may not read the log, the registry, nor
-- these columns (docs/security.md). A session never noted (NULL) holds them, as before V0027.
CREATE FUNCTION lr.sinks_lacking_tables(lr_client text, lr_position bigint) RETURNS SETOF text
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
    SELECT s.sink_site_id FROM lr.source_sessions s
    WHERE s.client_name = lr_client AND s.tables_settled_upto < (
        CASE WHEN lr_position IS NULL THEN (
            SELECT max(g.table_id) FROM lr.registry g
            WHERE g.kind = 'table' AND g.is_federated AND g.client_name = lr_client)
        ELSE (
            SELECT max(e.table_id) FROM lr.log_commits c JOIN lr.log_entries e ON e.tx = c.tx
            JOIN lr.clients k ON k.client_id = e.client_id AND k.client_name = lr_client
            JOIN lr.remote_sites r ON r.tag_id = ANY (e.tag_ids) AND r.site_id = s.sink_site_id
            WHERE c.position = lr_position AND e.stream = 3)
        END)
$$;
