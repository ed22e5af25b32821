"""Which kernel forms the local work of the linear-attention family: flash-linear-attention's
chunk kernels (self-checked, loud) or our plain-torch chunked path (the reference, and the CPU path).

The local work of one rank (its segments' outputs from a zero entering state, and for LASP the
states the segments leave) is one *op* per decay form:

* ``("lasp2", form)`` for :func:`megatron_burst.linear_attention` (LASP-2 and LASP-1 alike),
  ``form`` one of :data:`DECAY_FORMS`: "none", "head" ([h]), "token" ([s, b, h]), "channel"
  ([s, b, h, dk]) -- fla's ``chunk_simple_gla`` for the first three, ``chunk_gla`` for "channel";
* ``("gdn", "token")`` for :func:`megatron_burst.gated_delta_rule`: fla's ``chunk_gated_delta_rule``.

The exchange between ranks (LASP-2's all-gather and its scan, the delta rule's affine maps) stays
ours whatever runs locally (:mod:`megatron_burst.linear.fla_adapter` has the calls).

The decision (one per op, device, dtype, head dims, ``kernel`` argument and policy; memoized):

* ``kernel="torch"``: the torch path, never consulting fla.
* ``kernel="fla"``: fla, which must be installed (ValueError naming ``pip install
  flash-linear-attention`` otherwise), after its self-check on this device (any device).
* ``kernel="auto"`` (default): on a device type in
  :data:`megatron_burst.kernels.choice.FUSED_DEVICE_TYPES` (CUDA; tests add "cpu" to drive this
  path with a stand-in fla), fla when installed -- after a self-check on first use per (op, form,
  device, dtype, dk, dv) against our fp32 torch path, forward and backward, at an odd length
  crossing fla's 64-token chunks, two rows with their own decays (the delta rule's varlen check:
  three). A failure raises
  :class:`~megatron_burst.kernels.choice.KernelSelfCheckError` naming the kernel, device, dtype,
  head dims, decay form, shape and the chained exception; it is never silently replaced. fla not
  installed (or the op not covered: fp64) -> the torch path with a one-time
  :class:`~megatron_burst.kernels.choice.SlowKernelWarning` naming the op and the fix. On other
  devices (CPU) the torch path runs silently: it is the CPU path, not a fallback.

:class:`LinearKernelPolicy` (:meth:`LinearKernelPolicy.from_env`, the one place these variables are
read for linear ops) changes that:

* ``MEGATRON_BURST_LINEAR_KERNEL=torch|fla``: what ``kernel="auto"`` means everywhere (an explicit
  ``kernel=`` argument wins). ``torch`` is the opt-out of fla and of its self-check.
* ``MEGATRON_BURST_ALLOW_SLOW_KERNELS`` (shared with softmax attention, parsed by
  :meth:`megatron_burst.kernels.choice.KernelPolicy.from_env`): ``1`` -- a failed self-check under
  "auto" warns and the torch path runs; ``0`` -- a CUDA op without fla is an error
  (:class:`~megatron_burst.kernels.choice.SlowKernelError`) instead of a warning.

The error and warning classes are softmax attention's (one concept, one place): the GPU suite
treats any SlowKernelWarning as a failure, whichever op raised it.
"""
from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from megatron_burst import env
from megatron_burst.kernels import choice as attention_choice
from megatron_burst.kernels.choice import KernelSelfCheckError, SlowKernelError, SlowKernelWarning, remembered

__all__ = ["LINEAR_KERNELS", "DECAY_FORMS", "FLA_OPS", "FLA_DOCUMENT_OPS", "FLA_FIX", "LinearKernelPolicy", "LinearKernelChoice",
           "choose", "decay_form", "load_fla", "self_check", "report", "reset", "KernelSelfCheckError",
           "SlowKernelError", "SlowKernelWarning"]

logger = logging.getLogger("megatron_burst.linear")

