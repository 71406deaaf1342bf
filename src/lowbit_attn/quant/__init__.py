"""The quantizers, each beside its PyTorch twin (``x.py`` Triton, ``x_naive.py`` the twin, bit for
bit): INT8 Q/K with fp16/FP8 V (``int8``), FP4 groups (``fp4``), FP4 attention operands
(``fp4_qkv``); ``tile`` holds the in-kernel INT8 tile quantizer the attention kernels share."""
