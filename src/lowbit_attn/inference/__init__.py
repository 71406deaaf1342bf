"""8-bit and FP4 inference attention (SageAttention 1/2/3), read top to bottom:
``interface`` (checks, the public functions) → ``op`` (custom ops, the kernel-or-naive choice) →
``prepare`` (quantized operands) → ``kernel_int8`` / ``kernel_fp4`` | ``naive`` (the twin)."""

from lowbit_attn.inference.interface import attention, attention_varlen

__all__ = ["attention", "attention_varlen"]
