"""Trainable 8-bit attention (SageBwd), read top to bottom: ``interface`` → ``op`` (custom ops and
autograd) → ``prepare`` (quantized operands) → ``kernel_fwd`` / ``kernel_bwd`` | ``naive``."""

from lowbit_attn.training.interface import trainable_attention

__all__ = ["trainable_attention"]
