"""Public alias of megatron_burst.masks.dynamic (MTraining's dynamic vertical-slash pattern: Dynamic,
estimate). Import the new name; patch ``megatron_burst.masks.dynamic.estimate`` (the engine calls
through that module), not this alias."""
from megatron_burst.masks.dynamic import *  # noqa: F401,F403  re-exports exactly its __all__
from megatron_burst.masks.dynamic import __all__  # noqa: F401
