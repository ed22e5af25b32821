"""The fused loss's memory and precision properties (I2): ``weight_grad="backward"`` keeps no fp32
[V/tp, d] weight-gradient accumulator (nothing weight-sized but the gradient itself), and the bf16
gradients of both modes are at least as accurate as the unfused bf16 path's on the same inputs.

Memory is asserted on CPU from the tensors themselves, not from an allocator: every tensor an op
creates during the forward and the backward is recorded (a TorchDispatchMode sees every output),
and so is every tensor saved for the backward (saved_tensors_hooks).
"""
from __future__ import annotations


import pytest
import torch

import fused_loss_cases as cases
from harness import run_interpreted, run_ranks
from megatron_burst.loss import fused_linear_cross_entropy
from megatron_burst.loss import vocab_pass

FP32_TOL = 1e-5


def _run_recorded(weight_grad: str, main_grad: bool, N=64, d=40, V=96, dtype=torch.bfloat16):
    """One fwd + bwd of the fused op (TP = 1, torch impl); returns (tensors created, tensors saved,
    d weight) -- (dtype, numel) pairs, saved ones beyond hidden and weight."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, d, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(V, d, generator=g) * 0.3).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::7] = -100
    mask = (torch.rand(N, generator=g) > 0.2).float()
    if main_grad:
        w.main_grad = torch.zeros(V, d)
        w.grad_added_to_main_grad = False
    saved = []

    def pack(t):
        if t.data_ptr() not in (h.data_ptr(), w.data_ptr()):
            saved.append((t.dtype, t.numel()))
        return t

    rec = cases.CreatedTensors()
    with rec, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fused_linear_cross_entropy(h, w, labels, loss_mask=mask, token_chunk=16, vocab_chunk=32,
                                          impl="torch", weight_grad=weight_grad,
                                          accumulate_into_main_grad=main_grad)
        ((loss * mask).sum() / mask.sum()).backward()
    return rec.made, saved, (w.main_grad if main_grad else w.grad)


@pytest.mark.parametrize("main_grad", [False, True])
def test_backward_weight_grad_keeps_no_weight_sized_buffer(main_grad, monkeypatch):
    """weight_grad="backward": no fp32 tensor of V x d elements (or more) is ever created -- the only
    weight-sized tensor is the bf16 gradient (with main_grad: Megatron's bf16 placeholder; the fp32
    sums go into main_grad in place); nothing weight-sized is saved. The pass is forced to split the
    tokens (tile accumulator [vt, d] fp32 = 32 x 40). The default mode does create the fp32 [V, d]
    accumulator: the difference this option makes."""
    monkeypatch.setattr(vocab_pass, "TILE_BYTES", 6 * 32 * 24)  # vt = 32 rows, tn = 24 of 64 tokens
    N, d, V = 64, 40, 96
    made, saved, dw = _run_recorded("backward", main_grad)
    weight_sized = [(dt, n) for dt, n in made if n >= V * d]
    assert all(dt == torch.bfloat16 and n == V * d for dt, n in weight_sized), weight_sized
    assert len(weight_sized) <= 1, weight_sized  # the gradient (or the placeholder), at most once
    assert max(n for dt, n in made if dt == torch.float32) <= max(N * 32, 32 * d, N * d), made
    assert all(n < V * d for _, n in saved), saved
    made_fwd, saved_fwd, dw_fwd = _run_recorded("forward", main_grad)
    assert (torch.float32, V * d) in made_fwd and (torch.float32, V * d) in saved_fwd
    # Same gradient either way (bf16 rounding apart; into main_grad both add fp32 sums).
    assert (dw.float() - dw_fwd.float()).abs().max() <= 2 ** -7 * dw_fwd.float().abs().max()


@pytest.mark.parametrize("kind", ["binary", "mismatch"])
def test_backward_weight_grad_tp_sequence_parallel(kind):
    """weight_grad="backward" at TP = 2 with sequence parallelism, scaled and recompute paths, fp32:
    loss, d hidden, d weight equal the reference."""
    for res in run_ranks(2, cases.run_case, kind=kind, sequence_parallel=True, weight_grad="backward",
                         with_megatron=False):
        for q in cases.QUANTITIES:
            assert res[f"ref_{q}"] <= FP32_TOL * res[f"scale_{q}"], (q, res)


def test_backward_weight_grad_main_grad_tp_and_bf16():
    """weight_grad="backward" with Megatron's main_grad at TP = 2 (fp32) and TP = 1 (bf16 weight: the
    fp32 sums are added into main_grad unrounded, so at least as accurate as Megatron's bf16)."""
    for res in run_ranks(2, cases.main_grad_case, weight_grad="backward"):
        assert res["err_vs_ref"] <= FP32_TOL * res["scale"], res
        assert res["grad_added_to_main_grad"]
    res = run_ranks(1, cases.main_grad_case, dtype=torch.bfloat16, weight_grad="backward")[0]
    assert res["err_vs_ref"] <= res["megatron_err_vs_ref"], res


