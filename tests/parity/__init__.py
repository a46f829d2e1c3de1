"""Same numbers as plain torch: the parity runs, the differential programs and their
regressions, optimizers that need whole params, and third-party element-wise optimizers."""
