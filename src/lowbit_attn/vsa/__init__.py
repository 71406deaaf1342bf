"""Video sparse attention (VSA), read top to bottom: ``interface`` (the public functions) → ``op``
(custom ops and autograd) → ``kernel_fine`` / ``kernel_tiles`` | ``naive``; ``tiles`` lays a
video's tokens out in tiles."""

from lowbit_attn.vsa.interface import (
    TOKEN_ORDERS, VSA_RECIPES, coarse, fine, resolve_topk, topk_schedule, video_sparse_attention,
)

__all__ = [
    "TOKEN_ORDERS", "VSA_RECIPES", "coarse", "fine", "resolve_topk", "topk_schedule",
    "video_sparse_attention",
]
