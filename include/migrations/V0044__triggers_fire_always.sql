-- lr schema v44: lr's triggers fire whatever the writer's session_replication_role. A trigger
-- fires in the role 'origin' (the default) only unless it is ENABLE ALWAYS, so a writer with
-- session_replication_role = replica (a superuser's restore, a bulk load told to skip triggers,
-- another replication tool's apply, PostgreSQL's own subscription worker) skipped them all: its
-- changes to a federated table were never captured (the sinks silently kept the old rows), its
-- transmits drew no commit position (never read: lost without an error), a failover's guards let
-- it write where lr's apply alone may, and a consumer's deletes went unrecorded for failover.
-- lr's own apply sets no replication role, so no trigger fires on it that did not before.
ALTER TABLE lr.log_entries ENABLE ALWAYS TRIGGER log_entries_commit_position;
ALTER TABLE lr.receive_queue ENABLE ALWAYS TRIGGER receive_queue_consumed;

-- the triggers lr attached to the applications' tables (capture, a failover's guards) and the
-- moved clients' guard: a table lr's owner may attach triggers to but not alter (TRIGGER granted,
-- not owned) keeps its triggers as they were; `lr tables open` says so, naming the statement
DO $$
DECLARE
    t record;
BEGIN
    FOR t IN
        SELECT tg.tgrelid::pg_catalog.regclass AS rel, tg.tgname
        FROM pg_catalog.pg_trigger tg
        WHERE NOT tg.tgisinternal AND tg.tgenabled = 'O'
          AND (tg.tgname ~ '^lr_(capture|refuse)_(insert|update|delete|truncate)$'
               OR (tg.tgname = 'log_entries_moved_clients' AND tg.tgrelid = 'lr.log_entries'::pg_catalog.regclass))
    LOOP
        BEGIN
            EXECUTE pg_catalog.format('ALTER TABLE %s ENABLE ALWAYS TRIGGER %I', t.rel, t.tgname);
        EXCEPTION WHEN insufficient_privilege THEN
            RAISE NOTICE 'lr: trigger % on % left as it was (not the table''s owner)', t.tgname, t.rel;
        END;
    END LOOP;
END
$$;
