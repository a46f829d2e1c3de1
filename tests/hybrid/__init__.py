"""Hybrid sharding (shard within groups of ``degree`` ranks, replicate across them)."""
