"""What every family shares: recipes (and their encoding for the custom ops), argument checks, the
architecture probe and backend choice, the experimental kernel options, operand containers, error
metrics, the ops' call counters and the Triton helpers the kernels share."""