LINEAR_KERNELS = ("auto", "torch", "fla")
DECAY_FORMS = ("none", "head", "token", "channel")
# (op, decay form) -> (fla module, function): the kernel that forms that op's local work
FLA_OPS: dict[tuple[str, str], tuple[str, str]] = {
    ("lasp2", "none"): ("fla.ops.simple_gla", "chunk_simple_gla"),
    ("lasp2", "head"): ("fla.ops.simple_gla", "chunk_simple_gla"),
    ("lasp2", "token"): ("fla.ops.simple_gla", "chunk_simple_gla"),
    ("lasp2", "channel"): ("fla.ops.gla", "chunk_gla"),
    ("gdn", "token"): ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
}
FLA_FIX = "pip install flash-linear-attention"
# the ops whose documents (cu_seqlens) fla takes: each rank's rows cut into pieces at the document
# starts, run by fla's varlen mode (megatron_burst.linear.fla_adapter); every op today
FLA_DOCUMENT_OPS = frozenset(FLA_OPS)
# forms whose fla backward runs the gated chunk_bwd_dqkwg kernel (g given per token), which fla 0.6
# refuses on Hopper with Triton 3.4 <= version < 3.7.1 (it computes wrong results there; fla issue
# #640). Seen on an H100 with torch 2.11 / Triton 3.6: a known refusal, so it is "not available
# here" (the torch path, loudly), not a failed self-check. "channel" (chunk_gla) is not gated so:
# its self-check decides.
GATED_BACKWARD_FORMS = {("lasp2", "head"), ("lasp2", "token"), ("gdn", "token")}
GATED_FIX = "upgrade Triton to >= 3.7.1 (or pip install tilelang), as fla's own message says"
FLA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # Triton has no fp64 dot
FORM_TEXT = {"none": "no decay", "head": "per-head decay", "token": "per-token decay",
             "channel": "per-channel decay"}


@dataclass(frozen=True)
class LinearKernelPolicy:
    """See the module docstring. ``forced``: None, "torch" or "fla" (what ``kernel="auto"`` means);
    ``allow_slow``: None (failed self-checks raise, a CUDA op without fla warns), True (both warn),
    False (both raise)."""

    forced: Optional[str] = None
    allow_slow: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.forced not in (None, "torch", "fla"):
            raise ValueError(f"MEGATRON_BURST_LINEAR_KERNEL={self.forced!r}: use torch (our chunked path everywhere) "
                             "or fla (flash-linear-attention's kernels, self-checked); unset: fla on CUDA when "
                             "installed")

    @classmethod
    def from_env(cls) -> "LinearKernelPolicy":
        """The policy from MEGATRON_BURST_LINEAR_KERNEL and MEGATRON_BURST_ALLOW_SLOW_KERNELS."""
        return cls(forced=env.linear_kernel(), allow_slow=env.allow_slow_kernels())


@dataclass(frozen=True)
class LinearKernelChoice:
    """The kernel one call runs: ``name`` "fla" or "torch" for ``op``/``form`` on
    ``device_type``/``dtype``/(``dk``, ``dv``); ``why`` says how it was decided. Hashable."""

    op: str
    form: str
    device_type: str
    dtype: torch.dtype
    dk: int
    dv: int
    name: str
    why: str = field(default="", compare=False)

    @property
    def uses_fla(self) -> bool:
        return self.name == "fla"

    def describe(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        kernel = "fla " + ".".join(FLA_OPS[(self.op, self.form)]) if self.uses_fla else "torch (chunked)"
        return (f"linear kernels: {self.op} {FORM_TEXT[self.form]} on {self.device_type} {dtype} dk {self.dk} "
                f"dv {self.dv}: {kernel} ({self.why})")


def decay_form(g: Optional[torch.Tensor]) -> str:
    """The decay form of a validated linear-attention log-decay: None, [h], [s, b, h], [s, b, h, dk]."""
    if g is None:
        return "none"
    return {1: "head", 3: "token", 4: "channel"}[g.dim()]


def load_fla(op: str, form: str) -> Optional[Callable]:
    """fla's function for (op, form), or None when flash-linear-attention is not installed.

    A broken install (fla present, but importing it fails: a missing dependency such as einops, a
    Triton without a driver) raises RuntimeError naming the import error: it is not "not installed"."""
    module_name, function = FLA_OPS[(op, form)]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] == "fla":
            return None
        raise RuntimeError(f"flash-linear-attention is installed but importing {module_name} failed: "
                           f"{type(e).__name__}: {e}. Fix: pip install {e.name} (fla's dependency)") from e
    except Exception as e:  # noqa: BLE001  re-raised with what was imported
        raise RuntimeError(f"flash-linear-attention is installed but importing {module_name} failed: "
                           f"{type(e).__name__}: {e}") from e
    fn = getattr(module, function, None)
    if fn is None:
        raise RuntimeError(f"{module_name} has no {function} (flash-linear-attention too old or too new: megatron-burst "
                           "calls it as in fla 0.6)")
    return fn


