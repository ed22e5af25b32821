"""Linear attention and the gated delta rule on one GPU: our ops (torch and fla kernels) against
flash-linear-attention's own kernels, at W = 1 and at W = 2, 4, 8 ranks sharing the GPU.

    python -m megatron_burst.bench linear --gpu [--seq 32768] [--heads 16] [--head-dim 128]
                                                [--forms none head token channel] [--worlds 2 4 8]
                                                [--out FILE.jsonl] [--smoke]

Every measurement is one JSON line, printed and flushed as it is taken (and appended to ``--out``),
in the format of ``python -m megatron_burst.bench gpu`` (its Recorder and timing: CUDA events, the
median of ``--repeats`` after ``--warmup`` iterations, which also hold fla's Triton autotuning and
our self-checks). A measurement that fails is an ``"error"`` line and the run goes on.

``local`` (W = 1, one sequence of ``--seq`` tokens x ``--heads`` heads x ``--head-dim``, bf16): one
forward + backward of

* ``lasp2_<form>`` / ``torch`` and ``fla``: :func:`megatron_burst.linear_attention` with
  ``kernel="torch"`` (our chunked path) and ``kernel="fla"`` (fla's chunk kernels behind it), for
  each decay form: none, head (a fixed Lightning-style decay per head), token (learned, per
  token), channel (learned, per key channel);
* ``lasp2_<form>`` / ``fla_direct``: fla's own kernel on the same tensors (``chunk_simple_gla``;
  ``chunk_gla`` per channel) -- the bar: ours with fla should cost no more than ~1.1x it;
* ``gdn`` / ``torch``, ``fla``, ``fla_direct``: :func:`megatron_burst.gated_delta_rule` both ways
  and fla's ``chunk_gated_delta_rule`` (l2-normalized keys, per-token decay, beta in (0, 1)).

Each line also carries ``errors``: relative Frobenius errors of out, dq, dk, dv (and dg, dbeta) on
the first ``--ref-heads`` heads against our fp32 torch path on the same (bf16-rounded) inputs
(heads are independent, so a slice keeps the fp32 reference affordable at 32K tokens).

``multi_rank`` (W in ``--worlds``, contiguous layout, ``--seq`` global tokens, every rank on the
one GPU through :func:`megatron_burst.launch.run_on_one_gpu`: gloo ranks, the host-staged
transport): per-step fwd+bwd of the slowest rank (median), bytes sent per rank
(:func:`megatron_burst.comm_counter`), and the relative difference of the gathered output and
gradients from the W = 1 run of the same kernel. Variants: ``lasp2_token`` (kernel fla), ``gdn``
(kernel fla), and ``gdn`` / ``fla_cp``: fla 0.6's own context parallelism
(``fla.ops.cp.build_cp_context(cu_seqlens, group, layout="contiguous")`` passed as
``chunk_gated_delta_rule(..., cp_context=...)``; fla's CP covers the delta-rule family only, not
simple GLA / GLA). fla's CP calls ``torch.distributed`` collectives itself on CUDA tensors: on
one GPU the ranks' group is gloo (NCCL refuses two ranks on one device), so fla's CP runs only
if gloo takes its CUDA all-gathers; when it does not, the line records fla's error -- then
compare fla's CP on a multi-GPU machine (``torchrun``, NCCL). Staged timings are not NCCL timings.

``--smoke``: tiny sizes on CPU (fp32, kernel torch only, no fla), every section's plumbing in a few
seconds (tests/test_bench_linear_gpu.py; there also ``--kernels torch fla`` against a stand-in fla).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from megatron_burst.bench import apply_defaults
from megatron_burst.bench.gpu import Recorder, environment, free_memory, tensors_from_bytes, tensors_to_bytes, \
    time_between_barriers, time_interleaved

FORMS = ("none", "head", "token", "channel")
SMOKE = dict(seq=128, heads=2, head_dim=16, ref_heads=2, worlds=[2], repeats=2, warmup=1, max_seconds=1.0)
GRAD_NAMES = {"lasp2": ("dq", "dk", "dv", "dg"), "gdn": ("dq", "dk", "dv", "dg", "dbeta")}


def kernel_lines() -> list[str]:
    from megatron_burst.kernels import choice
    from megatron_burst.linear import kernel_choice
    return choice.report() + kernel_choice.report()


# ------------------------------------------------------------------------------------------ inputs
def make_inputs(op: str, form: str, s: int, h: int, d: int, dtype: torch.dtype, device: torch.device, seed: int = 0
                ) -> dict[str, Optional[torch.Tensor]]:
    """The full sequence's tensors, sbhd with b = 1 (the same memory as fla's [1, T, H, d] rows):
    q, k, v, dout in ``dtype``; g fp32 (None for form "none"; [h] fixed for "head"); beta for gdn."""
    gen = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    q, k, v, dout = mk(s, 1, h, d), mk(s, 1, h, d), mk(s, 1, h, d), mk(s, 1, h, d)
    out: dict[str, Optional[torch.Tensor]] = {"g": None, "beta": None}
    if op == "gdn":
        k = F.normalize(k, dim=-1)
        q = F.normalize(q, dim=-1)
        out["g"] = F.logsigmoid(mk(s, 1, h) + 4.0)  # per-token log-decay, mostly close to 0
        out["beta"] = torch.sigmoid(mk(s, 1, h)).to(dtype)
    elif form == "head":
        out["g"] = -torch.tensor([2.0 ** -(1 + 8 * i / h) for i in range(h)])  # Lightning's per-head schedule
    elif form == "token":
        out["g"] = F.logsigmoid(mk(s, 1, h) + 4.0)
    elif form == "channel":
        out["g"] = F.logsigmoid(mk(s, 1, h, d) + 4.0)
    out.update(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), dout=dout.to(dtype))
    return {n: (None if t is None else t.to(device)) for n, t in out.items()}


def leaves_of(op: str, form: str, x: dict, heads: Optional[int] = None) -> list[torch.Tensor]:
    """Fresh leaves (requiring grad) of the differentiable inputs, optionally the first ``heads`` in fp32."""
    names = ["q", "k", "v"] + (["g", "beta"] if op == "gdn" else (["g"] if form in ("token", "channel") else []))
    pick = (lambda t: t) if heads is None else (lambda t: t[:, :, :heads].float())  # noqa: E731
    return [pick(x[n]).detach().clone().requires_grad_() for n in names]


def run_ours(op: str, form: str, kernel: str, x: dict, leaves: list, heads: Optional[int] = None, **kw
             ) -> torch.Tensor:
    import megatron_burst as mb

    if op == "gdn":
        return mb.gated_delta_rule(*leaves, kernel=kernel, **kw)
    g = leaves[3] if len(leaves) > 3 else (None if x["g"] is None else x["g"][:heads] if heads else x["g"])
    return mb.linear_attention(*leaves[:3], g=g, kernel=kernel, **kw)


def fla_direct_fn(op: str, form: str) -> Callable:
    """fla's own kernel taking our (sbhd, b = 1) leaves, as a user of fla would call it."""
    from megatron_burst.linear import kernel_choice

    fn = kernel_choice.load_fla(op, form)
    if fn is None:
        raise RuntimeError(f"flash-linear-attention is not installed ({kernel_choice.FLA_FIX})")
    rows = lambda t: t.transpose(0, 1)  # noqa: E731  [s, 1, h, ...] -> [1, s, h, ...], a view
    scale_of = lambda q: q.shape[-1] ** -0.5  # noqa: E731

    def call(x: dict, leaves: list) -> torch.Tensor:
        q, k, v = (rows(t) for t in leaves[:3])
        if op == "gdn":
            o, _ = fn(q, k, v, rows(leaves[3]), rows(leaves[4]), scale=scale_of(q))
        elif form == "channel":
            o, _ = fn(q, k, v, rows(leaves[3]), scale=scale_of(q))
        elif form == "token":
            o, _ = fn(q, k, v, g=rows(leaves[3]), scale=scale_of(q))
        else:
            o, _ = fn(q, k, v, g_gamma=x["g"], scale=scale_of(q))
        return o.transpose(0, 1)
    return call


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float().to(a.device)
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def reference(op: str, form: str, x: dict, heads: int) -> list[torch.Tensor]:
    """Our fp32 torch path on the first ``heads`` heads: [out, grads...]."""
    leaves = leaves_of(op, form, x, heads)
    o = run_ours(op, form, "torch", x, leaves, heads)
    o.backward(x["dout"][:, :, :heads].float())
    return [o.detach()] + [t.grad for t in leaves]


