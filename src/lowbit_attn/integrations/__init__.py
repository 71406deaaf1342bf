"""Integrations with the frameworks users run, each an optional extra imported only when used:
``lowbit_attn.integrations.transformers`` (an attention implementation for Hugging Face models;
with ``transformers_cache``, a ``Cache`` whose K and V stay in the 8-bit paged KV cache) and
``lowbit_attn.integrations.diffusers`` (route a pipeline's attention to the kernels)."""
