"""``--bf16``: Megatron-Core's mixed precision, set up as Megatron-LM's ``megatron/training`` does.

What Megatron-LM builds for ``--bf16`` (``get_model``, ``setup_model_and_optimizer``, ``train_step``),
and what this module builds from the same megatron.core pieces:

* **Model:** ``TransformerConfig(bf16=True, params_dtype=torch.bfloat16)`` creates the parameters in
  bf16 (with CPU initialization each weight is drawn in fp32 from the seed and rounded once, so the
  initial weights still do not depend on TP or CP), and the model is wrapped in
  ``megatron.core.transformer.module.Float16Module`` (bf16 inputs on the first stage, fp32 outputs
  on the last). Activations are bf16; megatron-burst's attention merges blocks in fp32 and rounds
  its output once (README: Numerics).
* **Gradients:** ``megatron.core.distributed.DistributedDataParallel`` with
  ``grad_reduce_in_fp32=True`` (Megatron-LM forces ``--accumulate-allreduce-grads-in-fp32`` for bf16):
  every parameter gets an fp32 ``main_grad`` view of one contiguous buffer; the backward hook adds each
  microbatch's bf16 ``.grad`` into it, and ``finalize_model_grads`` all-reduces the fp32 buffer over
  data x context parallel ranks. ``TransformerConfig.calculate_per_token_loss=True`` makes that
  all-reduce a sum (no 1/DP scaling): :func:`megatron_burst.train.step.loss_and_grads` already divides
  by the global batch's loss tokens, Megatron-LM's per-token loss.
* **Optimizer:** ``megatron.core.optimizer.get_megatron_optimizer(OptimizerConfig(bf16=True, ...))``:
  ``Float16OptimizerWithFloat16Params`` keeps an fp32 main copy of every bf16 parameter, takes the fp32
  ``main_grad`` as its gradient, clips by the global L2 norm (Megatron's ``clip_grad_norm``), steps
  torch's AdamW (megatron.core's fallback without TransformerEngine or Apex; no weight decay on
  biases and 1-D parameters, Megatron's default groups) on the fp32 copies, and rounds them back into
  the bf16 model. No loss scaling (bf16 needs none; ``--fp16`` is refused).

On GPU these run as they are. On CPU (gloo), megatron.core's DDP buffers, optimizer and gradient
clipping hard-code CUDA in a few places (buffers on ``torch.cuda.current_device()``, ``device='cuda'``
scalars, ``param.type() == 'torch.cuda.FloatTensor'`` checks): :func:`cuda_calls_on_cpu` runs those
calls with 'cuda' meaning the CPU, so the same code paths run on CPU. The model's forward and backward
never run under it.
"""
from __future__ import annotations

import argparse
import contextlib
from typing import Iterator, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode


class _CudaMeansCpu(TorchFunctionMode):
    """torch calls with ``device='cuda'`` (or a CUDA index) allocate on the CPU instead, and
    ``tensor.type()`` names CPU tensors as CUDA ones ('torch.cuda.BFloat16Tensor'), which is what
    megatron.core's optimizer checks parameters and gradients against."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        device = kwargs.get("device")
        if device is not None and _is_cuda(device):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


def _is_cuda(device) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


@contextlib.contextmanager
def cuda_calls_on_cpu(device: torch.device) -> Iterator[None]:
    """Run megatron.core's DDP / optimizer calls for a model on ``device``: on a CUDA device, as they
    are; on the CPU, with 'cuda' allocations placed on the CPU and ``torch.cuda.current_device()``
    returning 'cpu' (see the module docstring). Not re-entrant across threads; scoped to the calls."""
    if device.type != "cpu":
        yield
        return
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        with _CudaMeansCpu():
            yield
    finally:
        torch.cuda.current_device = saved


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside megatron.core's DistributedDataParallel and Float16Module wrappers (the
    fp32 path's model is returned as it is)."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    while isinstance(model, (DistributedDataParallel, Float16Module)):
        model = model.module
    return model


def ddp_config():
    """Megatron-LM's DistributedDataParallelConfig for --bf16 without the distributed optimizer or
    communication overlap (which this trainer does not implement): fp32 gradient accumulation and
    all-reduce, one bucket per dtype, a plain sum over data x context parallel ranks."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                         overlap_param_gather=False, use_distributed_optimizer=False,
                                         check_for_nan_in_grad=False, average_in_collective=False)


