"""The CPU-checkable parts of ``benchmarks/``: the comparison job's methods, the GPU check
and its trace analysis."""
