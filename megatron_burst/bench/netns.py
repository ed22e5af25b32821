"""Emulated nodes on one Linux host: one network namespace per node, a bridge between them.

Each namespace ("node") gets one veth interface with an address on a private /24; processes of the
same node talk over that address through the namespace's loopback, processes of different nodes over
the veth and the bridge. ``tc tbf`` limits the veth (inter-node) and the loopback (intra-node) rates.
Everything is removed on exit, on error and on SIGINT/SIGTERM. Needs root and iproute2.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
from typing import Optional

SUBNET = "10.231.{}.{}"


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

    def __init__(self, nodes: int, inter_mbit: float, intra_mbit: Optional[float], subnet_id: int = 0) -> None:
        self.nodes = nodes
        self.inter_mbit = inter_mbit
        self.intra_mbit = intra_mbit
        tag = f"{os.getpid() % 100000}"
        self.namespaces = [f"mb{tag}n{n}" for n in range(nodes)]
        self.bridge = f"mbbr{tag}"[:15]
        self.iface = "mbeth0"
        self.subnet_id = subnet_id
        self._old_handlers: dict[int, object] = {}

    def address(self, node: int) -> str:
        return SUBNET.format(self.subnet_id, node + 1)

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
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "link", "set", self.bridge, "up")
        # big bursts: veth/loopback hand tbf GSO super-packets of up to 64 KiB, which a smaller
        # bucket would drop outright
        for n, ns in enumerate(self.namespaces):
            host_end = f"mbv{os.getpid() % 100000}x{n}"[:15]
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", host_end, "type", "veth", "peer", "name", self.iface, "netns", ns)
            _run("ip", "link", "set", host_end, "master", self.bridge)
            _run("ip", "link", "set", host_end, "up")
            _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.address(n)}/24", "dev", self.iface)
            _run("ip", "netns", "exec", ns, "ip", "link", "set", self.iface, "up")
            _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", self.iface, "root", "tbf",
                 "rate", f"{self.inter_mbit}mbit", "burst", "256kb", "limit", "64mb")
            if self.intra_mbit:
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
                     "rate", f"{self.intra_mbit}mbit", "burst", "512kb", "limit", "64mb")

    def cleanup(self) -> None:
        """Remove the namespaces (their veth ends go with them) and the bridge; never raises."""
        for ns in self.namespaces:
            _run("ip", "netns", "pids", ns, check=False)
            pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _run("ip", "netns", "del", ns, check=False)
        _run("ip", "link", "del", self.bridge, check=False)

    def exists(self) -> bool:
        listed = _run("ip", "netns", "list", check=False).stdout
        return any(ns in listed for ns in self.namespaces)