def _fla_flags() -> tuple[bool, bool, bool]:
    """fla's own (IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1); all False where this fla
    does not define them (its refusal does not exist there)."""
    try:
        utils = importlib.import_module("fla.utils")
    except Exception:  # noqa: BLE001  no or a broken fla: load_fla reports that
        return False, False, False
    names = ("IS_NVIDIA_HOPPER", "TRITON_ABOVE_3_4_0", "TRITON_ABOVE_3_7_1")
    if not all(hasattr(utils, n) for n in names):
        return False, False, False
    return tuple(bool(getattr(utils, n)) for n in names)  # type: ignore[return-value]


def fla_refusal(op: str, form: str) -> Optional[str]:
    """Why fla will refuse (op, form)'s backward on this machine before running it (None: it will not)."""
    if (op, form) not in GATED_BACKWARD_FORMS:
        return None
    hopper, above_3_4, above_3_7_1 = _fla_flags()
    if hopper and above_3_4 and not above_3_7_1:
        import triton

        return (f"fla refuses gated backward kernels on Hopper with Triton {triton.__version__} "
                "(3.4 <= Triton < 3.7.1 computes them wrong: fla issue #640)")
    return None


# ------------------------------------------------------------------------------------------ self-check
SELF_CHECK_LEN = 83  # odd, crosses fla's 64-token chunk boundary (a padded tail chunk)
SELF_CHECK_SEGMENTS = 2  # two rows, each with its own decays
SELF_CHECK_HEADS = 2


def _tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """(values, decay gradients) relative Frobenius bounds: fp32 allows fla's TF32 dots; 16-bit
    inputs round every product; the decay gradients sum differences of those (noisier)."""
    if dtype in (torch.float16, torch.bfloat16):
        return 2e-2, 5e-2
    return 5e-3, 1e-2


