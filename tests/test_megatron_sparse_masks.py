"""--sparse-attention with sliding windows and documents through the Megatron layers.

* ``CPCoreAttention`` with ``cp_sparse`` (MTraining's dynamic vertical-slash budgets), a
  ``window_size`` in its TransformerConfig and --reset-attention-mask documents in
  ``packed_seq_params`` (qkv_format "sbhd") at CP = 2 and 3: output and q/k/v gradients equal, in
  fp32, the dense masked reference built from the definitions (pattern AND causal AND window AND
  same document; tests/sparse_mask_cases.py), for the pattern the layer estimated;
* the tiny GPT with --sparse-attention and --window-size, and with --reset-attention-mask, at
  CP = 2 equals CP = 1 in loss and every gradient;
* a packed THD batch is refused by the layer, naming THD and the fix.
"""
from __future__ import annotations

from typing import Optional

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks
from sparse_cases import definition_mask
from sparse_mask_cases import bounds_of
from window_cases import dense_masked_reference, window_mask

TOL = 1e-5  # fp32 against a float64 reference, relative to max(1, the reference's largest entry)
BUDGETS = (0.5, 0.5, 8)  # (p_v, p_s, last_q) of --sparse-budget 0.5 0.5 --sparse-last-q 8
HEADS, KV_HEADS, HEAD_DIM, BATCH = 4, 2, 8, 2

# (name, per-sample document boundaries as fractions of S or None, window left as a fraction of S
# or None). The window is longer than the first 64-offset slash pool, so the pattern, the window
# and the documents each remove pairs the other two keep (checked on every rank).
MASKS = (
    ("window", None, 0.7),
    ("documents", ((0.3,), (0.75, 0.8)), None),
    ("documents_window", ((0.3,), (0.75, 0.8)), 0.7),
)


def _documents_params(per_sample: list[list[int]], seq: int):
    """PackedSeqParams("sbhd") of [b, s] documents, as megatron_burst.megatron.packed.document_seq_params
    builds them from EOD tokens: sample j's boundaries offset by j x seq."""
    from megatron.core.packed_seq_params import PackedSeqParams

    flat = [0]
    for j, bounds in enumerate(per_sample):
        flat += [j * seq + x for x in bounds[1:]]
    cu = torch.tensor(flat, dtype=torch.int32)
    return PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=seq, max_seqlen_kv=seq)


