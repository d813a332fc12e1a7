"""A site as a whole: its schema, the topology it belongs to, how to reach it, its roles and what
an operator sees of it (status, metrics)."""
