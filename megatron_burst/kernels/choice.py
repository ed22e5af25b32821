"""Which local kernel runs each mask kind: candidates, self-checks that fail loudly, one decision
per (device, dtype, head dim) shared by every rank of a CP group, and a line saying what runs.

On CUDA each mask kind has fused candidates in order of measured speed (:data:`GPU_CANDIDATES`):
torch's cuDNN and flash ops for "full" and "causal" blocks; for "positions" blocks torch's varlen
flash op where it computes the block exactly, else this package's Triton kernel (decided per block
by ``varlen_or_triton``, :mod:`megatron_burst.kernels.varlen_dispatch`); Triton kernels for the
rest. The first candidate that is installed (``unavailable()`` is None) and covers the dtype and
head dim (``supports(...)`` is None) must pass a self-check against the float64 reference on the
device, forward and backward, for every kind it will run. A candidate that fails raises
:class:`KernelSelfCheckError` naming the kernel, device, dtype, head dim and the original
exception. When no fused candidate covers a CUDA block, the plain-torch kernel runs with a
one-time :class:`SlowKernelWarning` naming the mask kind and the fix.

:class:`KernelPolicy` (built from the environment in :meth:`KernelPolicy.from_env`, the one place
these variables are read) changes that:

* ``MEGATRON_BURST_KERNEL=<name>``: run ``<name>`` (a key of ``megatron_burst.kernels.BACKENDS``)
  for every dense kind it covers; fused ones still check themselves.
* ``MEGATRON_BURST_SPARSE_KERNEL=torch|triton``: the kernel of vertical-slash tiles.
* ``MEGATRON_BURST_ALLOW_SLOW_KERNELS=1``: a failed self-check warns and the next candidate (at
  worst the plain-torch kernel) runs; ``=0``: a CUDA block without a fused kernel is an error too.

On CPU the choice is fixed (measured on the project's CPU machine, ``python -m
megatron_burst.bench kernels``): torch's fused CPU op forward, and backward in fp32; the tiled
kernel for 16-bit backward (the CPU op's bf16 backward is ~4x slower).
"""
from __future__ import annotations

import importlib
import logging
import math
import warnings
from dataclasses import dataclass, field
from types import ModuleType
from typing import Optional

import torch

from megatron_burst import env
from megatron_burst.masks.block import HeadBands

logger = logging.getLogger("megatron_burst.kernels")

DENSE_KINDS = ("full", "causal", "block_causal", "positions")
SPARSE_KINDS = ("sparse", "gather")
DIRECTIONS = ("forward", "backward")

# device types whose blocks choose among fused candidates (others: the fixed CPU choice)
FUSED_DEVICE_TYPES = ("cuda",)
# fused kernels per mask kind on CUDA, fastest first
GPU_CANDIDATES: dict[str, tuple[str, ...]] = {
    "full": ("cudnn", "cuda_flash", "triton_masked"),
    "causal": ("cudnn", "cuda_flash", "triton_masked"),
    "block_causal": ("triton_masked",),
    # per block: torch's varlen flash op where it is exact, else Triton (megatron_burst.kernels.varlen_dispatch)
    "positions": ("varlen_or_triton", "triton_masked"),
    "sparse": ("triton_block_sparse",),
    "gather": (),  # CUDA plans put every visible column in the Triton tiles (megatron_burst.masks.vertical_slash)
}
# the plain-torch kernel of each kind: any device, the reference for the fused ones
PLAIN: dict[str, str] = {"full": "tiled", "causal": "tiled", "block_causal": "tiled", "positions": "tiled",
                         "sparse": "block_sparse", "gather": "row_gather"}
MODULES: dict[str, str] = {
    "reference": "reference", "tiled": "tiled", "cpu_flash": "cpu_flash", "cuda_flash": "cuda_flash",
    "cudnn": "cudnn_sdpa", "triton_masked": "triton_masked", "block_sparse": "block_sparse",
    "row_gather": "row_gather", "triton_block_sparse": "triton_block_sparse", "cuda_varlen": "cuda_varlen",
    "varlen_or_triton": "varlen_dispatch",
}
DENSE_NAMES = ("reference", "tiled", "cpu_flash", "cuda_flash", "cudnn", "triton_masked", "cuda_varlen",
               "varlen_or_triton")
PLAIN_NAMES = ("reference", "tiled", "cpu_flash", "block_sparse", "row_gather")
SPARSE_NAMES = {"torch": "block_sparse", "triton": "triton_block_sparse"}


class KernelSelfCheckError(RuntimeError):
    """A fused kernel failed its self-check (an exception, or results off the reference)."""