def _relative(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.detach().float(), ref.detach().float()
    if got.shape != ref.shape:
        return float("inf")
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _check_values(label: str, case: str, pairs: list[tuple[str, torch.Tensor, torch.Tensor]], dtype: torch.dtype,
                  fix: str) -> None:
    tol, tol_decay = _tolerances(dtype)
    for what, got, ref in pairs:
        bound = tol_decay if what.split()[-1] in ("dg", "dbeta") else tol
        if tuple(got.shape) != tuple(ref.shape):
            raise KernelSelfCheckError(f"{label} failed its self-check ({case}): {what} has shape {tuple(got.shape)}, "
                                       f"our fp32 torch path {tuple(ref.shape)}. {fix}")
        err = _relative(got, ref)
        if not err <= bound:
            raise KernelSelfCheckError(f"{label} failed its self-check ({case}): {what} is off our fp32 torch path "
                                       f"by {err:.3g} (relative; allowed {bound:g}). {fix}")


def _fix_hint(op: str) -> str:
    return ("Report it with your torch, triton and flash-linear-attention versions; to run anyway set "
            "MEGATRON_BURST_LINEAR_KERNEL=torch (our chunked kernels, slower) or MEGATRON_BURST_ALLOW_SLOW_KERNELS=1 "
            f"(warn and use them for {op})")


def _inputs(device, dtype, shape, generator, scale=1.0):
    return (torch.randn(*shape, generator=generator) * scale).to(device=device, dtype=dtype)


def _check_documents(device: torch.device, rows: int = SELF_CHECK_SEGMENTS):
    """(pieces, segment documents) of the varlen self-check: the rows are global segments 1, 2 (and
    3) of ``rows`` + 1 (83 tokens each); documents start inside row 0 (at its tokens 30 and 31: a
    single-token document) and at row 1's first token, so row 0 enters carried and row 1 fresh; a
    third row continues row 1's document whole (carried, one piece: a map A that is not zero)."""
    from megatron_burst.linear import fla_adapter
    from megatron_burst.linear.docs import segment_documents
    from megatron_burst.masks.documents import check_cu_seqlens

    if rows not in (2, 3):
        raise ValueError(f"the varlen self-check has 2 or 3 rows, not {rows}")
    L, order, total = SELF_CHECK_LEN, tuple(range(1, rows + 1)), rows + 1
    docs = check_cu_seqlens([0, L + 30, L + 31, 2 * L, total * L], total * L, 1)
    return (fla_adapter.row_pieces(docs, 1, order, total, device),
            segment_documents(docs, 1, order, total, device))


def _lasp2_check(fla_fn: Callable, form: str, device: torch.device, dtype: torch.dtype, dk: int, dv: int,
                 g_needs_grad: bool, documents: bool = False) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, fla value, fp32 torch value) for o, M and the gradients of q, k, v (and g);
    ``documents``: the rows cut into pieces by fla's varlen mode (:func:`_check_documents`)."""
    from megatron_burst.linear import fla_adapter
    from megatron_burst.linear.chunked import segment_output, segment_state
    from megatron_burst.linear.reference import expand_log_decay

    nseg, b, h, L = SELF_CHECK_SEGMENTS, 1, SELF_CHECK_HEADS, SELF_CHECK_LEN
    pieces, sd = _check_documents(device) if documents else (None, None)
    doc = None if sd is None else sd.doc  # [nseg, 1, 1, L]
    s = nseg * L
    gen = torch.Generator().manual_seed(0)
    q, k, v = (_inputs(device, dtype, (s, b, h, d), gen) for d in (dk, dk, dv))
    g = {"none": None,
         "head": -torch.tensor([0.05, 0.3])[:h],
         "token": -torch.rand(s, b, h, generator=gen) * 0.3,
         "channel": -torch.rand(s, b, h, dk, generator=gen) * 0.3}[form]
    g = None if g is None else g.to(device)
    do = _inputs(device, dtype, (nseg * b, L, h, dv), gen)
    dM = _inputs(device, torch.float32, (nseg * b, h, dk, dv), gen)
    scale = dk ** -0.5
    grads_of = ("q", "k", "v") + (("g",) if g is not None and g_needs_grad else ())

    leaves = {"q": q.clone().requires_grad_(), "k": k.clone().requires_grad_(), "v": v.clone().requires_grad_()}
    if g is not None:
        leaves["g"] = g.clone().requires_grad_(g_needs_grad)
    rows = {n: fla_adapter.to_rows(leaves[n], nseg, True) for n in ("q", "k", "v")}
    g_rows = fla_adapter.decay_rows(leaves.get("g"), form, nseg, b, L, True)
    o, M = fla_adapter.lasp2_segments(fla_fn, form, rows["q"], rows["k"], rows["v"], leaves.get("g"), g_rows, scale,
                                      pieces)
    got = torch.autograd.grad((o.float() * do.float()).sum() + (M * dM).sum(), [leaves[n] for n in grads_of])

    ref_leaves = {n: t.detach().float().requires_grad_(n in grads_of) for n, t in leaves.items()}
    to_seg = lambda t: t.permute(1, 2, 0, 3).reshape(b, h, nseg, L, t.shape[-1]).permute(2, 0, 1, 3, 4)  # noqa: E731
    qs, ks, vs = (to_seg(ref_leaves[n]) for n in ("q", "k", "v"))
    gs = None if g is None else to_seg(expand_log_decay(ref_leaves["g"], b, h, s, dk))
    ref_o = segment_output(qs, ks, vs, gs, scale, doc)  # [nseg, b, h, L, dv]
    ref_M = segment_state(ks, vs, gs, doc)[0]  # [nseg, b, h, dk, dv]
    ref_o_rows = ref_o.permute(0, 1, 3, 2, 4).reshape(nseg * b, L, h, dv)
    ref_M_rows = ref_M.reshape(nseg * b, h, dk, dv)
    ref = torch.autograd.grad((ref_o_rows * do.float()).sum() + (ref_M_rows * dM).sum(),
                              [ref_leaves[n] for n in grads_of])
    return [("out", o, ref_o_rows), ("final state", M, ref_M_rows)] + [
        (f"d{n}", a, r) for n, a, r in zip(grads_of, got, ref)]


