"""public alias of megatron_burst.cost_model (the cost model that picks CP algorithms, and its
planner CLI: ``python -m megatron_burst.plan`` runs ``python -m megatron_burst.cost_model``).
Import the new name."""
from megatron_burst.cost_model import *  # noqa: F401,F403  re-exports exactly its __all__
from megatron_burst.cost_model import __all__, main  # noqa: F401

if __name__ == "__main__":
    main()