def wrap_model(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Float16Module(model) inside DistributedDataParallel, as Megatron-LM's ``get_model`` wraps a
    bf16 model. ``model`` must have been built with ``config.bf16`` and
    ``config.calculate_per_token_loss``."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    config = model.config
    if not (config.bf16 and config.params_dtype == torch.bfloat16 and config.calculate_per_token_loss):
        raise ValueError("wrap_model needs a model built with TransformerConfig(bf16=True, params_dtype=bfloat16, "
                         "calculate_per_token_loss=True)")
    with cuda_calls_on_cpu(device):
        # process groups from megatron.core.parallel_state, as Megatron-LM's get_model
        return DistributedDataParallel(config, ddp_config(), Float16Module(config, model))


def optimizer_config(args: argparse.Namespace):
    """megatron.core's OptimizerConfig from the trainer's flags (Megatron-LM's names): Adam with decoupled
    weight decay (AdamW), bf16 with fp32 main parameters, no loss scale."""
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                           adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
                           bf16=True, params_dtype=torch.bfloat16, use_distributed_optimizer=False,
                           clip_grad=args.clip_grad, log_num_zeros_in_grad=args.log_num_zeros_in_grad,
                           decoupled_weight_decay=True)


def build_optimizer(args: argparse.Namespace, model: torch.nn.Module, device: torch.device):
    """``get_megatron_optimizer`` for the DDP-wrapped bf16 ``model``, as Megatron-LM calls it: a
    ChainedOptimizer holding one Float16OptimizerWithFloat16Params (fp32 main parameters) over torch's
    AdamW (the dense parameters; this trainer has no expert-parallel ones)."""
    from megatron.core.optimizer import Float16OptimizerWithFloat16Params, get_megatron_optimizer

    with cuda_calls_on_cpu(device):
        optimizer = get_megatron_optimizer(optimizer_config(args), [model], use_gloo_process_groups=False)
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(inner) != 1 or not isinstance(inner[0], Float16OptimizerWithFloat16Params):
        raise RuntimeError("expected megatron.core's Float16OptimizerWithFloat16Params for --bf16, got "
                           f"{[type(o).__name__ for o in inner]}")
    return optimizer


def zero_grads(model: torch.nn.Module, optimizer) -> None:
    """Megatron-LM's train_step start: zero the fp32 gradient buffers and the optimizer's grads."""
    model.zero_grad_buffer()
    optimizer.zero_grad()


def reduce_and_step(model: torch.nn.Module, optimizer, args: argparse.Namespace,
                    device: torch.device) -> Tuple[float, Optional[int]]:
    """After the backward of every microbatch: megatron.core's ``finalize_model_grads`` (the fp32
    all-reduce over data x context parallel ranks), then the optimizer step (main grads, clipping,
    zero count, AdamW on the fp32 main parameters, copy back to bf16). Returns the gradient L2 norm
    before clipping and, with --log-num-zeros-in-grad, the zero count after it."""
    from megatron.core.distributed import finalize_model_grads

    with cuda_calls_on_cpu(device):
        finalize_model_grads([model])
        # ChainedOptimizer.step: main grads, global norm (also with --clip-grad 0), clip, zeros, AdamW
        ok, grad_norm, num_zeros = optimizer.step()
    if not ok:  # only with a loss scaler (fp16), which --bf16 does not use
        raise RuntimeError("megatron.core's optimizer skipped the step (inf/nan in the gradients)")
    return float(grad_norm), (int(num_zeros) if args.log_num_zeros_in_grad else None)


def float16_optimizer(optimizer):
    """The Float16OptimizerWithFloat16Params inside :func:`build_optimizer`'s ChainedOptimizer."""
    return getattr(optimizer, "chained_optimizers", [optimizer])[0]


def main_params(optimizer) -> list:
    """(bf16 model parameter, its fp32 main parameter) pairs of the optimizer."""
    inner = float16_optimizer(optimizer)
    return [(model_param, main_param)
            for model_group, main_group in zip(inner.float16_groups, inner.fp32_from_float16_groups)
            for model_param, main_param in zip(model_group, main_group)]