def test_ignore_index_and_empty_weight_grad_backward():
    """All labels ignored: zero gradients in both modes (the vocabulary pass writes zeros, not garbage)."""
    h = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(10, 8, requires_grad=True)
    labels = torch.full((6,), -100)
    loss = fused_linear_cross_entropy(h, w, labels, impl="torch", weight_grad="backward")
    loss.sum().backward()
    assert loss.abs().max() == 0 and w.grad.abs().max() == 0 and h.grad.abs().max() == 0
    with pytest.raises(ValueError, match="weight_grad must be 'forward'.*got 'later'"):
        fused_linear_cross_entropy(h, w, labels, impl="torch", weight_grad="later")


PRECISION_SCRIPT = r"""
import json, sys, torch
from megatron_burst.loss import fused_linear_cross_entropy
IGN = -100
def unfused(h, W, y):  # Megatron's rounding: bf16 logits, fp32 cross-entropy, bf16 gradient GEMMs
    return torch.nn.functional.cross_entropy((h @ W.t()).float(), y, ignore_index=IGN, reduction="none")
def ref(h, W, y):
    return torch.nn.functional.cross_entropy(h @ W.t(), y, ignore_index=IGN, reduction="none")
N, d, V = 128, 64, 128
g = torch.Generator().manual_seed(1)
h = torch.randn(N, d, generator=g).bfloat16()
W0 = torch.randn(V, d, generator=g) * d ** -0.5
y = torch.randint(0, V, (N,), generator=g)
y[::11] = IGN
mask = (torch.rand(N, generator=g) > 0.1).float()
W = (W0 * 3).bfloat16()  # logits of std ~3
def run(fn, dtype=None, **kw):
    hh = h.to(dtype or h.dtype).clone().requires_grad_()
    ww = W.to(dtype or W.dtype).clone().requires_grad_()
    loss = fn(hh, ww, y, **kw)
    ((loss * mask).sum() / mask.sum()).backward()
    return hh.grad.double(), ww.grad.double()
def errors_by_mode():
    R = run(ref, torch.float64)
    errs = {}
    for name, kw in (("unfused", None), ("forward", "forward"), ("backward", "backward")):
        got = run(unfused) if kw is None else run(fused_linear_cross_entropy, loss_mask=mask, token_chunk=32,
                                                  vocab_chunk=48, impl="triton", weight_grad=kw)
        errs[name] = [((a - b).norm() / b.norm()).item() for a, b in zip(got, R)]
    return errs, R
out, R = errors_by_mode()
W = (W0 * 7).bfloat16()  # logits of std ~7, as a trained model's: bf16 logits lose more there
out["large_logits"] = errors_by_mode()[0]
W = (W0 * 3).bfloat16()
from megatron_burst.loss import vocab_pass as vp  # scratch in d weight's own rows, every tile kind
vp.VOCAB_TILE, vp.MIN_TILE_ROWS, vp.SPLIT_TOKENS, vp.TAIL_BYTES, vp.ALIGN = 32, 4, (64, 32), 4096, 16
vp.FUSED_TILE_GRAD = False  # the row kernel's tiles (G over the logits, apart, transposed); the fused tile below
got = run(fused_linear_cross_entropy, loss_mask=mask, token_chunk=32, vocab_chunk=48, impl="triton",
          weight_grad="backward")
out["backward_in_result"] = [((a - b).norm() / b.norm()).item() for a, b in zip(got, R)]
tiles = vp.plan_vocab_tiles(N, V, d, torch.bfloat16, 48, in_result=True, dest_fp32=False, acc_temp=False, g_in_z=True)
out["g_in_z_kinds"] = sorted({"own" if t.offset is None else "split" if t.tokens < N else "all" for t in tiles})
vp.G_IN_LOGITS = False  # the same pass with a G tile of its own: the same gradient up to fp32 summation order
apart = run(fused_linear_cross_entropy, loss_mask=mask, token_chunk=32, vocab_chunk=48, impl="triton",
            weight_grad="backward")
out["g_in_z_vs_apart"] = [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, apart)]
vp.G_IN_LOGITS = True
# transposed tiles (vocab_pass.TRANSPOSED_TILES: z^T = W_tile h^T, G^T by grad_cols), every kind of tile,
# G over the logits and fp32 (G^T over z^T in place), against the row-major tiles
def rel_max(xs, ys):
    return [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(xs, ys)]
kw = dict(loss_mask=mask, token_chunk=32, vocab_chunk=48, impl="triton", weight_grad="backward")
rows32 = run(fused_linear_cross_entropy, torch.float32, **kw)
from megatron_burst.loss import triton_kernels
def counted(name):  # the calls of triton_kernels.<name> from now on
    calls, fn = [], getattr(triton_kernels, name)
    setattr(triton_kernels, name, lambda *a, **k: calls.append(1) or fn(*a, **k))
    return calls
def n_pieces(dtype, g_in_z, fused=False):
    return sum(-(-N // t.tokens) for t in vp.plan_vocab_tiles(N, V, d, dtype, 48, in_result=True, acc_temp=False,
                                                             dest_fp32=dtype == torch.float32, g_in_z=g_in_z,
                                                             fused=fused))
calls = counted("grad_cols")
vp.TRANSPOSED_TILES = True
out["transposed_g_in_z"] = rel_max(run(fused_linear_cross_entropy, **kw), got)
out["transposed_fp32"] = rel_max(run(fused_linear_cross_entropy, torch.float32, **kw), rows32)
vp.TRANSPOSED_TILES = False
out["grad_cols_calls"] = len(calls)
# the tile's logits GEMM and softmax gradient in one Triton kernel (vocab_pass.FUSED_TILE_GRAD; 16-bit)
fused_calls = counted("tile_grad")
vp.FUSED_TILE_GRAD = True  # (the default)
out["fused_tile_grad"] = rel_max(run(fused_linear_cross_entropy, **kw), got)
out["tile_grad_calls"] = len(fused_calls)
out["tile_grad_pieces"] = n_pieces(torch.bfloat16, True, fused=True)
out["transposed_pieces"] = n_pieces(torch.bfloat16, True) + n_pieces(torch.float32, False)
mask = mask * (y != IGN).float()  # the usual objective: c = 1 / sum(mask) = 1 / sum(loss weights)
out["matched"] = errors_by_mode()[0]
print(json.dumps(out))
"""