def errors(op: str, got: list[torch.Tensor], ref: list[torch.Tensor], heads: int) -> dict:
    names = ("out",) + GRAD_NAMES[op]
    sliced = [got[0][:, :, :heads]] + [t[:, :, :heads] if t.dim() >= 3 else t[:heads] for t in got[1:]]
    return {n: rel(a, b) for n, a, b in zip(names, sliced, ref)}


# ------------------------------------------------------------------------------------------ local (W = 1)
def measure(rec: Recorder, args, device, name: str, op: str, form: str, x: dict,
            forwards: dict[str, Callable[[list], torch.Tensor]], ref: Optional[list], shape: dict) -> None:
    """Time fwd+bwd of each ``variant -> forward(leaves)``, warmed alike and their repeats interleaved
    (:func:`~megatron_burst.bench.gpu.time_interleaved`: ours and fla's own call see the same GPU, and
    fla's first-use autotuning lands on neither), and record each with its errors against ``ref``; a
    variant that fails is recorded as such."""
    cases, leaves = {}, {}
    for variant, forward in forwards.items():
        leaves[variant] = ls = leaves_of(op, form, x)

        def zero(ls=ls):
            for t in ls:
                t.grad = None
        cases[variant] = ((lambda forward=forward, ls=ls: forward(ls)), (lambda o: o.backward(x["dout"])), zero)
    try:
        timings = time_interleaved(cases, device, args.warmup, args.repeats, args.max_seconds)
    except Exception as e:  # noqa: BLE001  recorded, and the run goes on
        timings = {variant: e for variant in forwards}
    for variant, timing in timings.items():
        try:
            if isinstance(timing, Exception):
                raise timing
            fwd, bwd, zero = cases[variant]
            zero()
            o = fwd()
            bwd(o)
            errs = errors(op, [o.detach()] + [t.grad for t in leaves[variant]], ref, args.ref_heads) if ref else None
            rec.emit("local", name, variant, dtype=str(x["q"].dtype).replace("torch.", ""), shape=shape, **timing,
                     errors=errs, error_heads=args.ref_heads, linear_kernels=kernel_lines())
        except Exception as e:  # noqa: BLE001  recorded, and the run goes on
            rec.error("local", name, variant, e, shape=shape)
    del cases, leaves
    free_memory(device)


