"""The owners of the shared tables: every read and write of lr.source_sessions, lr.sink_sessions, lr.receive_queue and lr.topology goes through one module here."""