def test_bf16_gradients_no_less_accurate_than_unfused():
    """bf16 on the fast path (Triton interpreted, a fresh process, its bf16 casts rounding to
    nearest as on the GPU: tests/interpreted.py): relative Frobenius errors of d hidden and d weight
    against an fp64 reference are <= the unfused bf16 path's on the same inputs, in both weight_grad
    modes (here: d hidden 2.4e-3 / 2.3e-3, d weight 1.9e-3 in both, unfused 4.5e-3 / 4.6e-3), and at
    most 0.7 of them with logits of std ~7. The scale c is applied to the bf16 d hidden in fp32 (see
    autograd._scale_in_place). weight_grad="backward" rounds its G at the loss weights' scale and
    applies c in the GEMM, as the default mode does: the same d weight error (it was 3.4e-3 with G
    rounded after scaling by c = 1/120: the target entries, ~ -1, lost their short mantissa)."""
    errs = run_interpreted("", code=PRECISION_SCRIPT, timeout=300)
    for mode in ("forward", "backward", "backward_in_result"):
        for i, q in enumerate(("dh", "dw")):
            assert errs[mode][i] <= errs["unfused"][i], (mode, q, errs)
    for mode in ("backward", "backward_in_result"):
        assert errs[mode][1] <= 1.05 * errs["forward"][1], (mode, errs)
    # the Triton kernel's 16-bit G written over its fp32 logits rows (vocab_pass.G_IN_LOGITS), every
    # kind of tile, against a G tile of its own: d hidden identical, d weight within one bf16 rounding
    assert errs["g_in_z_kinds"] == ["all", "own", "split"], errs["g_in_z_kinds"]
    assert errs["g_in_z_vs_apart"][0] == 0.0 and errs["g_in_z_vs_apart"][1] <= 2 ** -8, errs["g_in_z_vs_apart"]
    # transposed tiles (vocab_pass.TRANSPOSED_TILES) against row-major ones: d hidden (the forward's)
    # identical; d weight within one bf16 rounding (fp32: the summation order's reordering only)
    # (here: bitwise the same, the CPU's fp32 products and sums alike), every piece of the two runs through
    # the transposed kernel
    for name, bound in (("transposed_g_in_z", 2 ** -8), ("transposed_fp32", 1e-6)):
        assert errs[name][0] == 0.0 and errs[name][1] <= bound, (name, errs[name])
    assert errs["grad_cols_calls"] == errs["transposed_pieces"] > 0, errs
    # the tile's GEMM and softmax gradient in one Triton kernel (vocab_pass.FUSED_TILE_GRAD): d weight
    # within one bf16 rounding (its fp32 logits summed in another order), every piece through it
    fused = errs["fused_tile_grad"]
    assert fused[0] == 0.0 and fused[1] <= 2 ** -8, fused
    assert errs["tile_grad_calls"] == errs["tile_grad_pieces"] > 0, errs
    # Logits of std ~7 (a trained model's range): the unfused path's bf16 logits cost it a factor ~3
    # in both gradients (here unfused 7.1e-3 / 7.2e-3, ours 2.5e-3 / 2.4e-3 and 1.9e-3): ours keeps the
    # logits in fp32.
    large = errs["large_logits"]
    for mode in ("forward", "backward"):
        for i, q in enumerate(("dh", "dw")):
            assert large[mode][i] <= 0.7 * large["unfused"][i], (mode, q, large)
    # weight_grad="backward" stores D times 1 / sum(loss weights) (fast.hidden_grad_prescale): where the
    # objective divides by that very sum, the backward's factor is 1 and D's second rounding is gone
    # (here d hidden 1.7e-3 against the default mode's 2.5e-3; 2.4e-3 without the prescale)
    matched = errs["matched"]
    assert matched["backward"][0] <= 0.8 * matched["forward"][0], matched
    assert matched["backward"][0] <= matched["unfused"][0] and matched["backward"][1] <= matched["unfused"][1], matched


