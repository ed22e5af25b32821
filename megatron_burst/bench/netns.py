"""Emulated nodes on one Linux host: one network namespace per node, rail-optimized NICs between them.

Like a GPU cluster where every GPU has its own NIC and NIC l of every node sits on "rail" l, each
namespace ("node") gets ``nics`` veth interfaces mbeth0..; interface l of every node is attached to
rail l's bridge and addressed 10.<base>.<l>.<node+1>/24. A rank bound to NIC l (GLOO_SOCKET_IFNAME)
reaches the rank with local index l on another node through its own rate-limited NIC, and any rank
of its own node through the namespace's loopback. ``tc tbf`` limits each NIC (inter-node) and the
loopback (intra-node). Everything is removed on exit, on error and on SIGINT/SIGTERM. Needs root and
iproute2.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
from typing import Optional



class NetnsError(RuntimeError):
    pass


def require_root_and_iproute2() -> None:
    """Raise NetnsError with what to do when this machine cannot emulate nodes."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetnsError(f"{' and '.join(missing)} not found: install iproute2 (apt-get install iproute2)")
    if os.geteuid() != 0:
        raise NetnsError("network namespaces need root: run this benchmark as root (or with sudo)")


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if check and res.returncode != 0:
        raise NetnsError(f"`{' '.join(cmd)}` failed: {res.stderr.strip()}")
    return res


class EmulatedNodes:
    """Context manager creating ``nodes`` namespaces with rate-limited inter/intra-node links."""

    def __init__(self, nodes: int, inter_mbit: float, intra_mbit: Optional[float], subnet_id: int = 0,
                 nics: int = 1) -> None:
        self.nodes = nodes
        self.nics = nics
        self.inter_mbit = inter_mbit
        self.intra_mbit = intra_mbit
        tag = f"{os.getpid() % 100000}"
        self.namespaces = [f"mb{tag}n{n}" for n in range(nodes)]
        self.bridges = [f"mbbr{tag}r{l}"[:15] for l in range(nics)]
        self.subnet_id = subnet_id
        self._old_handlers: dict[int, object] = {}

    def iface(self, nic: int = 0) -> str:
        return f"mbeth{nic}"

    def address(self, node: int, nic: int = 0) -> str:
        return f"10.{231 + self.subnet_id}.{nic}.{node + 1}"

    def exec_prefix(self, node: int) -> list[str]:
        """Command prefix that runs a program inside ``node``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[node]]

    def __enter__(self) -> "EmulatedNodes":
        require_root_and_iproute2()
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            self._create()
        except BaseException:
            self.cleanup()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum, frame) -> None:
        self.cleanup()
        raise KeyboardInterrupt(f"signal {signum}: emulated nodes removed")

    def _create(self) -> None:
        for bridge in self.bridges:
            _run("ip", "link", "add", bridge, "type", "bridge")
            _run("ip", "link", "set", bridge, "up")
        # big bursts: veth/loopback hand tbf GSO super-packets of up to 64 KiB, which a smaller
        # bucket would drop outright
        for n, ns in enumerate(self.namespaces):
            _run("ip", "netns", "add", ns)
            _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            for l, bridge in enumerate(self.bridges):
                host_end = f"mbv{os.getpid() % 10000}x{n}r{l}"[:15]
                iface = self.iface(l)
                _run("ip", "link", "add", host_end, "type", "veth", "peer", "name", iface, "netns", ns)
                _run("ip", "link", "set", host_end, "master", bridge)
                _run("ip", "link", "set", host_end, "up")
                _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.address(n, l)}/24", "dev", iface)
                _run("ip", "netns", "exec", ns, "ip", "link", "set", iface, "up")
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", iface, "root", "tbf",
                     "rate", f"{self.inter_mbit}mbit", "burst", "256kb", "limit", "64mb")
            if self.intra_mbit:
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
                     "rate", f"{self.intra_mbit}mbit", "burst", "512kb", "limit", "64mb")

    def cleanup(self) -> None:
        """Remove the namespaces (their veth ends go with them) and the bridge; never raises."""
        for ns in self.namespaces:
            pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _run("ip", "netns", "del", ns, check=False)
        for bridge in self.bridges:
            _run("ip", "link", "del", bridge, check=False)

    def exists(self) -> bool:
        listed = _run("ip", "netns", "list", check=False).stdout
        return any(ns in listed for ns in self.namespaces)
