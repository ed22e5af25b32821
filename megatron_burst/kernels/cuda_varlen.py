"""torch's varlen flash-attention ops (``aten._flash_attention_forward`` / ``_backward`` with
cumulative sequence lengths and a sliding window), fp16/bf16 on CUDA, for the "positions" blocks
they express exactly.

A "positions" block (see :class:`megatron_burst.masks.block.BlockMask`) lets row i see column j iff
q_pos[i] - left <= kv_pos[j] <= q_pos[i] + right (band (left, right), a None bound unbounded) and,
with documents, q_doc[i] == kv_doc[j]. The varlen op runs independent segments: q rows
[cu_q[s], cu_q[s+1]) against kv rows [cu_k[s], cu_k[s+1]), with one window (wl, wr) for all of
them, aligned bottom-right per segment: row i of a segment (lq rows, lk columns) sees column j iff

    i + (lk - lq) - wl <= j <= i + (lk - lq) + wr        (-1: that side unbounded)

:func:`block_plan` turns a block's vectors into segments (the document runs, the same documents in
the same order on both sides) and one (wl, wr) pair, and refuses (returns the reason) when the op's
mask would differ from the block's anywhere, when some row would see nothing (the op would give lse
+inf there, not -inf), or when the alignment differs between documents. Within a segment whose band
bound binds, positions must be runs of consecutive integers on both sides (then the bound is a
shifted diagonal, as the op's); a bound that holds for every pair of a segment constrains nothing
but "wide enough". The plan is computed from the CPU vectors (no device sync) and cached per block
(the engine's masks are cached, so the same vector objects return every step).

The common blocks are all eligible: a rank's diagonal block with any number of documents (same
positions both sides: causal per document), sliding windows over contiguous ranges, and both
together. Others (striped or zigzag positions inside one document, ...) go to the Triton kernel
(:mod:`megatron_burst.kernels.varlen_dispatch`).

b > 1 runs one op call per sample (q, k, v are [b, h, s, d] views of Megatron's sbhd tensors; a
sample's [s, h, d] view has a unit-stride last dim, which is all the op needs, so nothing is
copied). The op takes hkv dividing hq natively (no expanded K, V). Its lse is [h, total_q] in
recent builds and [segments, h, max_q] in older ones: both are read and written.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Union

import torch

from megatron_burst.kernels import torch_ops
from megatron_burst.kernels.cpu_flash import stand_in_output
from megatron_burst.kernels.rows import unit_last
from megatron_burst.masks.block import HeadBands

NAME = "cuda_varlen"
KINDS = ("positions",)
TAKES_OUT = True  # the backward reads the final output O (out=) instead of D
MAX_HEAD_DIM = 256
_FWD = "_flash_attention_forward"
_BWD = "_flash_attention_backward"
_FWD_ARGS = ("query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal",
             "return_debug_mask", "scale", "window_size_left", "window_size_right")
_BWD_ARGS = ("grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k", "max_q", "max_k",
             "dropout_p", "is_causal", "scale", "window_size_left", "window_size_right")
# the backward's two RNG arguments (what the forward returns third and fourth): renamed in torch 2.7+
_RNG_NAMES = (("rng_state", "unused"), ("philox_seed", "philox_offset"))
PLAN_CACHE = 4096  # blocks whose plans are kept (one per distinct mask of a run)


# --------------------------------------------------------------------------------- block plans


@dataclass(frozen=True)
class VarlenPlan:
    """How the varlen op computes one "positions" block exactly.

    cu_q / cu_k: segment boundaries in the block's rows / columns (0, ..., sq) and (0, ..., sk);
    max_q / max_k: the longest segment; left / right: window_size_left / right as the op applies
    them (-1: unbounded; the op's own rule that a window >= max_k is unbounded already applied).
    """

    cu_q: tuple[int, ...]
    cu_k: tuple[int, ...]
    max_q: int
    max_k: int
    left: int
    right: int

    @property
    def causal(self) -> bool:
        """is_causal for the op: torch's varlen_attn sets it exactly for the window (-1, 0)."""
        return self.left == -1 and self.right == 0


def flash_visibility(plan: VarlenPlan, sq: int, sk: int) -> torch.Tensor:
    """Boolean [sq, sk]: what the op sees for ``plan`` (FlashAttention-2's rules, written out for the
    tests: a window >= max_k is unbounded; is_causal forces right = 0; then, when exactly one side
    is bounded, the open side becomes a window of max_k)."""
    left = -1 if plan.left >= plan.max_k else plan.left
    right = 0 if plan.causal else (-1 if plan.right >= plan.max_k else plan.right)
    if (left < 0) != (right < 0):
        left, right = (plan.max_k, right) if left < 0 else (left, plan.max_k)
    vis = torch.zeros(sq, sk, dtype=torch.bool)
    for s in range(len(plan.cu_q) - 1):
        qa, qb, ka, kb = plan.cu_q[s], plan.cu_q[s + 1], plan.cu_k[s], plan.cu_k[s + 1]
        i = torch.arange(qb - qa)[:, None]
        j = torch.arange(kb - ka)[None, :]
        shift = (kb - ka) - (qb - qa)
        sub = torch.ones(qb - qa, kb - ka, dtype=torch.bool)
        if left >= 0:
            sub &= j >= i + shift - left
        if right >= 0:
            sub &= j <= i + shift + right
        vis[qa:qb, ka:kb] = sub
    return vis


def _runs(doc: torch.Tensor) -> tuple[list[int], list[int]]:
    """(boundaries [0, ..., n], id of each run) of the runs of equal values of ``doc`` [n]."""
    n = doc.numel()
    starts = (torch.nonzero(doc[1:] != doc[:-1]).flatten() + 1).tolist() if n > 1 else []
    cuts = [0] + starts + [n]
    return cuts, doc[cuts[:-1]].tolist() if n else []


def _steps_bad(pos: torch.Tensor) -> list[int]:
    """Prefix counts [n] of non-unit steps: entry t counts t' < t with pos[t'+1] - pos[t'] != 1."""
    bad = (pos[1:] - pos[:-1] != 1).long() if pos.numel() > 1 else pos.new_zeros(0)
    return torch.cat([pos.new_zeros(1), torch.cumsum(bad, 0)]).tolist()


def _consecutive(prefix: list[int], a: int, b: int) -> bool:
    """Whether positions [a, b) (b > a) are consecutive integers (from :func:`_steps_bad`)."""
    return prefix[b - 1] - prefix[a] == 0


class _Side:
    """One side of the window across segments: exact values some segments need, and the least
    value the others need (any value >= it, or unbounded, gives them the same mask)."""

    def __init__(self) -> None:
        self.exact: dict[int, int] = {}  # value -> first segment needing it
        self.at_least = -1
        self.at_least_seg = -1

    def need_exact(self, value: int, seg: int) -> None:
        self.exact.setdefault(value, seg)

    def need_at_least(self, value: int, seg: int) -> None:
        if value > self.at_least:
            self.at_least, self.at_least_seg = value, seg

    def choose(self, side: str, max_k: int) -> Union[int, str]:
        """The op's argument for this side, or why none expresses every segment."""
        if len(self.exact) > 1:
            (v1, s1), (v2, s2) = list(self.exact.items())[:2]
            return (f"window_size_{side} differs between segments ({v1} for segment {s1}, {v2} for segment {s2}): "
                    "the documents are aligned differently against their keys")
        if not self.exact:
            return -1
        value, seg = next(iter(self.exact.items()))
        if value < 0:
            return f"segment {seg} needs window_size_{side}={value} (the op takes windows >= 0)"
        if value < self.at_least:
            return (f"window_size_{side}={value} (segment {seg}) would cut segment {self.at_least_seg}, which needs "
                    f">= {self.at_least}")
        if value >= max_k:  # the op treats it as unbounded; fine only if no segment needs the bound
            return (f"window_size_{side}={value} >= max_k={max_k}: the op would treat it as unbounded, but segment "
                    f"{seg} needs the bound")
        return value


def block_plan(positions: tuple, sq: int, sk: int) -> Union[VarlenPlan, str]:
    """The :class:`VarlenPlan` of a "positions" block of sq x sk, or the reason it has none.

    ``positions`` = (q_pos [sq], kv_pos [sk], q_doc [sq], kv_doc [sk], band) as in BlockMask.mask_data
    (CPU LongTensors, nondecreasing, or None). Exact: the plan's :func:`flash_visibility` equals the
    block's visibility and every row sees at least one column.
    """
    if positions is None:
        return "no positions data (a 'positions' block carries (q_pos, kv_pos, q_doc, kv_doc, band))"
    q_pos, kv_pos, q_doc, kv_doc, band = positions
    if isinstance(band, HeadBands):
        return "per-head bands (a sparse pattern's slash runs differ between heads): the op takes one window per call"
    left_band, right_band = band if band is not None else (None, None)
    for what, t in (("q_pos", q_pos), ("kv_pos", kv_pos), ("q_doc", q_doc), ("kv_doc", kv_doc)):
        if t is not None and t.device.type != "cpu":
            return f"{what} is on {t.device}: the plan is made from CPU vectors without a device sync"
    if sq == 0 or sk == 0:
        return f"an empty block ({sq} x {sk})"
    if (q_doc is None) != (kv_doc is None):
        return "document ids on one side only"
    if (q_pos is None) != (kv_pos is None):
        return "positions on one side only"
    if q_doc is None:
        cu_q, cu_k, ids_q, ids_k = [0, sq], [0, sk], [0], [0]
    else:
        cu_q, ids_q = _runs(q_doc)
        cu_k, ids_k = _runs(kv_doc)
        if ids_q != ids_k:
            only = sorted(set(ids_q) ^ set(ids_k))
            return (f"documents {only[:4]} are on one side only" if only else
                    "the documents are in a different order on the two sides")
    n = len(cu_q) - 1
    max_q = max(cu_q[s + 1] - cu_q[s] for s in range(n))
    max_k = max(cu_k[s + 1] - cu_k[s] for s in range(n))
    left, right = _Side(), _Side()
    bounded = q_pos is not None and (left_band is not None or right_band is not None)
    if bounded:
        qp, kp = q_pos.tolist(), kv_pos.tolist()
        q_steps, k_steps = _steps_bad(q_pos), _steps_bad(kv_pos)
    for s in range(n):
        qa, qb, ka, kb = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
        lq, lk = qb - qa, kb - ka
        shift = lk - lq  # the op's bottom-right alignment
        if not bounded:
            left.need_at_least(lk - 1, s)
            right.need_at_least(lq - 1, s)
            continue
        # does a band bound cut this segment at all? (extremes of increasing vectors)
        cuts_left = left_band is not None and kp[ka] < qp[qb - 1] - left_band
        cuts_right = right_band is not None and kp[kb - 1] > qp[qa] + right_band
        if (cuts_left or cuts_right) and not (_consecutive(q_steps, qa, qb) and _consecutive(k_steps, ka, kb)):
            return (f"segment {s} (rows {qa}:{qb}, columns {ka}:{kb}) is cut by the band but its positions are not "
                    "consecutive: the band is no single diagonal there")
        # consecutive: row i, column j see each other iff t <= j - i <= u (block coordinates in the segment)
        offset = qp[qa] - kp[ka]
        t = offset - left_band if cuts_left else None
        u = offset + right_band if cuts_right else None
        lo_first, hi_first = max(0, t if t is not None else 0), min(lk - 1, u if u is not None else lk - 1)
        lo_last = max(0, lq - 1 + t) if t is not None else 0
        hi_last = min(lk - 1, lq - 1 + u) if u is not None else lk - 1
        # lo(i) - hi(i) is convex in i: rows 0 and lq - 1 decide whether any row sees nothing
        if lo_first > hi_first or lo_last > hi_last:
            return (f"a row of segment {s} (rows {qa}:{qb}) sees nothing (the op would give lse +inf there): "
                    "trim the block to rows that see a key")
        if t is None:
            left.need_at_least(lk - 1, s)
        else:  # j >= i + t  <=>  j >= i + shift - wl
            left.need_exact(shift - t, s)
        if u is None:
            right.need_at_least(lq - 1, s)
        else:  # j <= i + u  <=>  j <= i + shift + wr
            right.need_exact(u - shift, s)
    wl = left.choose("left", max_k)
    if isinstance(wl, str):
        return wl
    wr = right.choose("right", max_k)
    if isinstance(wr, str):
        return wr
    # With one side bounded the op makes the open side a window of max_k. On the left that loses
    # nothing (row i's bound i + lk - lq - max_k < 0); on the right row 0 of a segment reaches
    # column lk - lq + max_k, short of lk - 1 when lq - 1 > max_k (seen on an H100: zigzag
    # documents + window blocks with more rows than keys gave lse +inf and NaN outputs).
    if wl >= 0 and wr < 0 and max_q - 1 > max_k:
        return (f"a bounded left window ({wl}) with an open right side: the op bounds the right at max_k={max_k}, "
                f"which cuts rows of a segment with {max_q} rows > max_k + 1")
    return VarlenPlan(tuple(cu_q), tuple(cu_k), max_q, max_k, wl, wr)


_PLANS: "OrderedDict[tuple, tuple]" = OrderedDict()


def cached_plan(positions: tuple, sq: int, sk: int) -> Union[VarlenPlan, str]:
    """:func:`block_plan`, remembered per block: keyed by the identity of its vectors (the cache holds
    them, so an id is never reused while its entry lives), the band and the shape."""
    vectors = tuple(positions[:4]) if positions is not None else ()
    key = (tuple(id(t) for t in vectors), None if positions is None else positions[4], sq, sk)
    hit = _PLANS.get(key)
    if hit is not None:
        _PLANS.move_to_end(key)
        return hit[1]
    if torch_ops.fake_mode_active():  # tracing / schema tests: the plan reads the real CPU vectors
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            plan = block_plan(positions, sq, sk)
    else:
        plan = block_plan(positions, sq, sk)
    _PLANS[key] = (vectors, plan)
    if len(_PLANS) > PLAN_CACHE:
        _PLANS.popitem(last=False)
    return plan


# --------------------------------------------------------------------------------- the kernel


def unavailable() -> Optional[str]:
    """Why this kernel cannot run in this process (None: it can, on a CUDA device)."""
    if torch_ops.schema_arguments(_BWD) is not None and _rng_names() is None:
        return (f"aten::{_BWD} in torch {torch.__version__} takes none of the RNG argument pairs {list(_RNG_NAMES)}; its "
                f"schema: {torch_ops.op_packet(_BWD).default._schema}")
    return torch_ops.fused_op_unavailable(_FWD, _FWD_ARGS, _BWD, _BWD_ARGS + (_rng_names() or ()))


def supports(dtype: torch.dtype, head_dim: int, kind: str) -> Optional[str]:
    """Why (dtype, head dim, kind) is out of this op's reach (None: supported)."""
    if kind not in KINDS:
        return f"mask kind {kind!r} (positions only)"
    return torch_ops.fused_op_supports(dtype, head_dim, "full", MAX_HEAD_DIM)


def supports_block(q: torch.Tensor, k: torch.Tensor, positions: tuple) -> bool:
    """Whether this kernel computes the "positions" block of q [b, hq, sq, d] x k [b, hkv, sk, d] with
    mask data ``positions`` exactly (host-side: the cached plan of the CPU vectors, no device sync)."""
    if not (q.is_cuda or torch_ops.fake_mode_active()):
        return False
    if supports(q.dtype, q.shape[-1], "positions") is not None or k.dtype != q.dtype or k.shape[-1] != q.shape[-1]:
        return False
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        return False
    return isinstance(cached_plan(positions, q.shape[2], k.shape[2]), VarlenPlan)


def _plan(positions: tuple, sq: int, sk: int) -> VarlenPlan:
    plan = cached_plan(positions, sq, sk)
    if isinstance(plan, str):
        raise ValueError(f"the cuda_varlen kernel cannot compute this {sq} x {sk} positions block exactly: {plan}. "
                         "Run such blocks with triton_masked (the default on CUDA: the varlen_or_triton dispatcher "
                         "routes them), not MEGATRON_BURST_KERNEL=cuda_varlen")
    return plan


def _rng_names() -> Optional[tuple[str, str]]:
    """The backward's names for the RNG tensors the forward returns third and fourth."""
    args = torch_ops.schema_arguments(_BWD)
    names = {a.name for a in args} if args is not None else set()
    for pair in _RNG_NAMES:
        if set(pair) <= names:
            return pair
    return None


_DEVICE_CU: "OrderedDict[tuple, tuple]" = OrderedDict()


def _device_tensors(plan: VarlenPlan, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cu_q, cu_k) int32 on ``device`` (the op wants int32), copied once per plan and device (not
    kept under fake tensors)."""
    key = (plan, str(device))
    if key in _DEVICE_CU:
        return _DEVICE_CU[key]
    found = (torch.tensor(plan.cu_q, dtype=torch.int32, device=device),
             torch.tensor(plan.cu_k, dtype=torch.int32, device=device))
    if not torch_ops.fake_mode_active():
        _DEVICE_CU[key] = found
        if len(_DEVICE_CU) > PLAN_CACHE:
            _DEVICE_CU.popitem(last=False)
    return found


def _segment_index(plan: VarlenPlan, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(segment [sq], row within the segment [sq]) LongTensors on ``device``: where each row's lse
    sits in the op's older [segments, h, max_q] layout."""
    lengths = torch.tensor([b - a for a, b in zip(plan.cu_q[:-1], plan.cu_q[1:])])
    seg = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    row = torch.arange(plan.cu_q[-1]) - torch.tensor(plan.cu_q[:-1])[seg]
    return seg.to(device), row.to(device)


def _lse_rows(lse: torch.Tensor, plan: VarlenPlan, hq: int, sq: int) -> torch.Tensor:
    """The op's lse as [hq, sq] fp32: [h, total_q] (recent builds) or [segments, h, max_q] (older)."""
    if lse.dim() == 2 and lse.shape[0] == hq and lse.shape[1] >= sq:
        return lse.narrow(1, 0, sq)
    if lse.dim() == 3 and lse.shape[0] == len(plan.cu_q) - 1 and lse.shape[1] == hq:
        seg, row = _segment_index(plan, lse.device)
        return lse.permute(1, 0, 2)[:, seg, row]
    raise torch_ops.OpSchemaError(f"aten::{_FWD} in torch {torch.__version__} returned lse of shape "
                                  f"{tuple(lse.shape)} for {hq} heads and {sq} rows in {len(plan.cu_q) - 1} segments; "
                                  "known layouts: [h, total_q] and [segments, h, max_q]")


def _lse_op(lse: torch.Tensor, plan: VarlenPlan, rank: int) -> torch.Tensor:
    """lse [hq, sq] fp32 in the layout the op's backward reads (``rank``: the forward's lse rank)."""
    if rank == 2:
        return lse.float().contiguous()
    seg, row = _segment_index(plan, lse.device)
    out = torch.zeros(lse.shape[0], len(plan.cu_q) - 1, plan.max_q, dtype=torch.float32, device=lse.device)
    out[:, seg, row] = lse.float()
    return out.permute(1, 0, 2).contiguous()


def _forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                max_q: int, max_k: int, left: int, right: int, scale: Optional[float]) -> tuple:
    """One op call on packed [total, h, d] tensors."""
    return torch_ops.call(_FWD, query=q, key=k, value=v, cum_seq_q=cu_q, cum_seq_k=cu_k, max_q=max_q, max_k=max_k,
                          dropout_p=0.0, is_causal=left == -1 and right == 0, return_debug_mask=False, scale=scale,
                          window_size_left=left, window_size_right=right)


