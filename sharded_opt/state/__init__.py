"""State: conversions between the shards' per-param pieces and torch's per-param state dict, the
empty per-param state view, and each rank's pieces as DCP chunks."""
