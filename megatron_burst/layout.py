"""Public alias of megatron_burst.masks.layout (sequence layouts: which global tokens each CP rank
holds, balanced and THD placements, the causal/full mask of a fixed layout's block pair) and of
megatron_burst.masks.block (BlockMask, positions_visibility). Import the new names."""
from megatron_burst.masks import block as _block, layout as _layout
from megatron_burst.masks.block import *  # noqa: F401,F403  re-exports exactly its __all__
from megatron_burst.masks.layout import *  # noqa: F401,F403  re-exports exactly its __all__

__all__ = _layout.__all__ + _block.__all__
