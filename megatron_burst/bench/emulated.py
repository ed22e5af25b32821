"""Run one benchmark's ranks on emulated nodes (megatron_burst.bench.netns) and collect their results.

The benchmark module is re-run inside each node's namespace as ``python -m megatron_burst.bench
<name> --worker --rank R --world-size W --out DIR <forwarded flags>``; each rank writes
``DIR/rank<R>.json`` and ends through megatron_burst.world.exit_rank. Each rank drives its own NIC
(rail), as GPUs do on the clusters the papers measure.

With ``cpu_per_rank`` each rank also runs in a CPU cgroup (v1 ``cpu`` controller) capped at that
many cores. More ranks than cores otherwise share the cores unevenly: a rank that waits lends its
core to the others, so a schedule that leaves ranks idle (a sequential chain) looks cheaper than on
real hardware, where each rank owns its device. A fixed cap makes every rank a device of fixed speed.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from megatron_burst.bench.netns import EmulatedNodes, NetnsError


CPU_CGROUP_ROOT = "/sys/fs/cgroup/cpu"
CFS_PERIOD_US = 100_000


def _cpu_cgroups(world: int, cpu_per_rank: float) -> list[str]:
    """One cgroup per rank capped at ``cpu_per_rank`` cores; their paths (SystemExit if impossible)."""
    if not os.path.isdir(CPU_CGROUP_ROOT) or not os.access(CPU_CGROUP_ROOT, os.W_OK):
        raise SystemExit(f"--cpu-per-rank {cpu_per_rank} needs a writable cgroup v1 cpu controller at "
                         f"{CPU_CGROUP_ROOT} (run as root), or drop --cpu-per-rank")
    paths = []
    for r in range(world):
        path = os.path.join(CPU_CGROUP_ROOT, f"megatron_burst_{os.getpid()}_rank{r}")
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "cpu.cfs_period_us"), "w") as f:
            f.write(str(CFS_PERIOD_US))
        with open(os.path.join(path, "cpu.cfs_quota_us"), "w") as f:
            f.write(str(int(cpu_per_rank * CFS_PERIOD_US)))
        paths.append(path)
    return paths


def run_on_emulated_nodes(bench: str, forwarded: list[str], nodes: int, ranks_per_node: int, inter_mbit: float,
                          intra_mbit: float, timeout: float, cpu_per_rank: float | None = None) -> list[dict]:
    """Start ``nodes * ranks_per_node`` ranks of ``bench`` and return their JSON results, rank order."""
    world = nodes * ranks_per_node
    out_dir = tempfile.mkdtemp(prefix=f"mb_{bench}_")
    cgroups = _cpu_cgroups(world, cpu_per_rank) if cpu_per_rank else []
    try:
        with EmulatedNodes(nodes, inter_mbit, intra_mbit, nics=ranks_per_node) as emulated:
            port = 29500 + os.getpid() % 1000
            procs = []
            for r in range(world):
                node, local = divmod(r, ranks_per_node)
                env = dict(os.environ, MASTER_ADDR=emulated.address(0, 0), MASTER_PORT=str(port),
                           GLOO_SOCKET_IFNAME=emulated.iface(local), OMP_NUM_THREADS="1")
                cmd = emulated.exec_prefix(node) + [
                    sys.executable, "-m", "megatron_burst.bench", bench, "--worker", "--rank", str(r),
                    "--world-size", str(world), "--out", out_dir] + forwarded
                procs.append(subprocess.Popen(cmd, env=env))
                if cgroups:  # from here (ip netns exec remounts /sys): the pid stays python's after exec,
                    # and every thread the rank starts inherits the cap
                    with open(os.path.join(cgroups[r], "cgroup.procs"), "w") as f:
                        f.write(str(procs[-1].pid))
            deadline = time.time() + timeout
            while any(pr.poll() is None for pr in procs):
                if time.time() > deadline or any(pr.poll() not in (None, 0) for pr in procs):
                    for pr in procs:
                        pr.kill()
                    raise SystemExit(f"benchmark ranks failed or timed out: exit codes {[pr.poll() for pr in procs]}")
                time.sleep(0.5)
    except NetnsError as e:
        raise SystemExit(f"cannot emulate nodes here: {e}")
    finally:
        for path in cgroups:  # empty once its rank has exited
            try:
                os.rmdir(path)
            except OSError:
                pass
    results = []
    for r in range(world):
        with open(os.path.join(out_dir, f"rank{r}.json")) as f:
            results.append(json.load(f))
    return results


def run_rank(args, measure, threads: int) -> None:
    """The rank side of :func:`run_on_emulated_nodes`: ``args`` carries ``--rank``, ``--world-size``
    and ``--out``; join the gloo group, ``measure(args)`` (a JSON-able result), write it to
    ``OUT/rank<R>.json`` and end through megatron_burst.world.exit_rank."""
    import torch
    import torch.distributed as dist

    from megatron_burst.world import exit_rank

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world_size)
    result = measure(args)
    with open(os.path.join(args.out, f"rank{args.rank}.json"), "w") as f:
        json.dump(result, f)
    exit_rank(0)