def section_local(rec: Recorder, args, device: torch.device, dtype: torch.dtype) -> None:
    s, h, d = args.seq, args.heads, args.head_dim
    cases = [("lasp2", f) for f in args.forms] + ([("gdn", "token")] if not args.no_gdn else [])
    for op, form in cases:
        name = f"lasp2_{form}" if op == "lasp2" else "gdn"
        shape = {"s": s, "b": 1, "h": h, "d": d, "W": 1}
        x = make_inputs(op, form, s, h, d, dtype, device)
        ref = None
        try:
            ref = reference(op, form, x, args.ref_heads)
        except Exception as e:  # noqa: BLE001
            rec.error("local", name, "fp32_reference", e, shape=shape)
        refused = _fla_refusal(op, form)
        forwards: dict[str, Callable[[list], torch.Tensor]] = {}
        for kernel in args.kernels:
            if kernel == "fla" and refused:  # fla raises in the backward, after its forward's compiles
                rec.skip("local", name, kernel, refused, shape=shape)
                continue
            forwards[kernel] = lambda leaves, kernel=kernel: run_ours(op, form, kernel, x, leaves)
        if "fla" in args.kernels and refused:
            rec.skip("local", name, "fla_direct", refused, shape=shape)
        elif "fla" in args.kernels:  # fla's own kernel, the bar, whenever ours runs with fla
            try:
                direct = fla_direct_fn(op, form)
                forwards["fla_direct"] = lambda leaves: direct(x, leaves)
            except Exception as e:  # noqa: BLE001
                rec.error("local", name, "fla_direct", e, shape=shape)
        measure(rec, args, device, name, op, form, x, forwards, ref, shape)
        del x, ref
        free_memory(device)


