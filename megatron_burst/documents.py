"""Public alias of megatron_burst.masks.documents (packed documents and their block rectangles), with
megatron_burst.masks.window (sliding windows), megatron_burst.masks.visible (visible_blocks) and the
document analytics of megatron_burst.masks.imbalance (``imbalance`` here is its
``document_imbalance``). Import the new names."""
from megatron_burst.masks import documents as _documents, visible as _visible, window as _window
from megatron_burst.masks.documents import *  # noqa: F401,F403  re-exports exactly its __all__
from megatron_burst.masks.imbalance import IMBALANCE_LAYOUTS, rank_pair_work, thd_padded  # noqa: F401
from megatron_burst.masks.imbalance import document_imbalance as imbalance  # noqa: F401
from megatron_burst.masks.visible import *  # noqa: F401,F403  re-exports exactly its __all__
from megatron_burst.masks.window import *  # noqa: F401,F403  re-exports exactly its __all__

__all__ = (_documents.__all__ + _window.__all__ + _visible.__all__
           + ["IMBALANCE_LAYOUTS", "imbalance", "rank_pair_work", "thd_padded"])
