"""tlx_dist: Mixture-of-Experts training with TLX grouped GEMMs and symmetric-memory dispatch."""