def _fla_refusal(op: str, form: str) -> Optional[str]:
    """Why fla refuses (op, form)'s backward on this machine (None: it runs it): the variants it
    would refuse are recorded as skipped with that reason instead of failing late."""
    from megatron_burst.linear import kernel_choice

    why = kernel_choice.fla_refusal(op, form)
    return None if why is None else f"{why}; carry a newer Triton for the linear parts: scripts/triton_bundle.sh"


# ------------------------------------------------------------------------------------------ multi_rank
def multi_rank_body(cfg: dict) -> dict:
    """One of W ranks: this rank's contiguous shard of the full inputs (built from a seed on every
    rank), each variant timed between barriers; returns medians, bytes sent and the last
    iteration's output and gradients (CPU bytes) per variant."""
    import torch.distributed as dist

    import megatron_burst as mb
    from megatron_burst.bench.launch import in_step

    W, r = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device()) if cfg["cuda"] else torch.device("cpu")
    dt = getattr(torch, cfg["dtype"])
    res: dict[str, Any] = {"rank": r, "times": {}, "sent": {}, "tensors": {}}

    def run(variant: str, sync) -> None:
        op, form, how = variant.split(":")
        full = make_inputs(op, form, cfg["s"], cfg["h"], cfg["d"], dt, torch.device("cpu"), cfg["seed"])
        x: dict[str, Optional[torch.Tensor]] = {}
        for n, t in full.items():  # a per-head decay [h] is every rank's; token-major tensors are sharded
            x[n] = None if t is None else (t if t.dim() == 1 else mb.shard(t, 0, r, W, "contiguous")).to(dev)
        forward = _multi_forward(op, form, how, x, cfg, dev)
        samples, sent, last = [], 0, {}

        def step() -> None:
            last["o"] = o = forward(leaves)
            o.backward(x["dout"])

        for i in range(cfg["warmup"] + cfg["repeats"]):
            leaves = leaves_of(op, form, x)
            with mb.comm_counter() as counter:
                ms = time_between_barriers(step, sync, cfg["cuda"])
            if i >= cfg["warmup"]:
                samples.append(ms)
                sent = counter.bytes("sent")
        o = last["o"]
        res["times"][variant] = statistics.median(samples)
        res["sent"][variant] = sent
        res["tensors"][variant] = tensors_to_bytes([o] + [t.grad for t in leaves])

    res["errors"] = in_step(list(cfg["variants"]), run)  # a failure on one rank never strands the others
    res["kernels"] = kernel_lines()
    return res


def _multi_forward(op: str, form: str, how: str, x: dict, cfg: dict, dev: torch.device) -> Callable:
    if how != "fla_cp":
        return lambda leaves: run_ours(op, form, how, x, leaves, layout="contiguous")
    import torch.distributed as dist
    from fla.ops.cp import build_cp_context

    from megatron_burst.linear import kernel_choice

    fn = kernel_choice.load_fla("gdn", "token")
    cu = torch.tensor([0, cfg["s"]], dtype=torch.int32, device=dev)
    context = build_cp_context(cu, group=dist.group.WORLD, layout="contiguous")
    rows = lambda t: t.transpose(0, 1)  # noqa: E731

    def forward(leaves):
        q, k, v, g, beta = (rows(t) for t in leaves)
        o, _ = fn(q, k, v, g, beta, scale=q.shape[-1] ** -0.5, cp_context=context)
        return o.transpose(0, 1)
    return forward