def sparse_core_attention_vs_dense(layout: str, stripe: int, algo: str, local_len: int) -> list[dict]:
    """Rank body: for each of MASKS, a fresh CPCoreAttention (sparse budgets, the case's window) on
    this rank's q/k/v; max errors of out, dq, dk, dv against the dense masked reference of the
    pattern the layer estimated, relative to max(1, the reference's largest entry)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    import megatron_burst as mb
    from megatron_burst.masks.dynamic import Dynamic, estimate
    from megatron_burst.megatron.attention import CPCoreAttention

    W, r = dist.get_world_size(), dist.get_rank()
    ps.initialize_model_parallel(1, 1, context_parallel_size=W, create_gloo_process_groups=False)
    seq = local_len * W
    scale = HEAD_DIM ** -0.5
    gen = torch.Generator().manual_seed(17)
    mk = lambda h: torch.randn(seq, BATCH, h, HEAD_DIM, generator=gen)  # noqa: E731
    q, k, v, dout = mk(HEADS) * 3, mk(KV_HEADS), mk(KV_HEADS), mk(HEADS)  # peaky scores: top-p keeps few lines
    sh = lambda t: mb.shard(t, 0, r, W, layout, stripe)  # noqa: E731
    bhsd = lambda t: t.permute(1, 2, 0, 3)  # noqa: E731
    # the layer estimates the same pattern from the same local q and k (identical on every rank)
    used = estimate(bhsd(sh(q)), bhsd(sh(k)), Dynamic(*BUDGETS), layout=layout, stripe=stripe, softmax_scale=scale)
    pattern_vis = definition_mask(used, seq)
    rows = []
    for name, fractions, window_fraction in MASKS:
        window = None if window_fraction is None else (int(window_fraction * seq), 0)
        per_sample = None if fractions is None else [bounds_of(seq, f) for f in fractions]
        cfg = TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                                num_query_groups=KV_HEADS, kv_channels=HEAD_DIM, attention_dropout=0.0,
                                context_parallel_size=W, use_cpu_initialization=True, window_size=window)
        attn = CPCoreAttention(cfg, 1, AttnMaskType.causal, "self", cp_algo=algo, cp_layout=layout, cp_stripe=stripe,
                               cp_sparse=BUDGETS)
        params = None if per_sample is None else _documents_params(per_sample, seq)
        ql, kl, vl = (sh(t).clone().requires_grad_() for t in (q, k, v))
        out = attn(ql, kl, vl, None, packed_seq_params=params)
        out.backward(sh(dout).reshape(local_len, BATCH, -1))
        ref_parts, cuts = [], {"pattern": False, "window_documents": False}
        for s in range(BATCH):
            dense = window_mask(seq, window, True, None if per_sample is None else per_sample[s])
            vis = pattern_vis & dense[None]
            cuts["pattern"] |= bool((dense[None] & ~pattern_vis).any())
            cuts["window_documents"] |= bool((pattern_vis & ~dense[None]).any())
            sl = slice(s, s + 1)
            ref_parts.append(dense_masked_reference(q[:, sl], k[:, sl], v[:, sl], dout[:, sl], vis, scale))
        ref = [sh(torch.cat([p[i] for p in ref_parts], 1)) for i in range(4)]
        got = (out.reshape(local_len, BATCH, HEADS, HEAD_DIM), ql.grad, kl.grad, vl.grad)
        errors = {n: (a.double() - e).abs().max().item() / max(1.0, e.abs().max().item())
                  for n, a, e in zip(("out", "dq", "dk", "dv"), got, ref)}
        rows.append({"mask": name, "errors": errors, "cuts": cuts, "resolved": attn.resolved_algo})
    return rows


@pytest.mark.parametrize("world,layout,stripe,algo,local_len", [
    (2, "zigzag", 1, "burst", 64),
    (2, "striped", 4, "ring", 64),
    (3, "striped", 4, "burst", 44),
])
def test_sparse_core_attention_with_window_and_documents_matches_dense_reference(world, layout, stripe, algo,
                                                                                 local_len):
    for rank, rows in enumerate(run_ranks(world, sparse_core_attention_vs_dense, layout, stripe, algo, local_len)):
        assert [row["mask"] for row in rows] == [name for name, _, _ in MASKS]
        for row in rows:
            what = f"CP={world} {layout}/{stripe} {algo} {row['mask']} rank {rank}"
            assert row["resolved"] == f"{algo} sparse", what
            assert row["cuts"] == {"pattern": True, "window_documents": True}, f"{what}: {row['cuts']}"
            for name, err in row["errors"].items():
                assert err <= TOL, f"{what}: {name} off by {err:.2e}"


def thd_batch_is_refused() -> str:
    """Rank body: a CPCoreAttention with sparse budgets handed a packed THD batch; the error text."""
    from megatron.core import parallel_state as ps
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_burst.megatron.attention import CPCoreAttention

    ps.initialize_model_parallel(1, 1, context_parallel_size=1, create_gloo_process_groups=False)
    cfg = TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                            num_query_groups=KV_HEADS, kv_channels=HEAD_DIM, attention_dropout=0.0,
                            use_cpu_initialization=True)
    attn = CPCoreAttention(cfg, 1, AttnMaskType.causal, "self", cp_algo="burst", cp_sparse=BUDGETS)
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                             cu_seqlens_kv_padded=cu, max_seqlen_q=8, max_seqlen_kv=8)
    q, k, v = (torch.randn(16, h, HEAD_DIM) for h in (HEADS, KV_HEADS, KV_HEADS))
    try:
        attn(q, k, v, None, packed_seq_params=params)
    except ValueError as exc:
        return str(exc)
    return "accepted"


def test_sparse_core_attention_refuses_packed_thd_naming_the_fix():
    msg = run_ranks(1, thd_batch_is_refused)[0]
    assert "packed THD batch" in msg and "--reset-attention-mask" in msg and "drop --sparse-attention" in msg, msg


SPARSE_FLAGS = ["--sparse-attention", "vertical_slash", "--sparse-budget", "0.5", "0.5", "--sparse-last-q", "8",
                "--cp-algo", "burst"]
SEQ = 128  # two 64-offset slash pools: the dynamic pattern keeps part of a window of 90


def sparse_gpt_step(cp: int, extra: list[str], eod: Optional[int]) -> dict:
    """Rank body: one step of the tiny GPT (tests/test_megatron_documents.gpt_step) on EOD documents
    (read as documents only with --reset-attention-mask), plus what each layer's attention resolved to."""
    from test_megatron_documents import eod_batch, gpt_step

    return gpt_step(cp, eod_batch(SEQ), eod, SPARSE_FLAGS + extra, seq=SEQ)


@pytest.mark.parametrize("what,extra,documents", [
    ("window", ["--window-size", "90,0"], False),
    ("documents", ["--reset-attention-mask"], True),
])
def test_sparse_gpt_with_window_or_documents_cp2_equals_cp1(what, extra, documents):
    """--sparse-attention with --window-size, and with --reset-attention-mask documents, through
    the trainer's functions: CP = 2 (zigzag and striped) equals CP = 1 in loss and every gradient,
    and the window or the documents change the sparse step."""
    from test_megatron_documents import EOD, _compare

    eod = EOD if documents else None
    ref = run_ranks(1, sparse_gpt_step, 1, extra, eod)[0]
    sparse_only = run_ranks(1, sparse_gpt_step, 1, [], None)[0]
    assert abs(ref["loss"] - sparse_only["loss"]) > 1e-4 * abs(ref["loss"]), f"{what} did not change the step"
    for layout in (["--cp-layout", "zigzag"], ["--cp-layout", "striped", "--cp-stripe", "4"]):
        for rank, res in enumerate(run_ranks(2, sparse_gpt_step, 2, extra + layout, eod)):
            _compare(res, ref)
