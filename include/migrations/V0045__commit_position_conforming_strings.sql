-- lr schema v45: the commit-position trigger reads its strings as written, whatever the writer's
-- standard_conforming_strings. Its check that the statement is PREPARE TRANSACTION (V0035) matches
-- 'prepare\s+transaction'; PL/pgSQL parses the function's statements under the calling session's
-- setting, and an application whose session has it off (a legacy one's default) read the pattern as
-- 'prepares+transaction': the trigger notified a sleeping stream at PREPARE TRANSACTION again, and
-- PostgreSQL refused the application's two-phase commit whenever lr sync was idle.
ALTER FUNCTION lr.assign_commit_position() SET standard_conforming_strings = on;
