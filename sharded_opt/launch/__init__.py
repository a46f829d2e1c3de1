"""Starting ranks: spawn and init_parallel_env, and naming the rank that made a run fail."""