class SlowKernelError(RuntimeError):
    """A CUDA block has no fused kernel and the policy forbids the plain-torch one."""


class SlowKernelWarning(UserWarning):
    """A CUDA block runs a plain-torch kernel (correct, many times slower than a fused one)."""


def module(name: str) -> ModuleType:
    """The kernel module registered as ``name``."""
    if name not in _MODULE_CACHE:
        if name not in MODULES:
            raise ValueError(f"unknown attention kernel {name!r}: choose one of {', '.join(MODULES)}")
        _MODULE_CACHE[name] = importlib.import_module(f"megatron_burst.kernels.{MODULES[name]}")
    return _MODULE_CACHE[name]


_MODULE_CACHE: dict[str, ModuleType] = {}


@dataclass(frozen=True)
class KernelPolicy:
    """How kernels are chosen (see the module docstring). ``allow_slow``: None (default) raises on a
    failed self-check and warns on a missing fused kernel; True warns on both; False raises on both."""

    forced: Optional[str] = None
    forced_sparse: Optional[str] = None
    allow_slow: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.forced is not None and self.forced not in DENSE_NAMES:
            raise ValueError(f"unknown attention kernel {self.forced!r}: choose one of {', '.join(DENSE_NAMES)}")
        if self.forced_sparse is not None and self.forced_sparse not in SPARSE_NAMES:
            raise ValueError(f"MEGATRON_BURST_SPARSE_KERNEL={self.forced_sparse!r}: choose one of "
                             f"{', '.join(SPARSE_NAMES)}")

    @classmethod
    def from_env(cls, forced: Optional[str] = None) -> "KernelPolicy":
        """The policy from the environment; ``forced`` (an API argument) wins over MEGATRON_BURST_KERNEL."""
        return cls(forced=forced or env.kernel(), forced_sparse=env.sparse_kernel(),
                   allow_slow=env.allow_slow_kernels())


@dataclass(frozen=True)
class KernelChoice:
    """The kernels one call runs: ``kernels`` maps mask kind -> (forward name, backward name), for
    ``device_type``/``dtype``/``head_dim``. Hashable; :meth:`describe` is the log line."""

    device_type: str
    dtype: torch.dtype
    head_dim: int
    kernels: tuple[tuple[str, str, str], ...] = field(default=())

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(k for k, _, _ in self.kernels)

    def get(self, kind: str, direction: str) -> Optional[str]:
        for k, fwd, bwd in self.kernels:
            if k == kind:
                return fwd if direction == "forward" else bwd
        return None

    def describe(self) -> str:
        parts = [f"{k}={fwd}" if fwd == bwd else f"{k}={fwd}/{bwd}" for k, fwd, bwd in self.kernels]
        dtype = str(self.dtype).replace("torch.", "")
        return f"attention kernels on {self.device_type} {dtype} head dim {self.head_dim}: {' '.join(parts)}"


# (kernel name, device, dtype, head dim) -> True, or the KernelSelfCheckError it raised
_VERIFIED: dict[tuple, object] = {}
_WARNED: set = set()
_LOGGED: dict[tuple, KernelChoice] = {}


