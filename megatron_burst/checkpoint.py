"""public alias of megatron_burst.activation_store (the store of sequence-level selective
checkpointing; model checkpoints are megatron_burst.train.checkpointing). Import the new name."""
from megatron_burst.activation_store import *  # noqa: F401,F403  re-exports exactly its __all__
from megatron_burst.activation_store import __all__  # noqa: F401