GDN_DOCUMENT_ROWS = 3  # the delta rule's varlen self-check adds a carried whole row (its map A is not zero)


def _gdn_check(fla_fn: Callable, device: torch.device, dtype: torch.dtype, dk: int, dv: int,
               torch_terms: Callable, documents: bool = False) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, fla value, fp32 torch value) for both calls the CP gated delta rule makes into fla:
    the zero-start outputs of whole rows (one global segment; :func:`fla_adapter.gdn_rows`) and the
    wide call's o0, o_in, A and B (:func:`fla_adapter.gdn_terms`: several segments), each with the
    gradients of q, k, v, g and beta. ``torch_terms(q, k, v, g, beta, scale, doc, enter)``: our
    chunked path ([N, h, L, d] segments, g and beta [N, h, L], documents or None) -> (o0 [N, h, L, dv],
    o_in [N, h, L, dk], A, B) (delta.py passes it: the delta module imports this one, not the
    reverse). ``documents``: three rows cut into pieces by fla's varlen mode (:func:`_check_documents`)."""
    import torch.nn.functional as F

    from megatron_burst.linear import fla_adapter

    N = GDN_DOCUMENT_ROWS if documents else SELF_CHECK_SEGMENTS
    h, L = SELF_CHECK_HEADS, SELF_CHECK_LEN
    pieces, sd = _check_documents(device, N) if documents else (None, None)
    doc = None if sd is None else sd.doc.reshape(N, 1, L)  # broadcast over the heads
    enter = None if sd is None else sd.enter.reshape(N, 1)
    gen = torch.Generator().manual_seed(0)
    q = _inputs(device, dtype, (N, L, h, dk), gen)
    k = F.normalize(torch.randn(N, L, h, dk, generator=gen), dim=-1).to(device=device, dtype=dtype)
    v = _inputs(device, dtype, (N, L, h, dv), gen)
    # slow decays: A (and o_in at the rows' ends) stay far above rounding, so their gradients count
    g = (-torch.rand(N, L, h, generator=gen) * 0.05).to(device)
    beta = torch.rand(N, L, h, generator=gen).to(device=device, dtype=dtype)
    # cotangents of o0 (and the plain outputs), o_in, A, B
    cotangents = (_inputs(device, dtype, (N, L, h, dv), gen), _inputs(device, dtype, (N, L, h, dk), gen),
                  _inputs(device, torch.float32, (N, h, dk, dk), gen), _inputs(device, torch.float32, (N, h, dk, dv), gen))
    scale = dk ** -0.5
    names = ("q", "k", "v", "g", "beta")

    def grads(value: torch.Tensor, cotangent: torch.Tensor, leaves: list) -> list[torch.Tensor]:
        # one term at a time: a term's share of a gradient (A's: the identity columns) can be orders
        # of magnitude below another's, and a sum would hide it; zeros where a term does not depend
        got = torch.autograd.grad((value.float() * cotangent.float()).sum(), leaves, retain_graph=True,
                                  allow_unused=True)
        return [torch.zeros_like(x) if d is None else d for d, x in zip(got, leaves)]

    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
    o = fla_adapter.gdn_rows(fla_fn, *leaves, scale, pieces)
    got_plain = grads(o, cotangents[0], leaves)
    terms = fla_adapter.gdn_terms(fla_fn, *leaves, scale, pieces)
    got_wide = [grads(t, c, leaves) for t, c in zip(terms, cotangents)]

    ref_leaves = [t.detach().float().requires_grad_() for t in (q, k, v, g, beta)]
    seg = lambda t: t.permute(0, 2, 1, 3)  # noqa: E731  [N, L, h, d] <-> [N, h, L, d]
    o0, o_in, A, B = torch_terms(*(seg(t) for t in ref_leaves[:3]), *(t.permute(0, 2, 1) for t in ref_leaves[3:]),
                                 scale, doc, enter)
    ref_terms = (seg(o0), seg(o_in), A, B)
    ref_plain = grads(ref_terms[0], cotangents[0], ref_leaves)
    ref_wide = [grads(t, c, ref_leaves) for t, c in zip(ref_terms, cotangents)]
    pairs = [("out", o, ref_terms[0])] + [(f"d{n}", a, r) for n, a, r in zip(names, got_plain, ref_plain)]
    for term, got_t, ref_t, got_d, ref_d in zip(fla_adapter.GdnTerms._fields, terms, ref_terms, got_wide, ref_wide):
        pairs.append((f"wide call (maps): {term}", got_t, ref_t))
        pairs += [(f"wide call (maps), through {term}: d{n}", a, r) for n, a, r in zip(names, got_d, ref_d)]
    return pairs


