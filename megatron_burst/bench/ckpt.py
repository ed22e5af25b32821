"""Sequence-level selective checkpointing benchmark: stored attention bytes and training-step time.

    python -m megatron_burst.bench ckpt --cp 2 --seq 8192 --hidden 512 --heads 4 --repeats 11

A GPT (megatron_burst.train's model) under Megatron's full activation recompute, in modes:

* ``full recompute``: every layer recomputed, attention included; no attention output stored.
* ``seq-selective r``: ``--seq-selective-ckpt-ratio r``: (out, lse) of the later r of each
  sequence stored, attention recomputed only for the earlier part.
* ``selective++``: ratio 1.0: every attention output stored, attention never recomputed.
* ``no recompute``: for reference (stores every activation of the layer).

Stored attention bytes are the selective-checkpoint stores' peak, summed over layers (max over
ranks). Step time is one forward + backward of the same batch, median of ``--repeats``, with the
modes interleaved within each repeat; the ratios are medians of per-repeat ratios (each pair of
steps measured back to back), so slow drifts of the machine cancel.

The default model has head dim 128, like production LLMs. The trade-off depends on the cost of
recomputing the earlier half, c (1/4 of a causal forward's FLOPs), and on attention's share of
the step (see the README); on this CPU kernel c is ~0.29 at head dim 128 and ~0.31-0.34 at head
dim 32, where short causal blocks waste more of every tile.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from megatron_burst.bench import plotting
from megatron_burst.bench.launch import run_local

MODES = [("full recompute", ["--recompute-granularity", "full"]),
         ("seq-selective {r}", ["--recompute-granularity", "full", "--seq-selective-ckpt-ratio", "{r}"]),
         ("selective++", ["--recompute-granularity", "full", "--seq-selective-ckpt-ratio", "1.0"]),
         ("no recompute", [])]


def _rank(args) -> dict:
    from megatron_burst import train

    torch.set_num_threads(args.threads)
    models = {}
    base = ["--num-layers", str(args.layers), "--hidden-size", str(args.hidden), "--num-attention-heads",
            str(args.heads), "--seq-length", str(args.seq), "--micro-batch-size", "1", "--lr", "1e-4",
            "--train-iters", "1", "--context-parallel-size", str(args.cp), "--cp-layout", args.layout,
            "--cp-algo", args.algo]
    groups = None
    for name, extra in MODES:
        name = name.format(r=args.ratio)
        targs = train.build_parser().parse_args(base + [e.format(r=args.ratio) for e in extra])
        opts_m, sizes = train.validate_args(targs, dist.get_world_size())
        targs.padded_vocab_size = 256
        if groups is None:
            groups = train.init_parallel(sizes)
        train.seed_everything(targs.seed, torch.device("cpu"))
        models[name] = (train.build_model(targs, opts_m, sizes, groups, torch.device("cpu")), opts_m)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (1, args.seq + 1), generator=g)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(1, args.seq),
             "position_ids": torch.arange(args.seq)[None]}
    times: dict[str, list[float]] = {name: [] for name in models}
    losses = {}
    for i in range(args.warmup + args.repeats):
        for name, (model, opts_m) in models.items():
            model.zero_grad(set_to_none=True)
            dist.barrier()
            t0 = time.perf_counter()
            loss = train.loss_and_grads(model, [batch], opts_m, groups, torch.device("cpu"))
            dist.barrier()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)
            losses[name] = loss.item()
    stored = {}
    for name, (model, _) in models.items():
        caches = [layer.self_attention.core_attention.selective_cache for layer in model.decoder.layers]
        stored[name] = sum(c.peak_nbytes for c in caches if c is not None)
    return {"times": times, "stored": stored, "losses": losses}


def _plot(times: dict, stored: dict, path: str) -> None:
    """Stored attention bytes against step time, one point per mode."""
    plt = plotting.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    for name in times:
        if name == "no recompute":
            continue
        ax.scatter(stored[name] / 1e6, times[name], s=40)
        ax.annotate(name, (stored[name] / 1e6, times[name]), textcoords="offset points", xytext=(6, 4), fontsize=8)
    ax.set_xlabel("stored attention (out, lse) per rank, MB")
    ax.set_ylabel("training step, s (median)")
    ax.set_title("sequence-level selective checkpointing vs alternatives", fontsize=9)
    plotting.save(fig, path)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m megatron_burst.bench ckpt", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=4, help="hidden / heads = head dim (128 by default)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--ratio", type=float, default=0.5)
    p.add_argument("--layout", default="striped", help="striped balances the recompute over ranks")
    p.add_argument("--algo", default="burst")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--plot", default="docs/ckpt.png", help="'' to skip")
    args = p.parse_args(argv)
    res = run_local(args.cp, _rank, args, threads=args.threads)
    # A step ends at a barrier, so ranks agree to within the barrier's latency; take the slowest.
    per_repeat = {k: [max(r["times"][k][i] for r in res) for i in range(args.repeats)] for k in res[0]["times"]}
    times = {k: statistics.median(v) for k, v in per_repeat.items()}

    def paired(a: str, b: str) -> float:
        """Median over repeats of t_a / t_b, each pair measured back to back (robust to drift)."""
        return statistics.median(x / y for x, y in zip(per_repeat[a], per_repeat[b]))

    stored = {k: max(r["stored"][k] for r in res) for k in res[0]["stored"]}
    print(f"# GPT {args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq {args.seq}, CP={args.cp} "
          f"({args.layout}, {args.algo}), fp32, full activation recompute; median of {args.repeats}")
    print("| mode | stored attention MB (per rank) | vs selective++ | step s | vs selective++ | speedup vs full recompute |")
    print("|---|---|---|---|---|---|")
    for name in times:
        if name == "no recompute":  # autograd keeps every activation of the layer: not a store
            kept, rel = "all activations", "—"
        else:
            kept, rel = f"{stored[name] / 1e6:.2f}", f"{stored[name] / stored['selective++']:.2f}"
        print(f"| {name} | {kept} | {rel} | {times[name]:.3f} | "
              f"{paired(name, 'selective++'):.3f} | {paired('full recompute', name):.3f}x |")
    seq_name = f"seq-selective {args.ratio}"
    for a, b in ((seq_name, "selective++"), ("full recompute", seq_name)):
        r = sorted(x / y for x, y in zip(per_repeat[a], per_repeat[b]))
        print(f"per-repeat {a} / {b}: min {r[0]:.3f}, median {statistics.median(r):.3f}, max {r[-1]:.3f}")
    if args.plot:
        _plot(times, stored, args.plot)
    losses = res[0]["losses"]
    spread = max(losses.values()) - min(losses.values())
    print(f"losses agree across modes: max difference {spread:.2e} (loss {losses[seq_name]:.6f})")


if __name__ == "__main__":
    main()
