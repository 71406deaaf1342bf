"""What every family shares: recipes, argument checks, the architecture probe and backend choice,
operand containers, error metrics and the Triton helpers the kernels share."""
