"""The source site: what writers transmit, the shared log a session reads, the full-sync supply and
the trim that bounds the log."""
