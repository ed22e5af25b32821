"""Public alias of megatron_burst.masks.dispatch (the balanced dispatch planner for packed documents:
plan_dispatch, DispatchPlan). Import the new name."""
from megatron_burst.masks.dispatch import *  # noqa: F401,F403  re-exports exactly its __all__
from megatron_burst.masks.dispatch import __all__  # noqa: F401
