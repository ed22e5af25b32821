"""Public import path of :mod:`megatron_burst.megatron.specs` (the layer specs live with the rest of
the Megatron glue under ``megatron_burst/megatron/``).

``megatron_burst.specs`` *is* that module (one object under both names), so
``--spec megatron_burst.specs gpt_layer_spec``, ``from megatron_burst.specs import ...`` and
attributes set on either name keep working.
"""
import sys

from megatron_burst.megatron import specs as _specs

sys.modules[__name__] = _specs
