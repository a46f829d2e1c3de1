"""What the tests share and are not tests themselves: running a function on N ranks, the parity
model and its loops, the random differential programs and their fuzzer, the user-loop harness,
the layout rules restated, fake accelerator streams, the soak run and the adapters' common
checks."""
