"""Benchmarks for sharded_opt: built-in workloads (no downloads) and the mode comparison.

Run ``python -m benchmarks.compare`` for the main comparison and
``pytest benchmarks --benchmark-only`` for the micro-benchmarks.
"""
