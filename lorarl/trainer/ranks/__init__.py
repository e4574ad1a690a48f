"""Multi-rank plumbing: rank 0 broadcasts each engine call to its followers, in lockstep."""
