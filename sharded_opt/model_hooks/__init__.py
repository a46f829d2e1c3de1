"""Hooks on the user's model: the per-module waits for the all-gathers, the read guard for reads
right after step(), their compiled form, and hook lifetimes that neither keep the wrapper alive
nor travel with copies."""
