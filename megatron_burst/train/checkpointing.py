"""Checkpoints in Megatron-LM's legacy layout, with Megatron-LM's RNG state.

    <root>/latest_checkpointed_iteration.txt           the iteration to resume from
    <root>/iter_XXXXXXX/mp_rank_TT/model_optim_rng.pt  one file per TP rank

Each file holds ``model``, ``optimizer``, ``opt_param_scheduler``, ``iteration``,
``consumed_samples``, the model-shape flags (``args``), and ``rng_state`` as Megatron-LM stores
it: a one-element list (no ``--data-parallel-random-init``) of python ``random``, numpy and torch
CPU generator states, plus the CUDA generator and megatron.core's CUDA RNG tracker states on GPU.
Parameters are full (CP-independent) per TP rank, so a checkpoint resumes at any CP and DP size.

With ``--bf16`` (``precision`` "bf16"), ``model`` holds the bf16 parameters (keys as without the
Float16Module / DDP wrappers, as Megatron-LM saves them) and ``optimizer`` megatron.core's
Float16OptimizerWithFloat16Params state: the AdamW moments and the fp32 main parameters
(``fp32_from_fp16_params``), so a resumed run continues from the exact fp32 values. A checkpoint
resumes only in the precision it was saved in (the optimizer states differ).
"""
from __future__ import annotations

import argparse
import os
import random
from typing import Any, Dict

import numpy as np
import torch
import torch.distributed as dist

import megatron_burst
from megatron_burst.train.setup import Groups, print_rank_0

CKPT_TRACKER = "latest_checkpointed_iteration.txt"
CKPT_FILE = "model_optim_rng.pt"
# Flags that fix parameter shapes and semantics: a checkpoint only loads when they match.
MODEL_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
               "num_query_groups", "kv_channels", "padded_vocab_size", "position_embedding_type",
               "normalization", "swiglu", "add_bias_linear", "untie_embeddings_and_output_weights",
               "tensor_model_parallel_size")
# Megatron-LM's key names inside each "rng_state" entry.
_HOST_RNG_KEYS = ("random_rng_state", "np_rng_state", "torch_rng_state")
_CUDA_RNG_KEYS = ("cuda_rng_state", "rng_tracker_states")


def _precision(args: argparse.Namespace) -> str:
    return "bf16" if getattr(args, "bf16", False) else "fp32"


def checkpoint_file(root: str, iteration: int, tp_rank: int) -> str:
    """Path of TP rank ``tp_rank``'s file of ``iteration`` under ``root``."""
    return os.path.join(root, f"iter_{iteration:07d}", f"mp_rank_{tp_rank:02d}", CKPT_FILE)


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def get_rng_state(device: torch.device) -> Dict[str, Any]:
    """This process's generator states under Megatron-LM's keys; the CUDA ones only on GPU."""
    state: Dict[str, Any] = {"random_rng_state": random.getstate(),
                             "np_rng_state": np.random.get_state(),
                             "torch_rng_state": torch.get_rng_state()}
    if device.type == "cuda":
        from megatron.core import tensor_parallel

        state["cuda_rng_state"] = torch.cuda.get_rng_state()
        state["rng_tracker_states"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def _check_rng_state(state: Dict[str, Any], device: torch.device, path: str) -> Dict[str, Any]:
    """The entry of ``state["rng_state"]`` this run restores; ValueError naming the fix if absent."""
    entries = state.get("rng_state")
    needed = _HOST_RNG_KEYS + (_CUDA_RNG_KEYS if device.type == "cuda" else ())
    missing = list(needed) if not entries else [k for k in needed if k not in entries[0]]
    if missing:
        raise ValueError(f"checkpoint {path} has no RNG state {', '.join(missing)} (saved with "
                         "--no-save-rng, on CPU for a GPU run, or by an older megatron-burst): "
                         "pass --no-load-rng to resume with the generators seeded by --seed")
    return entries[0]


def set_rng_state(entry: Dict[str, Any], device: torch.device) -> None:
    """Restore what :func:`get_rng_state` returned (the CUDA states only on GPU)."""
    random.setstate(entry["random_rng_state"])
    np.random.set_state(entry["np_rng_state"])
    torch.set_rng_state(entry["torch_rng_state"])
    if device.type == "cuda":
        from megatron.core import tensor_parallel

        torch.cuda.set_rng_state(entry["cuda_rng_state"])
        tensor_parallel.get_cuda_rng_tracker().set_states(entry["rng_tracker_states"])


def save_checkpoint(root: str, iteration: int, consumed_samples: int, model: torch.nn.Module, optimizer,
                    scheduler, args: argparse.Namespace, groups: Groups) -> None:
    """Write ``iteration``'s checkpoint (``consumed_samples`` samples trained so far): one file per
    TP rank, by the first data x context parallel rank (parameters do not depend on CP), then the
    tracker file (global rank 0)."""
    if dist.get_rank(groups.dp_cp) == 0:
        path = checkpoint_file(root, iteration, dist.get_rank(groups.tp))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        state = {
            "iteration": iteration, "consumed_samples": consumed_samples,
            "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "opt_param_scheduler": scheduler.state_dict(),
            "args": {k: getattr(args, k) for k in MODEL_FLAGS},
            "cp": {"context_parallel_size": args.context_parallel_size, "layout": args.cp_layout},
            "precision": _precision(args),
            "megatron_burst_version": megatron_burst.__version__,
        }
        if args.save_rng:
            state["rng_state"] = [get_rng_state(_model_device(model))]
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)  # never leave a half-written checkpoint under the real name
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(root, CKPT_TRACKER + ".tmp"), "w") as f:
            f.write(str(iteration))
        os.replace(os.path.join(root, CKPT_TRACKER + ".tmp"), os.path.join(root, CKPT_TRACKER))
    dist.barrier()


