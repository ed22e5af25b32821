"""Public alias of megatron_burst.masks.vertical_slash (vertical-slash sparse patterns and their tile
plans), with the pattern analytics of megatron_burst.masks.imbalance (``imbalance`` here is its
``pattern_imbalance``; ``pair_work``). Import the new names; patch module attributes (e.g.
``dense_column_for``) on megatron_burst.masks.vertical_slash, not on this alias."""
from megatron_burst.masks import vertical_slash as _vertical_slash
from megatron_burst.masks.imbalance import pair_work  # noqa: F401
from megatron_burst.masks.imbalance import pattern_imbalance as imbalance  # noqa: F401
from megatron_burst.masks.vertical_slash import *  # noqa: F401,F403  re-exports exactly its __all__

__all__ = _vertical_slash.__all__ + ["imbalance", "pair_work"]
