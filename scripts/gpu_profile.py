"""Where the GPU time goes in the cases that miss their bars (one device call, about 40 s).

    python scripts/gpu_profile.py [--out FILE] [--sections loss docs fusions]

* ``loss``: fused_linear_cross_entropy fwd+bwd at (N 16384, V 131072, d 4096) bf16, the default
  (d weight in the forward) and weight_grad="backward" (the memory-lean mode), beside the unfused
  bf16 GEMM + fp32 cross-entropy: median ms, peak memory and the top CUDA kernels of one step.
* ``docs``: cp_attention at W = 1 over 64 equal documents of a 32K sequence (GQA 32/8, d 128, bf16)
  beside torch's varlen flash on the same documents: median ms and top kernels, plus the host time of
  one call issued behind a long GPU queue (a host sync in the call shows up as the queue's length).

* ``fusions``: what ``--te-free-fusions`` replaces, at the e2e model's sizes (1.17B GPT, 16K tokens):
  the Triton RoPE kernel vs megatron.core's unfused RoPE on q and k of one layer (fwd+bwd, q a
  strided view of the fused QKV projection), torch's fused Adam vs the foreach AdamW on the model's
  1.17B fp32 parameters, and the foreach gradient norm / fp32 -> bf16 parameter copy vs
  megatron.core's per-tensor loops; ms per call and per training step (x 24 layers for RoPE).

Writes a text report (kernel tables) to --out as it goes; nothing here is a test.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch


def _timed(step, device: torch.device = torch.device("cuda")) -> dict:
    """The bench's timing of ``step()`` (fwd and bwd in one closure): median ms and, on CUDA, peak
    MiB above what was allocated before (the wall clock on CPU: the smoke test)."""
    from megatron_burst.bench.gpu import time_fwd_bwd

    return time_fwd_bwd(step, lambda _: None, device, warmup=2, repeats=5, max_seconds=3.0)


def _kernels(step, rows: int = 14, gemm_shapes: bool = False) -> str:
    """The top ``rows`` CUDA kernels / ops of one step; ``gemm_shapes``: also aten::mm / addmm grouped by
    their input shapes (which GEMM shapes take the time: e.g. the lean loss's vocabulary tiles by height)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=gemm_shapes) as prof:
        step()
        torch.cuda.synchronize()
    text = prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70)
    if gemm_shapes:
        rows_by_shape = [e for e in prof.key_averages(group_by_input_shape=True) if e.key in ("aten::mm", "aten::addmm")]
        rows_by_shape.sort(key=lambda e: -e.device_time_total)
        text += "\nGEMMs by input shapes (calls, device ms in all, us per call):\n" + "\n".join(
            f"{e.key:12s} {e.count:4d} {e.device_time_total / 1e3:8.2f} {e.device_time_total / max(1, e.count):9.1f}  "
            f"{e.input_shapes}" for e in rows_by_shape[:60])
    return text


def section_loss(report) -> None:
    from megatron_burst import fused_linear_cross_entropy

    N, V, d = 16384, 131072, 4096
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    hidden = (torch.randn(N, 1, d, generator=g, device=dev)).to(dt).requires_grad_()
    weight = (torch.randn(V, d, generator=g, device=dev) * d ** -0.5).to(dt).requires_grad_()
    labels = torch.randint(0, V, (N, 1), device=dev, generator=g)
    mask = torch.ones(N, 1, device=dev)

    def fused(mode):
        def step():
            hidden.grad = weight.grad = None
            loss = fused_linear_cross_entropy(hidden, weight, labels, loss_mask=mask, weight_grad=mode)
            (loss * mask).sum().backward()
        return step

    def unfused():
        hidden.grad = weight.grad = None
        logits = hidden.view(N, d) @ weight.t()
        torch.nn.functional.cross_entropy(logits.float(), labels.view(N), reduction="sum").backward()

    # the lean mode first (the bar's variant), with more rows and its GEMMs by shape
    for name, step, rows, shapes in (("fused weight_grad=backward (lean)", fused("backward"), 30, True),
                                     ("fused default (d weight in the forward)", fused("forward"), 14, False),
                                     ("unfused bf16 + fp32 CE", unfused, 14, False)):
        t = _timed(step)
        report(f"## loss: {name}: {t['ms']:.1f} ms, peak {t['peak_extra_mib']:.0f} MiB above the inputs\n"
               + _kernels(step, rows, shapes))


