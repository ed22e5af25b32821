"""(b) cp_attention at W=1 on the GPU: every algorithm that runs at one rank x every layout x every
mask, against the fp32 reference of the whole sequence."""
from __future__ import annotations

import pytest
import torch

import megatron_burst as mb
from megatron_burst.algorithms import prepare

from gpu.common import DEV, L, MASKS, ON_CPU, STRIPE_WIDE, check, doc_bounds, errors, inputs, kernel_failures, \
    mask_kwargs, reference, sdpa_errors, visibility

ALGOS = ("ring", "burst", "allgather", "ulysses", "usp", "auto")  # usp at W=1: ulysses_size 1
LAYOUTS_ALL = (("contiguous", 1), ("zigzag", 1), ("striped", 1), ("striped", STRIPE_WIDE))
CONFIGS = {
    # name: (seq, b, hq, hkv, d, layouts); lengths are not powers of two
    "gqa8/2_d128": (L(1600), 2, 8, 2, 128 if not ON_CPU else 32, LAYOUTS_ALL),
    "gqa8/2_d64": (L(1000), 2, 8, 2, 64 if not ON_CPU else 16, LAYOUTS_ALL[:3]),  # 1000: no 64-token stripes
}
PER_SAMPLE = "documents_per_sample"


def _per_sample_bounds(seq: int) -> list[list[int]]:
    return [doc_bounds(seq), [0, seq // 3, seq // 3 + 1, seq]]


def _case_kwargs(mask: str, seq: int) -> dict:
    if mask == PER_SAMPLE:
        return {"causal": True, "cu_seqlens": [torch.tensor(c, dtype=torch.int32, device=DEV)
                                               for c in _per_sample_bounds(seq)]}
    return mask_kwargs(mask, seq, DEV)


def _case_visibility(mask: str, seq: int, b: int):
    if mask != PER_SAMPLE:
        return visibility(mask, seq)
    pos = torch.arange(seq)
    out = []
    for i in range(b):
        doc = torch.searchsorted(torch.tensor(_per_sample_bounds(seq)[i]), pos, right=True) - 1
        out.append((doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None]))
    return torch.stack(out)[:, None]  # [b, 1, s, s]


@pytest.mark.parametrize("mask", MASKS + (PER_SAMPLE,))
@pytest.mark.parametrize("config", list(CONFIGS))
def test_cp_attention_one_rank(config, mask):
    """W=1, bf16, GQA 8/2 (head dim 128 at 1600 tokens, 64 at 1000), batch 2: algorithms ring, burst,
    allgather, ulysses, usp (ulysses_size 1) and auto x layouts contiguous, zigzag, striped (stripe 1
    and 64 where the length allows) x masks causal, full, documents (cu_seqlens), a (193, 0) window,
    documents + window, and per-sample documents: out, dq, dk, dv within 1.5x torch's bf16 SDPA error
    of the fp32 reference; every mask kind on its fused kernel."""
    seq, b, hq, hkv, d, layouts = CONFIGS[config]
    q, k, v, dout = (t.to(DEV) for t in inputs(seq, b, hq, hkv, d, seed=11))
    kw = _case_kwargs(mask, seq)
    vis = _case_visibility(mask, seq, b)
    ref = reference(q, k, v, dout, causal=kw["causal"], mask=vis)
    sdpa = sdpa_errors(q, k, v, dout, kw["causal"], vis, ref)
    fails, table = [], []
    for algo in ALGOS:
        for layout, stripe in layouts:
            what = f"{config} {mask} {algo} {layout}/{stripe}"
            try:
                sh = lambda t: mb.shard(t, 0, 0, 1, layout, stripe)  # noqa: E731  (W=1: the whole sequence)
                leaves = [sh(t).clone().requires_grad_() for t in (q, k, v)]
                extra = {"ulysses_size": 1} if algo == "usp" else {}
                call = prepare(*leaves, algo=algo, layout=layout, stripe=stripe, **kw, **extra)
                o = call.apply()
                o.backward(sh(dout))
            except Exception as e:  # noqa: BLE001  every case is tried; all failures reported together
                fails.append(f"{what}: raised {type(e).__name__}: {e}")
                continue
            got = [mb.unshard([t], 0, layout, stripe) for t in (o, *(t.grad for t in leaves))]
            engine = errors(got, ref)
            table.append(f"{what}: " + " ".join(f"{n} {e:.2e}" for n, e in engine.items()))
            fails += check(engine, sdpa, what)
            fails += kernel_failures(call.cfg.kernel.kernels, what)
    assert not fails, "\n".join(fails) + f"\nSDPA bf16: {sdpa}\n" + "\n".join(table)
