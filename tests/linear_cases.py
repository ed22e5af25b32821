"""Rank-side bodies of the linear-attention tests (run on every rank by harness.run_ranks).

Every rank builds the same full-sequence inputs (same seed), computes the token-by-token reference
over the whole sequence in fp64 with autograd, runs linear_attention on its shard, and returns the
largest errors of out and of every gradient against the reference (relative to the reference's
largest magnitude), plus the bytes it sent.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import megatron_burst as mb
from megatron_burst.linear import linear_attention, naive_linear_attention

B, H, DK, DV = 2, 2, 8, 4
FP32_TOL = 1e-5  # relative to the reference's largest magnitude
# local lengths: not multiples of the 64-token chunk; striped holds two 64-token stripes per rank
LOCAL = {"contiguous": 70, "zigzag": 70, "striped": 128}


def check_errors(res: dict, tol: float = FP32_TOL, what: str = "") -> None:
    """Assert every relative error of a case's result (all but its bytes and dtype) is within tol."""
    for name, err in res.items():
        if name in ("bytes", "dtype"):
            continue
        assert err <= tol, f"{what}: {name} relative error {err:.2e} > {tol:.0e}"


def relative_errors(pairs, shard) -> dict:
    """{name: max |got - shard(want)| / max |shard(want)|} for (name, got, full-sequence want) pairs."""
    errs = {}
    for name, got, want in pairs:
        want = shard(want.detach())
        errs[name] = ((got.double() - want).abs().max() / want.abs().max()).item()
    return errs


def full_inputs(seq: int, gform, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    q, k, v = mk(seq, B, H, DK), mk(seq, B, H, DK), mk(seq, B, H, DV)
    g = None
    if gform == "head":
        g = -torch.rand(H, generator=gen) * 0.3
    elif gform == "token":
        g = -torch.rand(seq, B, H, generator=gen) * 0.3
    elif gform == "channel":
        g = -torch.rand(seq, B, H, DK, generator=gen) * 0.3
    return [t.to(dtype) for t in (q, k, v)], g, mk(seq, B, H, DV).to(dtype)


def run_case(algo: str, layout: str, causal: bool, gform, local_len: int, dtype=torch.float32, stripe: int = 1,
             seed: int = 0) -> dict:
    W, r = dist.get_world_size(), dist.get_rank()
    seq = local_len * W
    (q, k, v), g, dout = full_inputs(seq, gform, dtype, seed)
    # reference: fp64 on the same (rounded) inputs
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref_g = g.double().requires_grad_() if g is not None else None
    ref_out = naive_linear_attention(*ref_leaves, g=ref_g, causal=causal)
    ref_out.backward(dout.double())
    sh = lambda t: mb.shard(t, 0, r, W, layout, stripe)  # noqa: E731
    leaves = [sh(t).clone().requires_grad_() for t in (q, k, v)]
    g_local = None
    if g is not None:
        g_local = (g.clone() if g.dim() == 1 else sh(g).clone()).requires_grad_()
    with mb.comm_counter() as counter:
        out = linear_attention(*leaves, group=None, g=g_local, causal=causal, layout=layout, stripe=stripe,
                               algo=algo)
        out.backward(sh(dout))
    pairs = [("out", out, ref_out)] + [(f"d{n}", l.grad, rl.grad) for n, l, rl in zip("qkv", leaves, ref_leaves)]
    errs = relative_errors(pairs, sh)
    if g is not None:
        dg = g_local.grad.double()
        if g.dim() == 1:  # a per-head decay is shared by every rank's tokens: its gradient sums over ranks
            dist.all_reduce(dg)
            want = ref_g.grad
        else:
            want = sh(ref_g.grad)
        errs["dg"] = ((dg - want).abs().max() / want.abs().max()).item()
    errs["dtype"] = str(out.dtype)
    errs["bytes"] = {p: counter.bytes("sent", phase=p) for p in ("forward", "backward")}
    return errs


def bad_input_messages() -> tuple:
    """Each bad input raises ValueError locally, before any collective; the group still works."""
    s = 8
    q, k, v = torch.randn(s, 1, 2, 4), torch.randn(s, 1, 2, 4), torch.randn(s, 1, 2, 3)
    cases = {
        "token_stripes": dict(layout="striped", stripe=1),
        "bidirectional_decay": dict(causal=False, g=-torch.rand(2)),
        "decay_shape": dict(g=-torch.rand(3)),
        "algo": dict(algo="ring"),
        "seq": dict(layout="zigzag", q=torch.randn(7, 1, 2, 4), k=torch.randn(7, 1, 2, 4), v=torch.randn(7, 1, 2, 3)),
        "kv_mismatch": dict(k=torch.randn(s, 1, 2, 5)),
    }
    messages = {}
    with mb.comm_counter() as counter:
        for name, kw in cases.items():
            args = dict(q=q, k=k, v=v)
            args.update({key: kw.pop(key) for key in ("q", "k", "v") if key in kw})
            try:
                linear_attention(args["q"], args["k"], args["v"], **kw)
                messages[name] = None
            except ValueError as exc:
                messages[name] = str(exc)
    t = torch.ones(1)
    dist.all_reduce(t)
    return messages, counter.bytes("sent") + counter.bytes("received"), t.item() == dist.get_world_size()