def section_multi_rank(rec: Recorder, args, device: torch.device, dtype: torch.dtype) -> None:
    import megatron_burst as mb

    cuda = device.type == "cuda"
    how = "fla" if cuda else "torch"
    variants = [f"lasp2:token:{how}"] + ([] if args.no_gdn else [f"gdn:token:{how}"] +
                                         (["gdn:token:fla_cp"] if cuda else []))
    for variant in list(variants):  # forms fla refuses on this machine: said once, not run W + 1 times
        op, form, kern = variant.split(":")
        refused = _fla_refusal(op, form) if kern.startswith("fla") else None
        if refused:
            rec.skip("multi_rank", f"W{'/'.join(map(str, args.worlds))}_s{args.seq}", variant, refused)
            variants.remove(variant)
    cfg = {"s": args.seq, "h": args.heads, "d": args.head_dim, "dtype": str(dtype).replace("torch.", ""), "seed": 3,
           "variants": variants, "warmup": args.warmup, "repeats": args.repeats, "cuda": cuda}
    transport = "host_staged (CUDA tensors through pinned host memory over gloo)" if cuda else \
        "host_staged_cpu (CPU gloo ranks: the smoke path)"
    single = {}  # W = 1 of the same kernel, for the gathered results' sanity check
    for variant in variants:
        op, form, kern = variant.split(":")
        if kern == "fla_cp":
            continue
        try:
            x = make_inputs(op, form, args.seq, args.heads, args.head_dim, dtype, device, cfg["seed"])
            leaves = leaves_of(op, form, x)
            o = run_ours(op, form, kern, x, leaves)
            o.backward(x["dout"])
            single[variant] = [o.detach()] + [t.grad for t in leaves]
            if op == "gdn":  # fla's CP computes the same function: held to the same W = 1 result
                single["gdn:token:fla_cp"] = single[variant]
        except Exception as e:  # noqa: BLE001
            rec.error("multi_rank", f"W1_s{args.seq}", variant, e)
    for W in args.worlds:
        name = f"W{W}_s{args.seq}"
        shape = {"W": W, "s": args.seq, "b": 1, "h": args.heads, "d": args.head_dim, "layout": "contiguous"}
        t0 = time.perf_counter()
        try:
            if cuda:
                from megatron_burst.launch import run_on_one_gpu
                results = run_on_one_gpu(multi_rank_body, W, cfg)
            else:
                from megatron_burst.bench.launch import run_local
                results = run_local(W, multi_rank_body, cfg, env={"MEGATRON_BURST_TRANSPORT": "host_staged_cpu"})
        except Exception as e:  # noqa: BLE001
            rec.error("multi_rank", name, "run", e, shape=shape, transport=transport)
            continue
        for variant in variants:
            errs = {res["rank"]: res["errors"][variant] for res in results if variant in res["errors"]}
            if errs:
                rec.emit("multi_rank", name, variant, error=next(iter(errs.values()))[:2000], failed_ranks=sorted(errs),
                         shape=shape, transport=transport)
                continue
            per_rank = [res["times"][variant] for res in results]
            sanity = None
            if single.get(variant) is not None:
                shards = [tensors_from_bytes(res["tensors"][variant]) for res in results]
                # contiguous layout: rank r holds tokens [r s / W, (r + 1) s / W) of every token-major tensor
                gathered = [torch.cat([sh[i] for sh in shards], 0) for i in range(len(shards[0]))]
                names = ("out",) + GRAD_NAMES[variant.split(":")[0]]
                sanity = {n: rel(a.to(device), b) for n, a, b in zip(names, gathered, single[variant])}
            rec.emit("multi_rank", name, variant, dtype=cfg["dtype"], shape=shape, ms=max(per_rank),
                     per_rank_ms=per_rank, sent_bytes_per_rank=max(res["sent"][variant] for res in results),
                     rel_diff_vs_w1=sanity, transport=transport, rank_kernels=results[0].get("kernels"),
                     wall_s=time.perf_counter() - t0,
                     note="per-step fwd+bwd of the slowest rank; staged timings are not NCCL timings")
    free_memory(device)