# ------------------------------------------------------------ scratch inside d weight's own rows

def _tile_kind(t, n_tokens):
    if t.offset is None:
        return "own"
    return "in-result, all tokens" if t.tokens >= n_tokens else "in-result, tokens split"


def _small_tiles(monkeypatch):
    """Tiling constants that give a 200-row vocabulary every kind of tile (see _tile_kind)."""
    for name, value in (("VOCAB_TILE", 32), ("MIN_TILE_ROWS", 4), ("SPLIT_TOKENS", (16, 8)),
                        ("TILE_BYTES", 6 * 32 * 16), ("TAIL_BYTES", 1200), ("ALIGN", 16),
                        ("ROW_ALIGN", 4)):
        monkeypatch.setattr(vocab_pass, name, value)


@pytest.mark.filterwarnings("ignore::megatron_burst.loss.FusedLossRecomputeWarning")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scratch_inside_the_weight_gradient_is_exact(dtype, monkeypatch):
    """weight_grad="backward" without main_grad lays each tile's scratch in d weight's rows not yet
    written. With d weight's storage poisoned (NaN) before the pass, every kind of tile (all tokens,
    tokens split with an fp32 accumulator, the own tail buffer) gives the gradient the own-buffer
    plan gives: a scratch piece overlapping written rows, or a read of the borrowed rows before
    they are overwritten, would show up as NaN or a wrong row."""
    _small_tiles(monkeypatch)
    N, d, V = 48, 24, 200
    kinds = {_tile_kind(t, N) for t in vocab_pass.plan_vocab_tiles(
        N, V, d, dtype, 10 ** 6, in_result=True, dest_fp32=dtype == torch.float32, acc_temp=False)}
    want_kinds = {"own", "in-result, all tokens", "in-result, tokens split"}
    assert kinds == want_kinds, kinds
    target = vocab_pass.weight_grad_target

    def poisoned(*args):
        out, done = target(*args)
        if not done:
            out.fill_(float("nan"))
        return out, done

    monkeypatch.setattr(vocab_pass, "weight_grad_target", poisoned)
    g = torch.Generator().manual_seed(4)
    h = torch.randn(N, d, generator=g).to(dtype)
    w = (torch.randn(V, d, generator=g) * 2 * d ** -0.5).to(dtype)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::9] = -100
    grads = {}
    for in_result in (True, False):
        monkeypatch.setattr(vocab_pass, "SCRATCH_IN_RESULT", in_result)
        ww = w.clone().requires_grad_()
        loss = fused_linear_cross_entropy(h, ww, labels, impl="torch", weight_grad="backward", vocab_chunk=10 ** 6)
        (loss * torch.linspace(0.5, 1.5, N)).sum().backward()  # not proportional: any g is exact here
        grads[in_result] = ww.grad.float()
    got, own = grads[True], grads[False]
    assert torch.isfinite(got).all()
    # Both form fp32 sums in different orders (bf16: then round each element once): one bf16 ulp
    # apart at most, plus the fp32 reordering relative to the gradient's scale.
    tol = (2 ** -7 if dtype == torch.bfloat16 else 0.0) * own.abs() + 1e-5 * own.abs().max()
    assert ((got - own).abs() <= tol).all(), (got - own).abs().max()


