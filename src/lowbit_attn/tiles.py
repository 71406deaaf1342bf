"""``lowbit_attn.tiles``: a video's tokens in tile order and back (the public path of
:mod:`lowbit_attn.vsa.tiles`)."""

from lowbit_attn.vsa.tiles import TileLayout, from_tile_order, tile_layout, to_tile_order

__all__ = ["TileLayout", "from_tile_order", "tile_layout", "to_tile_order"]
