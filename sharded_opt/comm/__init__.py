"""The collectives and what they run on: torch.distributed wrappers, streams and events, the wrapper's
process groups and their lifecycle, the shared state of the buckets' collectives, the check that
every rank entered a collective API, the construction-time broadcasts."""
