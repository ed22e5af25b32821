"""Where the GPU time goes in the cases that miss their bars (one device call, about 40 s).

    python scripts/gpu_profile.py [--out FILE] [--sections loss docs]

* ``loss``: fused_linear_cross_entropy fwd+bwd at (N 16384, V 131072, d 4096) bf16, the default
  (d weight in the forward) and weight_grad="backward" (the memory-lean mode), beside the unfused
  bf16 GEMM + fp32 cross-entropy: median ms, peak memory and the top CUDA kernels of one step.
* ``docs``: cp_attention at W = 1 over 64 equal documents of a 32K sequence (GQA 32/8, d 128, bf16)
  beside torch's varlen flash on the same documents: median ms and top kernels, plus the host time of
  one call issued behind a long GPU queue (a host sync in the call shows up as the queue's length).

Writes a text report (kernel tables) to --out as it goes; nothing here is a test.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch


def _timed(step) -> dict:
    """The bench's timing of ``step()`` (fwd and bwd in one closure): median ms and peak MiB above
    what was allocated before."""
    from megatron_burst.bench.gpu import time_fwd_bwd

    return time_fwd_bwd(step, lambda _: None, torch.device("cuda"), warmup=2, repeats=5, max_seconds=3.0)


def _kernels(step, rows: int = 14) -> str:
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70)


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

    for name, step in (("fused default (d weight in the forward)", fused("forward")),
                       ("fused weight_grad=backward (lean)", fused("backward")), ("unfused bf16 + fp32 CE", unfused)):
        t = _timed(step)
        report(f"## loss: {name}: {t['ms']:.1f} ms, peak {t['peak_extra_mib']:.0f} MiB above the inputs\n"
               + _kernels(step))


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--sections", nargs="+", default=["docs", "loss"], choices=["docs", "loss"])
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
            {"docs": section_docs, "loss": section_loss}[s](report)
        except Exception as e:  # noqa: BLE001
            report(f"## {s}: {type(e).__name__}: {e}")
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
