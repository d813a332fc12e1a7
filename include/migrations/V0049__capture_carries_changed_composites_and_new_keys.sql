-- lr schema v49: the capture of federated tables carries the composites a table's columns hold
-- (through arrays, domains, ranges, other composites) when they changed at the source since the
-- table was opened. A composite's value travels by position, in its text and binary forms alike;
-- the sinks compared the source's composites with theirs at the snapshot only, so a composite the
-- source reordered while its table streamed (ALTER TYPE pair DROP ATTRIBUTE a, ADD ATTRIBUTE a:
-- now (b, a)) arrived with its fields swapped, silently. lr.capture_composites gives them as the
-- sinks read theirs (tables/definition.SHAPE_COMPOSITES, composites only: a JSON array of [name,
-- "attribute type, ..."], in name order; NULL when none); lr tables open gives its result to the
-- capture triggers of a table that holds one (their fourth argument). Each statement of such a
-- table computes them anew (one catalog read), as does one of a table whose columns' types changed
-- since it was opened (a column made a composite then); a table without either pays nothing. When
-- they differ, its entries carry them; a sink whose own differ refuses the batch, naming the
-- type and both definitions.
CREATE FUNCTION lr.capture_composites(lr_rel pg_catalog.regclass) RETURNS pg_catalog.text
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
SET quote_all_identifiers = off
SET plan_cache_mode = force_generic_plan
SET enable_hashjoin = off
SET enable_mergejoin = off
SET enable_seqscan = off
AS $$
BEGIN
    -- (plpgsql, with its generic plan: planned once in a session, where a sql function's, which
    -- cannot be inlined, or a plan for each table was made anew at each call: ~1 ms for each of a
    -- writer's statements)
    RETURN (SELECT NULLIF(pg_catalog.to_json(ARRAY(
        WITH RECURSIVE lr_reach(oid) AS (
            SELECT lr_a.atttypid FROM pg_catalog.pg_attribute lr_a
            WHERE lr_a.attrelid = lr_rel AND lr_a.attnum > 0 AND NOT lr_a.attisdropped
            UNION
            SELECT lr_m.oid FROM lr_reach lr_r JOIN pg_catalog.pg_type lr_y ON lr_y.oid = lr_r.oid
            CROSS JOIN LATERAL (
                SELECT lr_y.typelem WHERE lr_y.typelem <> 0
                UNION ALL SELECT lr_y.typbasetype WHERE lr_y.typbasetype <> 0
                UNION ALL SELECT lr_g.rngsubtype FROM pg_catalog.pg_range lr_g WHERE lr_g.rngtypid = lr_y.oid
                UNION ALL SELECT lr_g.rngtypid FROM pg_catalog.pg_range lr_g WHERE lr_g.rngmultitypid = lr_y.oid
                UNION ALL SELECT lr_a.atttypid FROM pg_catalog.pg_attribute lr_a
                          WHERE lr_y.typtype = 'c' AND lr_a.attrelid = lr_y.typrelid AND lr_a.attnum > 0
                          AND NOT lr_a.attisdropped
            ) lr_m(oid))
        SELECT ARRAY[(SELECT CASE WHEN tn.nspname = 'pg_catalog' OR NOT pg_catalog.pg_type_is_visible(ty.oid)
                   THEN pg_catalog.format_type(lr_y.oid, -1)
                   ELSE pg_catalog.quote_ident(tn.nspname) || '.' || pg_catalog.format_type(lr_y.oid, -1) END
            FROM pg_catalog.pg_type ty JOIN pg_catalog.pg_namespace tn ON tn.oid = ty.typnamespace WHERE ty.oid = lr_y.oid),
                     pg_catalog.array_to_string(ARRAY(
                         SELECT pg_catalog.quote_ident(lr_a.attname) || ' ' || (SELECT CASE WHEN tn.nspname = 'pg_catalog' OR NOT pg_catalog.pg_type_is_visible(ty.oid)
                   THEN pg_catalog.format_type(lr_a.atttypid, lr_a.atttypmod)
                   ELSE pg_catalog.quote_ident(tn.nspname) || '.' || pg_catalog.format_type(lr_a.atttypid, lr_a.atttypmod) END
            FROM pg_catalog.pg_type ty JOIN pg_catalog.pg_namespace tn ON tn.oid = ty.typnamespace WHERE ty.oid = lr_a.atttypid)
                         FROM pg_catalog.pg_attribute lr_a
                         WHERE lr_a.attrelid = lr_y.typrelid AND lr_a.attnum > 0 AND NOT lr_a.attisdropped
                         ORDER BY lr_a.attnum), ', ')]
        FROM lr_reach lr_r JOIN pg_catalog.pg_type lr_y ON lr_y.oid = lr_r.oid
        WHERE lr_y.typtype = 'c'
        ORDER BY 1))::pg_catalog.text, '[]'));
END
$$;

-- And a primary-key change carries the row's new key with its old one. An UPDATE that
-- changed keys wrote the old keys as gone (op d), then the new rows (op u), and every sink deleted
-- the old key's row: a sink whose foreign key to the table is the ordinary NOT DEFERRABLE
-- REFERENCES ... ON UPDATE CASCADE (ON DELETE NO ACTION) refused that delete while children still
-- referenced the old key, at every cycle, for good. The gone keys' entry now lists, under "to",
-- each row's new key in the order of "rows" (its old keys), so a sink moves the row to its new key
-- in place (an UPDATE: the sink's own ON UPDATE rules act as the source's did) wherever that cannot
-- meet another row's key, and deletes it as before elsewhere (tables/runs.py).
--
-- The pairing: the old and the new key of a row are the rows of the same position in the
-- statement's transition tables lr_old and lr_new, as the gone keys were already found (V0026).
-- PostgreSQL appends both in one call for each updated row (trigger.c, AfterTriggerSaveEvent:
-- old_tuplestore then new_tuplestore), and a row moved between partitions has its old row
-- appended by the delete from its partition (nodeModifyTable.c, ExecDeleteEpilogue) right before
-- its new row by the insert into the other one (tests/guarantees/test_table_key_moves.py: many
-- rows, swaps, id + 1 over a deferrable key, partitions). Entries written before V0049 have no
-- "to" and apply as before. Otherwise V0042's function (its SET clauses and V0043's
-- quote_all_identifiers = off kept: a CREATE OR REPLACE replaces them).
CREATE OR REPLACE FUNCTION lr.capture_table_changes() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET row_security = off
SET TimeZone = 'UTC'
SET extra_float_digits = 1
SET DateStyle = 'ISO'
SET IntervalStyle = 'postgres'
SET bytea_output = 'hex'
SET lc_monetary = 'C'
SET quote_all_identifiers = off
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
    lr_floats    text[];  -- float columns not in the key (text only when a -0 is there)
    lr_columns   text[];  -- every column, in the table's order
    lr_image     text;    -- a row image (of transition table row lr_row) with those columns as text
    lr_extra     jsonb;   -- what an entry says besides op and rows
    lr_deferred  boolean; -- the primary key is DEFERRABLE: a key may be held twice between statements
    lr_held      text;    -- the key columns, as a column list for lr_row (rows still holding a gone key)
    lr_gone      text;    -- the statement's gone keys (old keys of moved rows, deleted rows' keys)
    lr_types     jsonb;   -- each column's type now; an entry's "types" when they changed since the open
    lr_shape     text;    -- the composites the columns hold now (lr.capture_composites)
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
    SELECT pg_catalog.array_agg(lr_a.attname::text ORDER BY lr_a.attnum), pg_catalog.bool_or(NOT lr_i.indimmediate)
    INTO lr_keys, lr_deferred
    FROM pg_catalog.pg_index lr_i
    JOIN pg_catalog.pg_attribute lr_a ON lr_a.attrelid = lr_i.indrelid AND lr_a.attnum = ANY (lr_i.indkey)
    WHERE lr_i.indrelid = TG_RELID AND lr_i.indisprimary;
    IF lr_keys IS NULL THEN
        SELECT lr_g.key_columns INTO lr_keys FROM lr.registry lr_g WHERE lr_g.table_id = lr_table_id;
    END IF;
    WITH RECURSIVE lr_base (attname, attgenerated, typid, depth, attnum, typmod) AS (
        SELECT lr_a.attname::text, lr_a.attgenerated, lr_a.atttypid, 0, lr_a.attnum, lr_a.atttypmod
        FROM pg_catalog.pg_attribute lr_a
        WHERE lr_a.attrelid = TG_RELID AND lr_a.attnum > 0 AND NOT lr_a.attisdropped
        UNION ALL  -- a domain's base type (domains over domains too)
        SELECT lr_b.attname, lr_b.attgenerated, lr_t.typbasetype, lr_b.depth + 1, lr_b.attnum, lr_b.typmod
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
                                                     AND lr_b.attname = ANY (lr_keys))
                                                 OR EXISTS (SELECT FROM pg_catalog.pg_cast lr_x  -- to_jsonb calls it
                                                            WHERE lr_x.castsource = lr_t.oid
                                                            AND lr_x.casttarget = 'pg_catalog.json'::regtype))), '{}'),
           coalesce(pg_catalog.array_agg(DISTINCT lr_b.attname) FILTER (
               WHERE lr_b.attgenerated = '' AND lr_b.attname <> ALL (lr_keys)
                 AND lr_t.oid IN ('pg_catalog.float4'::regtype, 'pg_catalog.float8'::regtype)), '{}'),
           pg_catalog.jsonb_object_agg(lr_b.attname, pg_catalog.format_type(lr_b.typid, lr_b.typmod))
               FILTER (WHERE lr_b.depth = 0 AND lr_b.attgenerated = '')
    INTO lr_columns, lr_nonkey, lr_generated, lr_text, lr_floats, lr_types
    FROM lr_base lr_b JOIN pg_catalog.pg_type lr_t ON lr_t.oid = lr_b.typid;
    -- the types as lr.capture_column_types gave them when the table was opened (a trigger made
    -- before V0038 has none): the same, nothing more is carried
    IF TG_NARGS > 2 AND lr_types::text IS DISTINCT FROM TG_ARGV[2] THEN
        lr_types := pg_catalog.jsonb_build_object('types', lr_types);
    ELSE
        lr_types := '{}';
    END IF;
    -- the composites the columns hold, as lr.capture_composites gave them when the table was opened
    -- (the fourth argument, given to a table holding one), or when a column's type changed since:
    -- others now (ALTER TYPE ... at this site), every entry carries them ("composites"), for each
    -- sink to compare with its own (a composite's value travels by position)
    IF TG_NARGS > 3 OR lr_types <> '{}' THEN
        lr_shape := lr.capture_composites(TG_RELID);
        IF lr_shape IS DISTINCT FROM TG_ARGV[3] THEN
            lr_types := lr_types || pg_catalog.jsonb_build_object('composites', coalesce(lr_shape::jsonb, '[]'));
        END IF;
    END IF;
    -- a float -0 (not a key: keys are text already): to_jsonb writes a float as a numeric, which has
    -- no -0, so the floats go as text when the rows are built column by column anyway, or when a
    -- row holds a -0 (only then: that costs the writer a dynamic statement). JSON prints a -0 float
    -- as the number -0, after its key's colon (a string or name holding ":-0," too only takes the
    -- text path for nothing). No column here has a cast to json (those make lr_text): row_to_json
    -- calls no user function.
    IF lr_floats <> '{}' THEN
        IF lr_text <> '{}' THEN
            lr_text := lr_text || lr_floats;
        ELSIF TG_OP <> 'DELETE' THEN
            IF EXISTS (SELECT FROM lr_new lr_n
                       WHERE pg_catalog.row_to_json(lr_n.*)::pg_catalog.text OPERATOR(pg_catalog.~) ':-0[,}]') THEN
                lr_text := lr_floats;
            END IF;
        END IF;
    END IF;
    IF lr_text <> '{}' THEN
        SELECT pg_catalog.string_agg(pg_catalog.format(
                   CASE WHEN lr_col = ANY (lr_text) THEN
                            'pg_catalog.jsonb_build_object(%1$L, CASE WHEN pg_catalog.num_nulls(lr_row.%2$I) = 0 '
                            'THEN pg_catalog.format(''%%s'', lr_row.%2$I) END)'
                        ELSE 'pg_catalog.jsonb_build_object(%1$L, pg_catalog.to_jsonb(lr_row.%2$I))' END, lr_col, lr_col),
                   ' || ' ORDER BY lr_ord)
        INTO lr_image FROM pg_catalog.unnest(lr_columns) WITH ORDINALITY lr_c(lr_col, lr_ord);
        lr_extra := pg_catalog.jsonb_build_object('text', lr_text) || lr_types;
        -- the same statements as below, with text columns; $1..$6 are the variables they use
        IF TG_OP = 'UPDATE' THEN
            EXECUTE pg_catalog.format($q$
                INSERT INTO lr.log_entries (stream, tag_ids, client_id, table_id, message)
                SELECT 3, $1, $2, $3, pg_catalog.convert_to((pg_catalog.jsonb_build_object(
                    'op', 'd', 'rows', pg_catalog.jsonb_agg(lr_gone.lr_key ORDER BY lr_gone.lr_seq),
                    'to', pg_catalog.jsonb_agg(lr_gone.lr_to ORDER BY lr_gone.lr_seq)) || $6)::text, 'UTF8')
                FROM (SELECT lr_k.lr_key, lr_m.lr_key AS lr_to, pg_catalog.row_number() OVER (ORDER BY lr_k.lr_seq) AS lr_seq
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
            FROM (SELECT lr_s.lr_image, lr_s.lr_seq, (lr_s.lr_seq - 1) / 500 AS lr_part,
                         (lr_s.lr_upto - pg_catalog.pg_column_size(lr_s.lr_image)) / 8388608 AS lr_bytes
                  FROM (SELECT lr_i.lr_image, pg_catalog.row_number() OVER lr_w AS lr_seq,
                               pg_catalog.sum(pg_catalog.pg_column_size(lr_i.lr_image)) OVER lr_w AS lr_upto
                        FROM (SELECT (%1$s) - %3$s AS lr_image FROM %4$s lr_row) lr_i
                        WINDOW lr_w AS (ROWS UNBOUNDED PRECEDING)) lr_s) lr_changed
            GROUP BY lr_changed.lr_part, lr_changed.lr_bytes
            ORDER BY lr_changed.lr_part, lr_changed.lr_bytes $q$,
            lr_image, CASE TG_OP WHEN 'DELETE' THEN 'd' ELSE 'u' END,
            CASE TG_OP WHEN 'DELETE' THEN '$4' ELSE '$5' END, CASE TG_OP WHEN 'DELETE' THEN 'lr_old' ELSE 'lr_new' END)
        USING lr_tags, lr_client_id, lr_table_id, lr_nonkey, lr_generated, lr_extra;
    ELSE
    IF TG_OP = 'UPDATE' THEN  -- the old key of every row whose key changed goes first, with its new key
        INSERT INTO lr.log_entries (stream, tag_ids, client_id, table_id, message)
        SELECT 3, lr_tags, lr_client_id, lr_table_id,
               pg_catalog.convert_to((pg_catalog.jsonb_build_object(
                   'op', 'd', 'rows', pg_catalog.jsonb_agg(lr_gone.lr_key ORDER BY lr_gone.lr_seq),
                   'to', pg_catalog.jsonb_agg(lr_gone.lr_to ORDER BY lr_gone.lr_seq)) || lr_types)::text, 'UTF8')
        FROM (SELECT lr_k.lr_key, lr_m.lr_key AS lr_to, pg_catalog.row_number() OVER (ORDER BY lr_k.lr_seq) AS lr_seq
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
               pg_catalog.convert_to((pg_catalog.jsonb_build_object(
                   'op', 'd', 'rows', pg_catalog.jsonb_agg(lr_gone.lr_key ORDER BY lr_gone.lr_seq)) || lr_types)::text, 'UTF8')
        FROM (SELECT pg_catalog.to_jsonb(lr_o.*) - lr_nonkey AS lr_key,
                     pg_catalog.row_number() OVER () AS lr_seq FROM lr_old lr_o) lr_gone
        GROUP BY (lr_gone.lr_seq - 1) / 500
        ORDER BY (lr_gone.lr_seq - 1) / 500;
    ELSE
        INSERT INTO lr.log_entries (stream, tag_ids, client_id, table_id, message)
        SELECT 3, lr_tags, lr_client_id, lr_table_id,
               pg_catalog.convert_to((pg_catalog.jsonb_build_object(
                   'op', 'u', 'rows', pg_catalog.jsonb_agg(lr_changed.lr_row ORDER BY lr_changed.lr_seq)) || lr_types)::text, 'UTF8')
        FROM (SELECT lr_s.lr_row, lr_s.lr_seq, (lr_s.lr_seq - 1) / 500 AS lr_part,
                     (lr_s.lr_upto - pg_catalog.pg_column_size(lr_s.lr_row)) / 8388608 AS lr_bytes
              FROM (SELECT lr_i.lr_row, pg_catalog.row_number() OVER lr_w AS lr_seq,
                           pg_catalog.sum(pg_catalog.pg_column_size(lr_i.lr_row)) OVER lr_w AS lr_upto
                    FROM (SELECT pg_catalog.to_jsonb(lr_n.*) - lr_generated AS lr_row FROM lr_new lr_n) lr_i
                    WINDOW lr_w AS (ROWS UNBOUNDED PRECEDING)) lr_s) lr_changed
        GROUP BY lr_changed.lr_part, lr_changed.lr_bytes
        ORDER BY lr_changed.lr_part, lr_changed.lr_bytes;
    END IF;
    END IF;
    -- A deferred primary key may hold a key twice between statements: a key this statement moved a
    -- row away from (or deleted) that another row still holds was written as gone above, so each
    -- sink deletes it; the rows holding it follow, so each sink holds one of them again (after the
    -- last statement, at commit, the source holds one row per key, which the sinks then hold).
    IF lr_deferred AND TG_OP <> 'INSERT' THEN
        SELECT pg_catalog.string_agg(pg_catalog.format('lr_row.%I', lr_k), ', ' ORDER BY lr_n),
               pg_catalog.string_agg(pg_catalog.format('%I', lr_k), ', ' ORDER BY lr_n)
        INTO lr_held, lr_gone FROM pg_catalog.unnest(lr_keys) WITH ORDINALITY lr_c(lr_k, lr_n);
        lr_gone := CASE TG_OP
            WHEN 'DELETE' THEN pg_catalog.format('SELECT %1$s FROM lr_old', lr_gone)
            ELSE pg_catalog.format('SELECT %1$s FROM lr_old WHERE (%1$s) NOT IN (SELECT %1$s FROM lr_new)', lr_gone) END;
        EXECUTE pg_catalog.format($q$
            INSERT INTO lr.log_entries (stream, tag_ids, client_id, table_id, message)
            SELECT 3, $1, $2, $3, pg_catalog.convert_to((pg_catalog.jsonb_build_object(
                'op', 'u', 'rows', pg_catalog.jsonb_agg(lr_held.lr_image ORDER BY lr_held.lr_seq)) || $5)::text, 'UTF8')
            FROM (SELECT (%1$s) - $4 AS lr_image, pg_catalog.row_number() OVER () AS lr_seq
                  FROM ONLY %2$I.%3$I lr_row WHERE (%4$s) IN (%5$s)) lr_held
            GROUP BY (lr_held.lr_seq - 1) / 500
            ORDER BY (lr_held.lr_seq - 1) / 500 $q$,
            coalesce(lr_image, 'pg_catalog.to_jsonb(lr_row.*)'), TG_TABLE_SCHEMA, TG_TABLE_NAME, lr_held, lr_gone)
        USING lr_tags, lr_client_id, lr_table_id, lr_generated, coalesce(lr_extra, lr_types);
    END IF;
    RETURN NULL;
END
$$;
