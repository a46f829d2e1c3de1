"""The wrapper behaves as the torch optimizer it wraps, or refuses with an error that names the
fix: torch semantics, the ``torch.optim`` surface, unusual params and modules, grads edited after
backward, memory formats, ZeroRedundancyOptimizer's protocol, DDP habits and the error catalog."""
