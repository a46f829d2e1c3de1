"""The runtime of a step, bucket by bucket: each bucket's runtime object and this rank's shard of
it, the inner optimizer over the shards, the grad hooks and the end of backward, the grad side
(presence flags, reductions, the last step's grads), the step pipeline, the param side
(all-gathers) and clipping."""