def self_check(op: str, form: str, fla_fn: Callable, device: torch.device, dtype: torch.dtype, dk: int, dv: int,
               gdn_torch_terms: Optional[Callable] = None, documents: bool = False) -> None:
    """Run fla's kernel for (op, form) against our fp32 torch path on ``device``, forward and
    backward; raise KernelSelfCheckError naming kernel, device, dtype, head dims, form, shape and
    (chained) the exception or the value that is off. ``gdn_torch_terms``: the delta rule's
    torch path (op "gdn"; see :func:`_gdn_check`). ``documents``: fla's varlen mode, the path
    documents take (rows cut into pieces, :func:`_check_documents`), instead of whole rows."""
    if op == "gdn" and gdn_torch_terms is None:
        raise ValueError("self_check('gdn', ...) needs gdn_torch_terms (megatron_burst.linear.delta passes it)")
    module_name, function = FLA_OPS[(op, form)]
    label = (f"fla's {module_name}.{function} for {op} ({FORM_TEXT[form]}) on {device} / "
             f"{str(dtype).replace('torch.', '')} / dk {dk} dv {dv}")
    fix = _fix_hint(op)
    rows = GDN_DOCUMENT_ROWS if op == "gdn" and documents else SELF_CHECK_SEGMENTS
    shape = (f"{rows} rows x {SELF_CHECK_LEN} tokens x {SELF_CHECK_HEADS} heads"
             + (", documents (varlen cu_seqlens)" if documents else ""))
    variants = [True, False] if form == "head" else [True]  # head: g_gamma (fixed decay) and per-token g (learned)
    for g_needs_grad in variants:
        case = shape + ("" if form != "head" else (", decay learned (per-token g)" if g_needs_grad
                                                   else ", decay fixed (g_gamma)"))
        try:
            pairs = (_gdn_check(fla_fn, device, dtype, dk, dv, gdn_torch_terms, documents) if op == "gdn"
                     else _lasp2_check(fla_fn, form, device, dtype, dk, dv, g_needs_grad, documents))
        except KernelSelfCheckError:
            raise
        except Exception as e:  # surfaced, never swallowed: this is how a wrong call into fla shows
            raise KernelSelfCheckError(f"{label} raised in its self-check ({case}): {type(e).__name__}: {e}. "
                                       f"{fix}") from e
        _check_values(label, case, pairs, dtype, fix)


