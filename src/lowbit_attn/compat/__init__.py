"""Other libraries' call signatures on top of lowbit_attn: SageAttention 2.x
(:mod:`lowbit_attn.compat.sageattention`, and :func:`install_sageattention_alias` so that unedited
``from sageattention import sageattn`` code runs ours), FlashAttention 2 and 3
(:mod:`lowbit_attn.compat.flash_attn`, :mod:`lowbit_attn.compat.flash_attn_interface`) and
FastVideo's VSA (:mod:`lowbit_attn.compat.fastvideo`).
Nothing here computes on its own: every function checks its arguments, maps them to a recipe and
calls the public interface."""

from lowbit_attn.compat import fastvideo, flash_attn, flash_attn_interface, sageattention
from lowbit_attn.compat.alias import install_sageattention_alias, uninstall_sageattention_alias

__all__ = ["fastvideo", "flash_attn", "flash_attn_interface", "sageattention",
           "install_sageattention_alias", "uninstall_sageattention_alias"]
