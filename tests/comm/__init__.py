"""Grad reduction and param all-gather: the gloo collectives, one communicator per wrapper,
streams (with fakes), overlap mode, the per-bucket step pipeline, the collective guard, and the
per-param cost of the grad hooks."""