def _self_check_cases(kind: str) -> list[dict]:
    """Small blocks exercising ``kind``: GQA 4/2, odd lengths, unequal q/kv lengths where the kind allows,
    and lengths in multiples of 64 (kernels that route odd shapes elsewhere, as cuDNN's adapter does,
    run their own path there)."""
    if kind == "full":
        return [dict(sq=48, sk=80), dict(sq=128, sk=192)]
    if kind == "causal":
        return [dict(sq=80, sk=80), dict(sq=128, sk=128)]
    if kind == "block_causal":
        return [dict(sq=80, sk=80, block=16)]
    pos = torch.arange(80)
    doc = (pos >= 30).long()
    striped = torch.arange(0, 96, 2)
    striped2 = torch.arange(0, 192, 2)
    # the rest of a block_causal block's stripes (masks.block.split_block_causal: band (-1, None),
    # stripes as documents) over every other position (so the Triton route runs it, as the engine's
    # blocks, whose stripes' last rows see nothing), without each stripe's last row (the reference
    # needs a visible pair per row)
    upper = striped2[striped2 % 32 != 30]
    # per-head bands with holes (a sparse pattern's gathered lines, its slash runs cut out) and
    # per-head columns: every head sees column 0, so no row is empty (the reference needs one pair)
    keys = (torch.arange(4)[:, None] + torch.arange(80)[None, :]) % 3 != 1
    keys[:, 0] = True
    holes = torch.tensor([[[3, 5], [9, 12]], [[1, 0], [1, 0]], [[10, 40], [1, 0]], [[1, 2], [60, 70]]])
    bands = HeadBands(torch.tensor([[90, 0], [20, 0], [90, 0], [90, 0]]), keys, holes)
    # documents + window on a diagonal block and an offset contiguous block: the varlen op's route
    # of varlen_or_triton; striped positions (no single diagonal), the stripes' rest and the bands:
    # its Triton route (all checked)
    return [dict(sq=80, sk=80, positions=(pos, pos, doc, doc, (20, 0))),
            dict(sq=40, sk=40, positions=(pos[40:], pos[:40], None, None, (None, 0))),
            dict(sq=48, sk=48, positions=(striped, striped, None, None, (None, 0))),
            dict(sq=90, sk=96, positions=(upper, striped2, upper // 32, striped2 // 32, (-1, None))),
            dict(sq=80, sk=80, positions=(pos, pos, None, None, bands))]


def _compare(name: str, what: str, got: torch.Tensor, ref: torch.Tensor, tol: float) -> Optional[str]:
    if tuple(got.shape) != tuple(ref.shape):
        return f"{what} has shape {tuple(got.shape)}, the reference {tuple(ref.shape)}"
    g, r = got.float(), ref.float()
    finite = torch.isfinite(r)
    if not torch.equal(torch.isfinite(g), finite):
        return f"{what} has non-finite values where the reference has none (or the reverse)"
    err = (g[finite] - r[finite]).abs().max().item() if finite.any() else 0.0
    scale = max(r[finite].abs().max().item() if finite.any() else 0.0, 1.0)
    if not err <= tol * scale:
        return f"{what} is off the float64 reference by {err:.3g} (allowed {tol * scale:.3g})"
    return None


def self_check(name: str, device: torch.device, dtype: torch.dtype, head_dim: int, kinds: tuple[str, ...]) -> None:
    """Run kernel ``name`` against the float64 reference on ``device`` for each dense kind in ``kinds``,
    forward and backward; raise KernelSelfCheckError naming what failed (the exception chained)."""
    from megatron_burst.kernels import reference

    impl = module(name)
    tol = 3e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-4
    g = torch.Generator().manual_seed(0)
    label = f"the {name} attention kernel on {device} / {dtype} / head dim {head_dim}"
    for kind in kinds:
        for case in _self_check_cases(kind):
            sq, sk, block = case["sq"], case["sk"], case.get("block", 1)
            mk = lambda h, s: torch.randn(1, h, s, head_dim, generator=g).to(device=device, dtype=dtype)  # noqa: E731
            q, k, v, do = mk(4, sq), mk(2, sk), mk(2, sk), mk(4, sq)
            extra = {"positions": case["positions"]} if "positions" in case else {}
            scale = 1.0 / math.sqrt(head_dim)
            try:
                # the reference in float64: exact whatever matmul precision the process allows (fp32
                # matmuls in TF32, e.g. under NVIDIA containers' TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1)
                ref_out, ref_lse = reference.forward(q.double(), k.double(), v.double(), kind, block, scale, **extra)
                D = (do.double() * ref_out).sum(-1)
                ref_grads = reference.backward(do.double(), q.double(), k.double(), v.double(), D, ref_lse, kind,
                                               block, scale, **extra)
                out, lse = impl.forward(q, k, v, kind, block, scale, **extra)
                grads = impl.backward(do, q, k, v, D.float(), ref_lse.float(), kind, block, scale, **extra)
            except Exception as e:  # surfaced, never swallowed: this is how a wrong call into an op shows
                raise KernelSelfCheckError(
                    f"{label} raised in its self-check ({kind} block {sq}x{sk}): {type(e).__name__}: {e}. "
                    f"{_fix_hint(name)}") from e
            for what, a, b in (("out", out, ref_out), ("lse", lse, ref_lse), ("dq", grads[0], ref_grads[0]),
                               ("dk", grads[1], ref_grads[1]), ("dv", grads[2], ref_grads[2])):
                problem = _compare(name, what, a, b, tol)
                if problem:
                    raise KernelSelfCheckError(f"{label} failed its self-check ({kind} block {sq}x{sk}): {problem}. "
                                               f"{_fix_hint(name)}")


def _fix_hint(name: str) -> str:
    return (f"Report it with your torch version ({torch.__version__}); to run anyway, pick another kernel "
            f"(MEGATRON_BURST_KERNEL=<name>) or set MEGATRON_BURST_ALLOW_SLOW_KERNELS=1 to fall back past {name} "
            "with a warning")


def _sparse_self_check(name: str, device: torch.device, dtype: torch.dtype) -> None:
    impl = module(name)
    try:
        ok = impl.verify(device, dtype)
    except Exception as e:
        raise KernelSelfCheckError(f"the {name} attention kernel on {device} / {dtype} raised in its self-check: "
                                   f"{type(e).__name__}: {e}. {_fix_hint(name)}") from e
    if not ok:
        raise KernelSelfCheckError(f"the {name} attention kernel on {device} / {dtype} failed its self-check "
                                   f"against block_sparse. {_fix_hint(name)}")


def checked(name: str, device: torch.device, dtype: torch.dtype, head_dim: int, kinds: tuple[str, ...]) -> None:
    """Self-check ``name`` once per (device, dtype, head dim, kind); re-raise a remembered failure."""
    for kind in kinds:
        if kind in SPARSE_KINDS:
            run = lambda: _sparse_self_check(name, device, dtype)  # noqa: E731
        else:
            run = lambda: self_check(name, device, dtype, head_dim, (kind,))  # noqa: E731
        remembered(_VERIFIED, (name, str(device), dtype, head_dim, kind), run, KernelSelfCheckError)


def remembered(verdicts: dict, key: tuple, check, error: type) -> None:
    """Run ``check()`` once per ``key``: remember success, or the ``error`` it raised and raise it
    again on every later call (a self-check runs once per process; its failure stays loud)."""
    if key not in verdicts:
        try:
            check()
            verdicts[key] = True
        except error as e:
            verdicts[key] = e
    if verdicts[key] is not True:
        raise verdicts[key]


def _cpu_choice(kind: str, dtype: torch.dtype, policy: KernelPolicy) -> tuple[str, str]:
    if kind in SPARSE_KINDS:
        if kind == "sparse" and policy.forced_sparse is not None:
            name = SPARSE_NAMES[policy.forced_sparse]
            return name, name
        return PLAIN[kind], PLAIN[kind]
    if policy.forced is not None:
        return policy.forced, policy.forced
    # the CPU op's backward takes fp32 only (fp64 exactness runs and 16-bit inputs: tiled)
    return "cpu_flash", ("cpu_flash" if dtype == torch.float32 else "tiled")


def _kind_supported(name: str, dtype: torch.dtype, head_dim: int, kind: str) -> Optional[str]:
    """Why kernel ``name`` cannot run (dtype, head dim, kind) here (None: it can)."""
    impl = module(name)
    why = impl.unavailable() if hasattr(impl, "unavailable") else None
    if why is None and hasattr(impl, "supports"):
        why = impl.supports(dtype, head_dim, kind)
    return why


def _forced_name(kind: str, dtype: torch.dtype, head_dim: int, policy: KernelPolicy) -> Optional[str]:
    """The kernel the policy forces for ``kind`` (None: choose). A forced fused kernel applies to the
    kinds it covers; the others are chosen as usual."""
    if kind == "sparse" and policy.forced_sparse is not None:
        return SPARSE_NAMES[policy.forced_sparse]
    if kind in DENSE_KINDS and policy.forced is not None:
        if policy.forced in PLAIN_NAMES or _kind_supported(policy.forced, dtype, head_dim, kind) is None:
            return policy.forced
    return None


def _gpu_choice(kind: str, device: torch.device, dtype: torch.dtype, head_dim: int, policy: KernelPolicy) -> str:
    forced = _forced_name(kind, dtype, head_dim, policy)
    if forced in PLAIN_NAMES:
        return forced  # a plain kernel asked for by name: no warning
    candidates = (forced,) if forced is not None else GPU_CANDIDATES[kind]
    reasons = []
    for name in candidates:
        why = _kind_supported(name, dtype, head_dim, kind)
        if why is not None:
            reasons.append(f"{name}: {why}")
            continue
        try:
            checked(name, device, dtype, head_dim, (kind,))
            return name
        except KernelSelfCheckError as e:
            if not policy.allow_slow:
                raise
            reasons.append(f"{name}: failed its self-check")
            _warn_once(("failed", name, str(device), dtype, head_dim),
                       f"megatron-burst: {e} -- MEGATRON_BURST_ALLOW_SLOW_KERNELS=1, so the next kernel runs instead")
    plain = PLAIN[kind]
    message = (f"megatron-burst: no fused kernel runs {kind!r} blocks on {device.type} / {dtype} / head dim {head_dim} "
               f"({'; '.join(reasons) or 'none exists'}); the plain-torch {plain} kernel runs them, many times slower. "
               f"{_slow_fix(kind, dtype, failed=any('self-check' in r for r in reasons))}")
    if policy.allow_slow is False:
        raise SlowKernelError(message + " (MEGATRON_BURST_ALLOW_SLOW_KERNELS=0 makes this an error)")
    _warn_once(("slow", kind, device.type, dtype, head_dim), message)
    return plain


def _slow_fix(kind: str, dtype: torch.dtype, failed: bool = False) -> str:
    if failed:
        return "Fix: the self-check failure warned above (report it with your torch and triton versions)."
    if dtype not in (torch.float16, torch.bfloat16):
        return "Fix: train in bf16 (Megatron: --bf16); fused kernels take 16-bit inputs."
    if kind in ("block_causal", "positions", "sparse"):
        return "Fix: pip install triton (the Triton kernels cover this mask)."
    return "Fix: use a head dim that is a multiple of 8 up to 256, or install triton."


def _warn_once(key: tuple, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, SlowKernelWarning, stacklevel=4)
        logger.warning(message)


def choose(device: torch.device, dtype: torch.dtype, head_dim: int, kinds: tuple[str, ...],
           policy: Optional[KernelPolicy] = None) -> KernelChoice:
    """The kernels for blocks of ``kinds`` on (device, dtype, head dim), self-checked, logged once.
    Every CP call (each layer, each step) asks: the decision is kept per arguments and policy."""
    policy = policy or KernelPolicy.from_env()
    memo = (str(device), dtype, head_dim, tuple(kinds), policy, device.type in FUSED_DEVICE_TYPES)
    if memo in _CHOSEN:
        return _CHOSEN[memo]
    rows = []
    for kind in kinds:
        if kind not in GPU_CANDIDATES:
            raise ValueError(f"unknown mask kind {kind!r}: one of {', '.join(GPU_CANDIDATES)}")
        if device.type in FUSED_DEVICE_TYPES:
            name = _gpu_choice(kind, device, dtype, head_dim, policy)
            rows.append((kind, name, name))
        else:
            rows.append((kind,) + _cpu_choice(kind, dtype, policy))
    choice = KernelChoice(device.type, dtype, head_dim, tuple(rows))
    key = (choice.device_type, dtype, head_dim, tuple(kinds), policy)
    if _LOGGED.get(key) != choice:
        _LOGGED[key] = choice
        logger.info("megatron-burst: %s", choice.describe())
    _CHOSEN[memo] = choice
    return choice


_CHOSEN: dict[tuple, KernelChoice] = {}


def report() -> list[str]:
    """One line per kernel decision made in this process so far (the trainer prints them)."""
    return sorted({c.describe() for c in _LOGGED.values()})


def agree(choice: KernelChoice, group=None) -> None:
    """Check that every rank of ``group`` runs the same kernels (once per group and choice): a rank
    whose self-check fell back (MEGATRON_BURST_ALLOW_SLOW_KERNELS=1) or whose environment forces
    another kernel would otherwise compute a different rounding of the same attention. Raises
    RuntimeError listing each rank's choice. A no-op without torch.distributed or for one rank."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return
    world = dist.get_world_size(group)
    if world == 1:
        return
    # keyed by what every rank shares (the call's shape), never by the local choice: a rank whose
    # choice differs must still reach the same all-gather as the others
    key = (id(group) if group is not None else None, world, choice.device_type, choice.dtype, choice.head_dim,
           choice.kinds)
    if key in _AGREED:
        return
    text = choice.describe().encode()[:AGREE_BYTES]
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(dist.get_backend(group)) else torch.device("cpu")
    mine = torch.zeros(AGREE_BYTES, dtype=torch.uint8)
    if text:
        mine[:len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    gathered = [torch.empty_like(mine, device=device) for _ in range(world)]
    dist.all_gather(gathered, mine.to(device), group=group)
    texts = [bytes(t.cpu().tolist()).rstrip(b"\0").decode(errors="replace") for t in gathered]
    if len(set(texts)) > 1:
        lines = "\n".join(f"  rank {r}: {t}" for r, t in enumerate(texts))
        raise RuntimeError("megatron-burst: the ranks of this context-parallel group chose different attention "
                           f"kernels:\n{lines}\nSet the same MEGATRON_BURST_* kernel variables on every rank, or fix "
                           "the self-check failure the differing rank warned about")
    _AGREED.add(key)


AGREE_BYTES = 512
_AGREED: set = set()


def reset() -> None:
    """Forget every self-check verdict, warning, log line and agreement of this process (tests)."""
    _VERIFIED.clear()
    _WARNED.clear()
    _LOGGED.clear()
    _AGREED.clear()
    _CHOSEN.clear()