# ------------------------------------------------------------------------------------------ driver
def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatron_burst.bench linear --gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", action="store_true", help="(selects this benchmark from `bench linear`)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU, fp32, kernel torch, no fla")
    p.add_argument("--sections", nargs="+", default=["local", "multi_rank"], choices=["local", "multi_rank"])
    p.add_argument("--out", default=None, help="also write the JSON lines to this file")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="default bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--seq", type=int, default=32768, help="tokens of the one sequence (W = 1) / the global sequence")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--forms", nargs="+", default=list(FORMS), choices=list(FORMS), help="LASP-2 decay forms")
    p.add_argument("--kernels", nargs="+", default=["torch", "fla"], choices=["torch", "fla"],
                   help="our ops' kernels timed at W = 1")
    p.add_argument("--no-gdn", action="store_true", help="leave the gated delta rule out")
    p.add_argument("--ref-heads", type=int, default=2, help="heads the fp32 reference errors are measured on")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--max-seconds", type=float, default=3.0, help="cut the repeats of one measurement to about this")
    p.add_argument("--autotune-configs", type=int, default=0,
                   help="try at most this many launch configs per Triton kernel (fla's and ours alike; 0: all). "
                        "Caps the minutes of first-use autotuning on a fresh machine; recorded in every line")
    args = p.parse_args(argv)
    if args.smoke:
        given = apply_defaults(args, argv, SMOKE)
        if "kernels" not in given:
            args.kernels = ["torch"]
    return args


def main(argv=None) -> None:
    args = parse(argv if argv is not None else sys.argv[1:])
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.smoke else "cpu"))
    if device.type == "cuda":
        if device.index is not None:  # torch 2.11's set_device refuses a device without an index
            torch.cuda.set_device(device)
        device = torch.device("cuda", torch.cuda.current_device())
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference in real fp32
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    env = environment(device)
    if args.autotune_configs > 0:
        from megatron_burst.bench.autotune_limit import limit_autotune
        limit_autotune(args.autotune_configs)
        env["autotune_configs"] = args.autotune_configs
    rec = Recorder(args.out, env)
    t0 = time.perf_counter()
    print(f"# bench linear --gpu: {env['device']}, torch {env['torch']}, triton {env['triton']}, {dtype}, "
          f"{args.seq} tokens x {args.heads} heads x {args.head_dim}{' (smoke)' if args.smoke else ''}", flush=True)
    runners = {"local": section_local, "multi_rank": section_multi_rank}
    for sec in args.sections:
        t = time.perf_counter()
        try:
            runners[sec](rec, args, device, dtype)
        except Exception as e:  # noqa: BLE001  a section's own failure is recorded too
            rec.error(sec, "section", "-", e)
        rec.emit(sec, "section", "done", seconds=time.perf_counter() - t)
    rec.close()
    print(f"\n## bench linear --gpu ({env['device']}; {time.perf_counter() - t0:.1f} s)\n")
    print(table(rec.lines))


def table(lines: list[dict]) -> str:
    """Markdown: one row per measurement -- ms, ratio to fla's own kernel (local), errors."""
    direct = {l["name"]: l["ms"] for l in lines if l.get("variant") == "fla_direct" and "ms" in l}
    rows = ["| section | name | variant | ms | / fla_direct | MB sent/rank | max error vs fp32 | note |",
            "|---|---|---|---|---|---|---|---|"]
    for l in lines:
        if l.get("variant") == "done":
            continue
        ms = l.get("ms")
        ratio = f"{ms / direct[l['name']]:.2f}x" if ms and l["name"] in direct else ""
        errs = l.get("errors") or l.get("rel_diff_vs_w1") or {}
        worst = f"{max(errs.values()):.2e}" if errs else ""
        sent = f"{l['sent_bytes_per_rank'] / 1e6:.3f}" if l.get("sent_bytes_per_rank") is not None else ""
        note = (l.get("error") or l.get("skipped") or "")[:80].replace("|", "/").replace("\n", " ")
        rows.append(f"| {l['section']} | {l['name']} | {l['variant']} | {'' if ms is None else f'{ms:.2f}'} | "
                    f"{ratio} | {sent} | {worst} | {note} |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
