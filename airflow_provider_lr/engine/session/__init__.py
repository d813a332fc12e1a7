"""A session between two sites: negotiation, the lease that fences it, the runner that moves it one
cycle at a time, and the replicator that drives every session of a site."""
