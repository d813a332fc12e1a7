"""Bulk data movement for the Spark jobs and the in-process tee: the fan-out, the snapshot transfer
and their COPY helpers."""