@pytest.mark.parametrize("shape", [(16384, 131072, 4096), (4096, 32768, 1024), (65536, 32768, 4096),
                                   (8192, 152064, 5120), (1000, 5000, 64)])
@pytest.mark.parametrize("acc_temp,g_in_z,floor,fused", [(False, False, 0, False), (True, False, 0, False),
                                                         (False, True, 0, False), (False, True, 1024, False),
                                                         (False, True, 0, True)])
def test_scratch_plan_stays_behind_its_rows(shape, acc_temp, g_in_z, floor, fused, monkeypatch):
    """The plan at real shapes (bf16, (N, V, d)): tiles cover the vocabulary in order; every borrowed
    scratch lies in d weight's storage past its own tile's rows; the own buffer is at most
    TAIL_BYTES (1 MiB) -- so the backward's peak above the two bf16 gradients is <= 1 MiB plus
    [3, N]-sized statistics (at (16K, 128K, 4096): 1152 MiB + 1 MiB, Cut Cross-Entropy's 1154 MiB
    measured on the issue's H200) -- and the tile count stays bounded. ``floor``: vocab_pass.GEMM_ROWS_FLOOR
    (short tiles priced by the FLOPs their GEMMs waste), a candidate the bench's knob variants time: the
    same invariants, and at (16K, 128K, 4096) fewer rows in tiles of under 512 rows. ``fused``:
    vocab_pass.FUSED_TILE_GRAD's 2 B of scratch per logit: the same invariants, and fewer pieces and
    short-tile rows there than the 4 B plan."""
    N, V, d = shape
    monkeypatch.setattr(vocab_pass, "GEMM_ROWS_FLOOR", floor)
    tiles = vocab_pass.plan_vocab_tiles(N, V, d, torch.bfloat16, 16384, in_result=True, dest_fp32=False,
                                        acc_temp=acc_temp, g_in_z=g_in_z, fused=fused)
    assert tiles[0].start == 0 and tiles[-1].stop == V
    assert all(a.stop == b.start for a, b in zip(tiles, tiles[1:]))
    # heights (the scratch's leading dimension) aligned for tensor-core GEMMs, but the last tile's
    assert all((t.stop - t.start) % vocab_pass.ROW_ALIGN == 0 for t in tiles[:-1]), [t.stop - t.start for t in tiles]
    own = 0
    for t in tiles:
        lay = vocab_pass.tile_scratch(t.stop - t.start, t.tokens, N, d, torch.bfloat16, False, acc_temp, g_in_z,
                                      fused)
        if t.offset is None:
            own = max(own, lay.nbytes)
        else:
            assert t.offset >= t.stop * d * 2 and t.offset + lay.nbytes <= V * d * 2, t
    assert own <= vocab_pass.TAIL_BYTES
    plain = vocab_pass.plan_vocab_tiles(N, V, d, torch.bfloat16, 16384, in_result=False, dest_fp32=False,
                                        acc_temp=acc_temp, g_in_z=g_in_z)
    # No degenerate plan (thousands of slivers): at (16K, 128K, 4096) 106 tiles (127 with acc_temp)
    # against 64, and by the traffic model of _bytes_per_row less memory traffic than the own-buffer
    # plan there (no accumulator read-modify-write where all tokens fit in one GEMM).
    assert len(tiles) <= 3 * len(plain) + 48, (len(tiles), len(plain))
    if fused and shape == (16384, 131072, 4096):
        four = vocab_pass.plan_vocab_tiles(N, V, d, torch.bfloat16, 16384, in_result=True, dest_fp32=False,
                                           acc_temp=acc_temp, g_in_z=True)
        pieces = [sum(-(-N // t.tokens) for t in p) for p in (tiles, four)]
        short = [sum(t.stop - t.start for t in p if t.stop - t.start < 512) for p in (tiles, four)]
        assert pieces[0] < pieces[1] and short[0] < short[1], (pieces, short)
    if g_in_z and shape == (16384, 131072, 4096) and not floor and not fused:  # 4 B of scratch per logit, not 6
        pieces = sum(-(-N // t.tokens) for t in tiles)
        assert pieces <= 130, pieces  # 201 with a G tile of its own
    if floor:
        def short_rows(plan):
            return sum(t.stop - t.start for t in plan if t.stop - t.start < 512)
        monkeypatch.setattr(vocab_pass, "GEMM_ROWS_FLOOR", 0)
        unpriced = vocab_pass.plan_vocab_tiles(N, V, d, torch.bfloat16, 16384, in_result=True, dest_fp32=False,
                                               acc_temp=acc_temp, g_in_z=g_in_z)
        if shape == (16384, 131072, 4096):  # (a greedy plan: not at every shape)
            assert short_rows(tiles) < short_rows(unpriced), (short_rows(tiles), short_rows(unpriced))


@pytest.mark.parametrize("V,d", [(131072, 4096), (32768, 4096), (32768, 1024), (152064, 5120), (50257, 768)])
def test_lean_mode_forward_chunk_within_the_weight_gradient(V, d):
    """weight_grad="backward": the fast path's default chunk (fp32 logits + bf16 G, 6 B per logit)
    is no larger than d weight itself (or LEAN_MIN_CHUNK tokens), so the forward does not peak
    above the backward's two gradients; the default mode keeps its larger chunk."""
    from megatron_burst.loss import config
    cpu = torch.device("cpu")
    lean = config.default_token_chunk(16384, V, d, torch.bfloat16, cpu, "triton", "backward")
    fast = config.default_token_chunk(16384, V, d, torch.bfloat16, cpu, "triton")
    assert lean <= fast
    assert lean * V * 6 <= max(V * d * 2, config.LEAN_MIN_CHUNK * V * 6), (lean, V, d)


VIEW_OPS = {"view", "t", "slice", "select", "as_strided", "_unsafe_view", "alias", "expand", "transpose",
            "unsqueeze", "detach", "_to_copy", "empty", "lift_fresh"}


def test_vocab_pass_launches_two_ops_per_piece(monkeypatch):
    """The lean mode's backward walks hundreds of (vocabulary tile, token sub-chunk) pieces (358 at
    (16K, 128K, 4096)); on a GPU it was host-bound (164 ms against 115 ms of kernels, H100, torch
    profiler) with ~12 launches per piece. Per piece now: the logits GEMM and the d weight GEMM (+ the
    softmax-gradient kernel, not an aten op, which also shifts the shard's target columns by the
    tile's start) -- per-token targets and statistics are formed once per pass. Counted here with the
    Triton kernel emulated (fp32, CPU)."""
    from megatron_burst.loss import triton_kernels
    from megatron_burst.loss.config import LossConfig
    from torch.utils._python_dispatch import TorchDispatchMode

    inside = {"kernel": False}
    counts: dict[str, int] = {}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if not inside["kernel"] and name not in VIEW_OPS:
                counts[name] = counts.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    def emulated(z, tgt, stats, *, grad=None, wts=None, compute_stats=True, col0=0):
        inside["kernel"] = True
        try:
            tgt = tgt - col0
            hit = (tgt >= 0) & (tgt < z.shape[1])
            g = torch.exp(z - stats[0][:, None]) * (wts / stats[1])[:, None]
            g[torch.arange(z.shape[0])[hit], tgt[hit]] -= wts[hit]
            grad.copy_(g)
        finally:
            inside["kernel"] = False

    monkeypatch.setattr(triton_kernels, "ce_rows", emulated)
    _small_tiles(monkeypatch)
    monkeypatch.setattr(vocab_pass, "SCRATCH_IN_RESULT", False)  # own-buffer tiles: tokens not split in fp32
    N, d, V = 48, 24, 200
    g = torch.Generator().manual_seed(5)
    h, w = torch.randn(N, d, generator=g), torch.randn(V, d, generator=g) * d ** -0.5
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::5] = -100
    z = h @ w.t()
    m, s = z.max(1).values, torch.exp(z - z.max(1).values[:, None]).sum(1)
    gt = torch.where(labels >= 0, torch.linspace(0.5, 1.5, N), 0.0)
    cfg = LossConfig(None, 1, 0, V, N, 10 ** 6, -100, False, "triton", "backward")
    tiles = vocab_pass.plan_vocab_tiles(N, V, d, torch.float32, cfg.vocab_chunk, in_result=False, dest_fp32=True,
                                        acc_temp=False)
    pieces = sum(-(-N // t.tokens) for t in tiles)
    with Count():
        dw = vocab_pass.weight_grad_by_vocab_tiles(h, w, labels, m, s, gt, cfg, None)
    p = torch.softmax(z, 1) * gt[:, None]
    p[torch.arange(N)[labels >= 0], labels[labels >= 0]] -= gt[labels >= 0]
    torch.testing.assert_close(dw, p.t() @ h, rtol=1e-5, atol=1e-6)
    assert pieces >= 10 and sum(counts.values()) <= 2 * pieces + 12, (pieces, counts)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_megatrons_micro_batch_division_costs_the_prescaled_d_hidden_no_rounding(dtype):
    """The one-read forward stores D times 1 / sum(mask) (fast.hidden_grad_prescale); Megatron's
    schedule divides the loss sum by num_tokens and then by num_microbatches (forward_step_calc_loss,
    in fp32), so the backward scales D by c / prescale = 1 / M up to an fp32 ulp or two. For M a
    power of two that product is exact in 16 bits: d hidden is D / M bit for bit, rounded once
    in all. (A factor off by more than a quarter of a 16-bit ulp, or a prescale other than
    1 / sum(mask), fails this.)"""
    from megatron_burst.loss import fast
    from megatron_burst.loss.autograd import _scale_in_place

    g = torch.Generator().manual_seed(3)
    D = (torch.randn(96, 40, generator=g) * 3).to(dtype)
    for n_tokens in (1, 7, 120, 1000, 4093, 16383):
        mask = torch.zeros(n_tokens + 5)
        mask[:n_tokens] = 1.0
        for M in (1, 2, 4, 8, 64):
            loss_sum = torch.ones((), requires_grad=True)
            out = loss_sum * 1.0  # as Megatron: output_tensor /= clamp(num_tokens); /= num_microbatches
            out = out / torch.clamp(torch.tensor(n_tokens, dtype=torch.int), min=1)
            out = out / M
            (c,) = torch.autograd.grad(out, loss_sum)
            factor = c / fast.hidden_grad_prescale(mask)
            dh = _scale_in_place(D.clone(), factor)
            assert torch.equal(dh, D / M), (n_tokens, M, factor.item())


PER_TOKEN_SCRIPT = r"""
import json, sys, torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from fused_loss_cases import new_storage_tensors
from megatron_burst.loss import fused_linear_cross_entropy, vocab_pass
N, d, V = 77, 40, 96  # N unlike every other size: a tensor is per-token by its last dimension
class LiveBytes(TorchDispatchMode):
    # every storage an op creates (not a view of an argument's) whose tensor is per-token ([N], [k <= 3, N])
    # and alive: the largest sum while d weight (the pass's result) exists -- the gradients' peak on a GPU
    def __init__(self):
        super().__init__()
        self.live, self.peak, self.in_pass = {}, 0, False
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in new_storage_tensors(args, kwargs, out):
            if t.shape[-1:] == (N,) and t.dim() <= 2 and t.numel() <= 3 * N:
                st = t.untyped_storage()
                self.live.setdefault(st.data_ptr(), (StorageWeakRef(st), st.nbytes()))
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        if self.in_pass:
            self.peak = max(self.peak, sum(b for _, b in self.live.values()))
        return out
rec = LiveBytes()
target = vocab_pass.weight_grad_target
def marked(*a, **k):
    res = target(*a, **k)
    rec.in_pass = True
    return res
vocab_pass.weight_grad_target = marked
g = torch.Generator().manual_seed(3)
h = torch.randn(N, d, generator=g).bfloat16().requires_grad_()
w = (torch.randn(V, d, generator=g) * 0.3).bfloat16().requires_grad_()
y = torch.randint(0, V, (N,), generator=g)
y[::9] = -100
mask = (torch.rand(N, generator=g) > 0.2).float()
loss = fused_linear_cross_entropy(h, w, y, loss_mask=mask, token_chunk=32, vocab_chunk=48, impl="triton",
                                  weight_grad="backward")
obj = (loss * mask).sum() / mask.sum()
with rec:
    obj.backward()
print(json.dumps({"peak": rec.peak, "in_pass": rec.in_pass}))
"""


def test_backward_per_token_bytes_beside_the_gradients():
    """weight_grad="backward", the Triton path (interpreted): while d weight exists -- the op's peak on a
    GPU (run 6, H100: 0.04 MiB above Cut Cross-Entropy's) -- the per-token tensors alive are 13 B per
    token: the incoming loss gradient (4), the valid-label mask (1), the loss weights as G's factor (4),
    the int32 target columns (4). The statistics are the forward's [2, N] buffer, read in place."""
    res = run_interpreted("", code=PER_TOKEN_SCRIPT, timeout=300)
    assert res["in_pass"]
    N = 77
    assert res["peak"] == 13 * N, res