def _placeholders(device: torch.device, dtype: torch.dtype) -> tuple:
    """(the forward's 3rd and 4th outputs, its lse rank) for a tiny call: what the backward's RNG
    arguments take (dropout is 0: they are not read, but their type and shape are the build's)."""
    def run(x: torch.Tensor) -> tuple:
        seq = _seq(x, 0)  # [16, 1, 8]
        cu = torch.tensor([0, seq.shape[0]], dtype=torch.int32, device=x.device)
        return _forward_op(seq, seq, seq, cu, cu, seq.shape[0], seq.shape[0], -1, -1, None)

    res = torch_ops.dense_call_outputs(_FWD, device, dtype, run)
    return res[2], res[3], res[1].dim()


def _seq(t: torch.Tensor, i: int) -> torch.Tensor:
    """Sample i of t [b, h, s, d] as the op's packed [s, h, d] (a view when the last dim is unit-stride)."""
    return unit_last(t.select(0, i).transpose(0, 1))  # select, not t[i]: fake CUDA tensors on CPU builds


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: str) -> None:
    if kind != "positions":
        raise ValueError(f"the cuda_varlen kernel runs 'positions' blocks, not {kind!r}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} must be a multiple of kv heads {k.shape[1]}")
    why = supports(q.dtype, q.shape[-1], kind)
    if why is not None:
        raise ValueError(f"the cuda_varlen kernel takes {why}")


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: str = "positions", block: int = 1,
            scale: float = 1.0, positions: Optional[tuple] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [b, hq, sq, d], k/v [b, hkv, sk, d] -> (out [b, hq, sq, d] in q's dtype, lse [b, hq, sq] fp32).
    Raises ValueError when the block has no exact plan (see :func:`block_plan`)."""
    _check(q, k, v, kind)
    b, hq, sq, _ = q.shape
    plan = _plan(positions, sq, k.shape[2])
    cu_q, cu_k = _device_tensors(plan, q.device)
    outs, lses = [], []
    for i in range(b):
        res = _forward_op(_seq(q, i), _seq(k, i), _seq(v, i), cu_q, cu_k, plan.max_q, plan.max_k, plan.left,
                          plan.right, scale)
        outs.append(res[0].transpose(0, 1))  # [hq, sq, d]
        lses.append(_lse_rows(res[1], plan, hq, sq).float())
    if b == 1:
        return outs[0].unsqueeze(0), lses[0].unsqueeze(0)
    return torch.stack(outs), torch.stack(lses)


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, D: Optional[torch.Tensor],
             lse: torch.Tensor, kind: str = "positions", block: int = 1, scale: float = 1.0,
             positions: Optional[tuple] = None, out: Optional[torch.Tensor] = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq [b, hq, sq, d], dk, dv [b, hkv, sk, d]) in the input dtype. lse [b, hq, sq] fp32 of the
    merged attention; ``out`` [b, hq, sq, d] the final output of these rows when the caller has it
    (else a stand-in with rowsum(dout * out) == D, :func:`~megatron_burst.kernels.cpu_flash.stand_in_output`)."""
    _check(q, k, v, kind)
    b, hq, sq, _ = q.shape
    plan = _plan(positions, sq, k.shape[2])
    names = _rng_names()
    if names is None:
        raise torch_ops.OpSchemaError(unavailable() or f"aten::{_BWD}: unknown RNG arguments")
    seed, offset, lse_rank = _placeholders(q.device, q.dtype)
    cu_q, cu_k = _device_tensors(plan, q.device)
    if out is None:
        if D is None:
            raise ValueError("cuda_varlen.backward needs D or the final output (out=)")
        out = stand_in_output(dout, D)
    out = out.to(q.dtype)
    grads = []
    for i in range(b):
        grads.append(torch_ops.call(
            _BWD, grad_out=_seq(dout, i), query=_seq(q, i), key=_seq(k, i), value=_seq(v, i),
            out=_seq(out, i), logsumexp=_lse_op(lse.select(0, i), plan, lse_rank), cum_seq_q=cu_q, cum_seq_k=cu_k,
            max_q=plan.max_q, max_k=plan.max_k, dropout_p=0.0, is_causal=plan.causal,
            **{names[0]: seed, names[1]: offset}, scale=scale, window_size_left=plan.left,
            window_size_right=plan.right))
    dq, dk, dv = ([g[n].transpose(0, 1) for g in grads] for n in range(3))
    if b == 1:
        return dq[0].unsqueeze(0), dk[0].unsqueeze(0), dv[0].unsqueeze(0)
    return torch.stack(dq), torch.stack(dk), torch.stack(dv)
