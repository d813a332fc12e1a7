-- lr schema v18: a source session's state is one lr writes. V0003 also allowed WAIT_SNAPSHOT_APPLY,
-- STOPPED and ERROR, which nothing ever wrote: a transferred snapshot waiting for its apply stays
-- IN_SNAPSHOT_SYNC (negotiation decides the apply), and an error is the session's last_error.
-- engine/vocabulary.py's SessionState lists the same four (tests/engine/test_vocabulary.py).
ALTER TABLE lr.source_sessions
    DROP CONSTRAINT source_sessions_state_check,
    ADD CONSTRAINT source_sessions_state_check
        CHECK (state IN ('INITIALIZED', 'NEGOTIATING', 'IN_SNAPSHOT_SYNC', 'IN_LOG_ENTRY_SYNC'));
