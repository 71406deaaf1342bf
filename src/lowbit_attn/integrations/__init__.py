"""Integrations with the frameworks users run, each an optional extra imported only when used:
``lowbit_attn.integrations.transformers`` (an attention implementation for Hugging Face models)
and ``lowbit_attn.integrations.diffusers`` (route a pipeline's attention to the kernels)."""
