"""The flat-buffer machinery of ``fusion/``: the layout planner (element-wise and whole-param
layouts), the flat param and grad buffers, model-derived bucket sizes, and the chunked CPU step
over a flat shard."""