def section_docs(report) -> None:
    import megatron_burst as mb
    from megatron_burst.bench.gpu import varlen_fn, varlen_runner

    S, hq, hkv, D, count = 32768, 32, 8, 128, 64
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(S, 1, hq, D, generator=g, device=dev).to(dt).requires_grad_()
    k = torch.randn(S, 1, hkv, D, generator=g, device=dev).to(dt).requires_grad_()
    v = torch.randn(S, 1, hkv, D, generator=g, device=dev).to(dt).requires_grad_()
    dout = torch.randn(S, 1, hq, D, generator=g, device=dev).to(dt)
    cu = torch.arange(0, S + 1, S // count, dtype=torch.int32, device=dev)

    def ours():
        q.grad = k.grad = v.grad = None
        mb.cp_attention(q, k, v, algo="burst", layout="contiguous", cu_seqlens=cu).backward(dout)

    flash, _ = varlen_fn(*varlen_runner(), cu, S // count, None, hq)  # the bench's baseline, this torch's names

    def varlen():
        q.grad = k.grad = v.grad = None
        flash(q, k, v).backward(dout)

    for name, step in (("cp_attention W=1, 64 equal documents", ours), ("varlen flash, same documents", varlen)):
        try:
            ms = _timed(step)["ms"]
            # host time of one step while the GPU is busy with a long queue ahead of it: the launch overhead
            torch.cuda._sleep(int(2e8))
            t0 = time.perf_counter()
            step()
            host = (time.perf_counter() - t0) * 1e3
            torch.cuda.synchronize()
            report(f"## docs: {name}: {ms:.2f} ms, host {host:.2f} ms per step\n" + _kernels(step, rows=20))
        except Exception as e:  # noqa: BLE001  a profile is a diagnosis: report and go on
            report(f"## docs: {name}: {type(e).__name__}: {e}")


def e2e_param_shapes(layers: int = 24, h: int = 2048, heads: int = 16, groups: int = 8, d: int = 128,
                     ffn: int = 5440, vocab: int = 32128) -> list:
    """The parameter shapes of examples/e2e_gpt_1b.py's model (1,170,049,024 values)."""
    per_layer = [((heads + 2 * groups) * d, h), (h, heads * d), (2 * ffn, h), (h, ffn), (h,), (h,)]
    return per_layer * layers + [(vocab, h), (h,)]


def section_fusions(report, dev: torch.device = torch.device("cuda"), S: int = 16384, layers: int = 24,
                    shapes: list = None) -> None:
    """See the module docstring; ``dev``, ``S``, ``layers`` and the optimizer's parameter ``shapes``
    (default: the e2e model's) shrink it for the CPU smoke test (tests/test_gpu_profile_smoke.py)."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.utils import local_multi_tensor_l2_norm, local_multi_tensor_scale

    from megatron_burst.fusions import FusedTorchAdam, apply_rope, multi_tensor_l2norm, multi_tensor_scale
    from megatron_burst.train.mixed_precision import cuda_calls_on_cpu

    dt = torch.bfloat16
    heads, groups, D = 16, 8, 128
    g = torch.Generator(device=dev).manual_seed(0)
    qkv = torch.randn(S, 1, groups, (heads // groups + 2) * D, generator=g, device=dev).to(dt)
    q = qkv[..., : heads // groups * D].reshape(S, 1, heads, D)  # Megatron's split: views of the projection
    k = qkv[..., heads // groups * D: (heads // groups + 1) * D]
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, device=dev, dtype=torch.float32) / D))
    f = torch.outer(torch.arange(S, device=dev, dtype=torch.float32), inv)
    freqs = torch.cat((f, f), -1)[:, None, None, :]
    dq, dk = torch.randn_like(q), torch.randn_like(k)

    def rope_step(fn):
        def step():
            x, y = q.detach().requires_grad_(), k.detach().requires_grad_()
            torch.autograd.backward([fn(x, freqs), fn(y, freqs)], [dq, dk])
        return step

    fused_ms = _timed(rope_step(apply_rope), dev)["ms"]
    unfused_ms = _timed(rope_step(rope_utils._apply_rotary_pos_emb_bshd), dev)["ms"]
    report(f"## fusions: RoPE q+k fwd+bwd, one layer (s {S}, {heads}/{groups} heads of {D}): Triton "
           f"{fused_ms:.3f} ms, megatron.core unfused {unfused_ms:.3f} ms; x {layers} layers: "
           f"{fused_ms * layers:.1f} vs {unfused_ms * layers:.1f} ms per step"
           + ("\n" + _kernels(rope_step(apply_rope), rows=6) if dev.type == "cuda" else ""))

    shapes = shapes or e2e_param_shapes(layers=layers)
    params = [torch.randn(s, generator=g, device=dev) * 0.02 for s in shapes]
    grads = [torch.randn(s, generator=g, device=dev) * 1e-3 for s in shapes]
    n = sum(p.numel() for p in params)
    for name, make in (("torch AdamW (foreach, megatron.core's TE-free fallback)",
                        lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1, foreach=True)),
                       ("FusedTorchAdam (torch fused Adam)",
                        lambda ps: FusedTorchAdam(ps, lr=1e-4, weight_decay=0.1, adam_w_mode=True))):
        ps = [p.clone().requires_grad_() for p in params]
        for p, gr in zip(ps, grads):
            p.grad = gr
        opt = make(ps)
        t = _timed(opt.step, dev)
        # on CUDA: the first (warm-up) step creates the two moments; foreach adds its temporaries
        extra = f", peak {t['peak_extra_mib'] / 1024:.1f} GiB above the parameters and gradients" \
            if t.get("peak_extra_mib") is not None else ""
        report(f"## fusions: optimizer step on {n:,} fp32 parameters ({len(ps)} tensors): {name}: {t['ms']:.1f} ms"
               + extra)
        del opt, ps
        torch.cuda.empty_cache()
    noop = torch.zeros(1, dtype=torch.int, device=dev)
    bf16 = [torch.empty_like(p, dtype=dt) for p in params]
    for name, norm, scale in (("megatron.core local loops", local_multi_tensor_l2_norm, local_multi_tensor_scale),
                              ("torch _foreach (ours)", multi_tensor_l2norm, multi_tensor_scale)):
        with cuda_calls_on_cpu(dev):  # megatron.core's loops allocate on 'cuda' (a no-op on a GPU)
            norm_ms = _timed(lambda: norm(2048 * 32, noop, [grads], False)[0].item(), dev)["ms"]
            copy_ms = _timed(lambda: scale(2048 * 32, noop, [params, bf16], 1.0), dev)["ms"]
        report(f"## fusions: {name}: gradient norm (to the host, as clip_grads reads it) {norm_ms:.1f} ms, "
               f"fp32 main -> bf16 model copy {copy_ms:.1f} ms")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--sections", nargs="+", default=["docs", "loss"], choices=["docs", "loss", "fusions"])
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_profile: needs CUDA", file=sys.stderr)
        return 2

    def report(text: str) -> None:
        print(text, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(text + "\n\n")

    report(f"{torch.cuda.get_device_name()} torch {torch.__version__}")
    for s in args.sections:
        try:
            {"docs": section_docs, "loss": section_loss, "fusions": section_fusions}[s](report)
        except Exception as e:  # noqa: BLE001
            report(f"## {s}: {type(e).__name__}: {e}")
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