def load_checkpoint(root: str, model: torch.nn.Module, optimizer, scheduler,
                    args: argparse.Namespace, groups: Groups) -> tuple[int, int]:
    """Load the latest checkpoint under ``root``; returns (iteration, consumed samples), (0, 0)
    when there is none.

    Any CP and DP size; TP and the model flags must match the saved run's. The learning-rate
    schedule follows Megatron-LM: a schedule flag that differs from the checkpoint's is a
    ValueError unless ``--override-opt-param-scheduler`` (this run's flags win) or
    ``--use-checkpoint-opt-param-scheduler`` (the checkpoint's win) says which. Restores the
    saved RNG states on every rank unless ``args.load_rng`` is False (``--no-load-rng``).
    """
    tracker = os.path.join(root, CKPT_TRACKER)
    if not os.path.exists(tracker):
        print_rank_0(f"no checkpoint at {root} ({CKPT_TRACKER} missing): training from scratch")
        return 0, 0
    with open(tracker) as f:
        iteration = int(f.read().strip())
    iter_dir = os.path.dirname(os.path.dirname(checkpoint_file(root, iteration, 0)))
    saved_tp = len([d for d in os.listdir(iter_dir) if d.startswith("mp_rank_")]) if os.path.isdir(iter_dir) else 0
    if saved_tp != args.tensor_model_parallel_size:
        raise ValueError(f"checkpoint {iter_dir} holds {saved_tp} TP shard(s) but this run has "
                         f"--tensor-model-parallel-size {args.tensor_model_parallel_size}: resume "
                         "with a different --tensor-model-parallel-size is not supported (TP must "
                         "match; CP and DP may differ)")
    path = checkpoint_file(root, iteration, dist.get_rank(groups.tp))
    state = torch.load(path, map_location="cpu", weights_only=False)
    saved = state["args"]
    diff = [f"--{k.replace('_', '-')} saved {saved.get(k)!r} now {getattr(args, k)!r}"
            for k in MODEL_FLAGS if saved.get(k) != getattr(args, k)]
    if diff:
        raise ValueError(f"checkpoint {path} does not match this run: " + "; ".join(diff))
    saved_precision = state.get("precision", "fp32")  # checkpoints from before --bf16 are fp32
    if saved_precision != _precision(args):
        raise ValueError(f"checkpoint {path} was saved by a {saved_precision} run ("
                         f"{'with' if saved_precision == 'bf16' else 'without'} --bf16) but this run is "
                         f"{_precision(args)}: resume {'with' if saved_precision == 'bf16' else 'without'} --bf16 "
                         "(the optimizer states differ: bf16 keeps fp32 main parameters)")
    device = _model_device(model)
    rng = _check_rng_state(state, device, path) if args.load_rng else None  # before changing anything
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    try:  # after the optimizer: the scheduler sets the param groups' learning rate
        scheduler.load_state_dict(state["opt_param_scheduler"])
    except AssertionError as exc:
        raise ValueError(f"checkpoint {path}: {exc}. Pass --override-opt-param-scheduler to use this run's "
                         "learning-rate flags, or --use-checkpoint-opt-param-scheduler to keep the checkpoint's "
                         "(Megatron-LM's rule)") from None
    if rng is not None:
        set_rng_state(rng, device)
    consumed = int(state.get("consumed_samples", iteration * args.global_batch_size))
    print_rank_0(f"loaded checkpoint {path} (iteration {iteration}, {consumed} samples consumed, saved at CP="
                 f"{state['cp']['context_parallel_size']} layout {state['cp']['layout']}"
                 f"{'' if rng is not None else '; RNG states not restored (--no-load-rng)'})")
    return iteration, consumed