# ------------------------------------------------------------------------------------------ the decision
_VERIFIED: dict[tuple, object] = {}
_CHOSEN: dict[tuple, LinearKernelChoice] = {}
_LOGGED: dict[tuple, LinearKernelChoice] = {}


def _slow(op: str, form: str, device: torch.device, dtype: torch.dtype, dk: int, dv: int, reason: str, fix: str,
          policy: LinearKernelPolicy) -> LinearKernelChoice:
    message = (f"megatron-burst: {op} ({FORM_TEXT[form]}) on {device.type} / {str(dtype).replace('torch.', '')} / "
               f"dk {dk} dv {dv} runs our plain-torch chunked kernels ({reason}), many times slower than "
               f"flash-linear-attention's. Fix: {fix}")
    if policy.allow_slow is False:
        raise SlowKernelError(message + " (MEGATRON_BURST_ALLOW_SLOW_KERNELS=0 makes this an error)")
    # softmax attention's once-per-key memo: the GPU suite fails on any key starting with "slow"
    attention_choice._warn_once(("slow", "linear", op, form, device.type, dtype, dk, dv, reason), message)
    return LinearKernelChoice(op, form, device.type, dtype, dk, dv, "torch", f"slow: {reason}")


def choose(op: str, form: str, device: torch.device, dtype: torch.dtype, dk: int, dv: int, kernel: str = "auto",
           documents: bool = False, policy: Optional[LinearKernelPolicy] = None,
           load: Optional[Callable[[], Optional[Callable]]] = None, gdn_torch_terms: Optional[Callable] = None
           ) -> tuple[LinearKernelChoice, Optional[Callable]]:
    """The kernel for one call of ``op`` (``"lasp2"`` or ``"gdn"``) with decay ``form`` on
    (device, dtype, dk, dv): (the choice, fla's function or None). See the module docstring.

    ``documents``: the call has document boundaries (fla runs them through its varlen mode for the
    ops in :data:`FLA_DOCUMENT_OPS`; any other op takes the torch path, loudly on CUDA). ``load``: returns fla's function or None (default :func:`load_fla`; delta.py passes
    its own hook); ``gdn_torch_terms``: the delta rule's torch path for its self-check (op
    "gdn", from delta.py). Raises ValueError for an unknown kernel or ``kernel="fla"`` that cannot run,
    KernelSelfCheckError, SlowKernelError (strict policy)."""
    if kernel not in LINEAR_KERNELS:
        raise ValueError(f"unknown linear attention kernel {kernel!r}: choose one of {', '.join(LINEAR_KERNELS)}")
    if (op, form) not in FLA_OPS:
        raise ValueError(f"unknown linear op {op!r} with decay form {form!r}: one of {sorted(FLA_OPS)}")
    if kernel == "torch":  # asked for by name: fla is not consulted at all
        return LinearKernelChoice(op, form, device.type, dtype, dk, dv, "torch", "kernel='torch'"), None
    policy = policy or LinearKernelPolicy.from_env()
    fused = device.type in attention_choice.FUSED_DEVICE_TYPES
    requested = kernel if kernel != "auto" else (policy.forced or "auto")
    memo = (op, form, str(device), dtype, dk, dv, requested, documents, policy, fused)
    load = load or (lambda: load_fla(op, form))
    if memo in _CHOSEN:
        decided = _CHOSEN[memo]
        return decided, (load() if decided.uses_fla else None)
    decided, fn = _decide(op, form, device, dtype, dk, dv, requested, documents, policy, fused, load,
                          gdn_torch_terms)
    _CHOSEN[memo] = decided
    key = (op, form, device.type, dtype, dk, dv, policy)
    if _LOGGED.get(key) != decided:
        _LOGGED[key] = decided
        logger.info("megatron-burst: %s", decided.describe())
    return decided, fn


