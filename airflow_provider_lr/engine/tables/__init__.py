"""Federated tables: capture, definition, registry, the sink's apply, snapshots and hand-over."""
