"""Run one benchmark's ranks on emulated nodes (megatron_burst.bench.netns) and collect their results.

The benchmark module is re-run inside each node's namespace as ``python -m megatron_burst.bench
<name> --worker --rank R --world-size W --out DIR <forwarded flags>``; each rank writes
``DIR/rank<R>.json`` and ends through megatron_burst.world.exit_rank. Each rank drives its own NIC
(rail), as GPUs do on the clusters the papers measure.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from megatron_burst.bench.netns import EmulatedNodes, NetnsError


def run_on_emulated_nodes(bench: str, forwarded: list[str], nodes: int, ranks_per_node: int, inter_mbit: float,
                          intra_mbit: float, timeout: float) -> list[dict]:
    """Start ``nodes * ranks_per_node`` ranks of ``bench`` and return their JSON results, rank order."""
    world = nodes * ranks_per_node
    out_dir = tempfile.mkdtemp(prefix=f"mb_{bench}_")
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
            deadline = time.time() + timeout
            while any(pr.poll() is None for pr in procs):
                if time.time() > deadline or any(pr.poll() not in (None, 0) for pr in procs):
                    for pr in procs:
                        pr.kill()
                    raise SystemExit(f"benchmark ranks failed or timed out: exit codes {[pr.poll() for pr in procs]}")
                time.sleep(0.5)
    except NetnsError as e:
        raise SystemExit(f"cannot emulate nodes here: {e}")
    results = []
    for r in range(world):
        with open(os.path.join(out_dir, f"rank{r}.json")) as f:
            results.append(json.load(f))
    return results