def _decide(op, form, device, dtype, dk, dv, requested, documents, policy, fused, load, gdn_torch_terms):
    torch_choice = lambda why: LinearKernelChoice(op, form, device.type, dtype, dk, dv, "torch", why)  # noqa: E731
    if requested == "torch":
        return torch_choice("MEGATRON_BURST_LINEAR_KERNEL=torch"), None
    if requested == "auto" and not fused:
        return torch_choice(f"the {device.type} path"), None
    what = f"kernel='fla' for {op} ({FORM_TEXT[form]})"
    if documents and (op, form) not in FLA_DOCUMENT_OPS:
        if requested == "fla":
            raise ValueError(f"{what} with documents (cu_seqlens) is not wired to fla's varlen kernels: use "
                             "kernel='torch' or 'auto'")
        return _slow(op, form, device, dtype, dk, dv, f"documents are not wired to fla's varlen kernels for {op} "
                     f"({FORM_TEXT[form]})", "none yet: train without documents or accept the torch path", policy), None
    if dtype not in FLA_DTYPES:
        if requested == "fla":
            raise ValueError(f"{what} takes fp32, bf16 or fp16 inputs, got {dtype}: use kernel='torch'")
        return _slow(op, form, device, dtype, dk, dv, f"fla's Triton kernels take no {dtype}",
                     "train in bf16 (Megatron: --bf16)", policy), None
    try:
        fn = load()
    except RuntimeError as e:  # a broken fla install is as loud as a failed self-check
        failure = KernelSelfCheckError(f"{what} on {device} / {dtype}: {e}. {_fix_hint(op)}")
        failure.__cause__ = e
        return _self_check_failed(op, form, device, dtype, dk, dv, requested, policy, failure)
    if fn is None:
        if requested == "fla":
            raise ValueError(f"{what} needs flash-linear-attention ({FLA_FIX}); use kernel='torch' or 'auto'")
        return _slow(op, form, device, dtype, dk, dv, "flash-linear-attention is not installed", FLA_FIX, policy), None
    refusal = fla_refusal(op, form)
    if refusal is not None:
        if requested == "fla":
            raise ValueError(f"{what}: {refusal}. Fix: {GATED_FIX}; or kernel='torch'")
        return _slow(op, form, device, dtype, dk, dv, refusal, GATED_FIX, policy), None
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    try:
        remembered(_VERIFIED, (op, form, name, str(device), dtype, dk, dv),
                   lambda: self_check(op, form, fn, device, dtype, dk, dv, gdn_torch_terms), KernelSelfCheckError)
        if documents:  # documents take fla's varlen mode: its own check, once per key as well
            remembered(_VERIFIED, (op, form, name, str(device), dtype, dk, dv, "documents"),
                       lambda: self_check(op, form, fn, device, dtype, dk, dv, gdn_torch_terms, documents=True),
                       KernelSelfCheckError)
    except KernelSelfCheckError as e:
        return _self_check_failed(op, form, device, dtype, dk, dv, requested, policy, e)
    return LinearKernelChoice(op, form, device.type, dtype, dk, dv, "fla", "self-checked"), fn


def _self_check_failed(op, form, device, dtype, dk, dv, requested, policy, error: KernelSelfCheckError):
    if requested == "fla" or not policy.allow_slow:
        raise error
    attention_choice._warn_once(("failed", "linear", op, form, str(device), dtype, dk, dv),
                                f"megatron-burst: {error} -- MEGATRON_BURST_ALLOW_SLOW_KERNELS=1, so our torch path "
                                "runs instead")
    return LinearKernelChoice(op, form, device.type, dtype, dk, dv, "torch",
                              "fla failed its self-check; MEGATRON_BURST_ALLOW_SLOW_KERNELS=1"), None


def report() -> list[str]:
    """One line per linear-kernel decision made in this process so far."""
    return sorted({c.describe() for c in _LOGGED.values()})


def reset() -> None:
    """Forget every self-check verdict, decision and log line of this process (tests); warnings
    live in :func:`megatron_burst.kernels.choice.reset`."""
    _VERIFIED.clear()
    _CHOSEN.clear()
    _LOGGED.clear()
