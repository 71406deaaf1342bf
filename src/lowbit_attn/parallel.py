"""``lowbit_attn.parallel``: sequence-parallel attention over ``torch.distributed`` (the public
path of :mod:`lowbit_attn.integrations.parallel`)."""

from lowbit_attn.integrations.parallel import ring_attention, ulysses_attention

__all__ = ["ring_attention", "ulysses_attention"]
