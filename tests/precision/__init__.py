"""Mixed precision (bf16 params on fp32 masters, loss scaling) and global grad-norm clipping."""
