"""Emulated nodes: created with rate-limited links, always removed (also when the block raises)."""
import os
import shutil
import subprocess
import sys

import pytest

from megatron_burst.bench.netns import EmulatedNodes, NetnsError, require_root_and_iproute2

SERVER = ("import socket; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
          "s.bind(('0.0.0.0', 5999)); s.listen(); c, _ = s.accept(); c.sendall(b'pong')")
CLIENT = ("import socket, time\nfor _ in range(50):\n  try:\n    c = socket.create_connection(('%s', 5999), 1); break\n"
          "  except OSError: time.sleep(0.1)\nprint(c.recv(4).decode())")

needs_netns = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
                                 reason="network namespaces need root and iproute2")


@needs_netns
def test_nodes_are_linked_rate_limited_and_removed_on_error():
    nodes = EmulatedNodes(2, inter_mbit=50, intra_mbit=500, subnet_id=7, nics=2)
    with pytest.raises(RuntimeError, match="boom"):
        with nodes:
            assert nodes.exists()
            # node 0 reaches node 1 over rail 1 (TCP round trip)
            server = subprocess.Popen(nodes.exec_prefix(1) + [sys.executable, "-c", SERVER])
            try:
                client = subprocess.run(nodes.exec_prefix(0) + [sys.executable, "-c", CLIENT % nodes.address(1, 1)],
                                        capture_output=True, text=True, timeout=30)
                assert client.stdout.strip() == "pong", client.stderr
            finally:
                server.kill()
            qdisc = subprocess.run(nodes.exec_prefix(1) + ["tc", "qdisc", "show", "dev", nodes.iface(1)],
                                   capture_output=True, text=True).stdout
            assert "tbf" in qdisc and "50Mbit" in qdisc
            lo = subprocess.run(nodes.exec_prefix(1) + ["tc", "qdisc", "show", "dev", "lo"],
                                capture_output=True, text=True).stdout
            assert "500Mbit" in lo
            raise RuntimeError("boom")
    assert not nodes.exists()
    links = subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    assert not any(b in links for b in nodes.bridges)


def test_missing_privileges_are_explained(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(NetnsError, match="need root"):
        require_root_and_iproute2()
    monkeypatch.setattr(shutil, "which", lambda tool: None)
    with pytest.raises(NetnsError, match="install iproute2"):
        require_root_and_iproute2()


@needs_netns
def test_bench_sparse_runs_on_emulated_nodes(tmp_path):
    """bench sparse --nodes: the ranks run in two namespaces over the rate-limited link and the
    table has every schedule, with the bytes of a dense pass (K,V blocks still travel whole)."""
    res = subprocess.run([sys.executable, "-m", "megatron_burst.bench", "sparse", "--nodes", "2", "--ranks-per-node", "1",
                          "--seq", "512", "--band", "32", "--verticals", "2", "--slashes", "4", "--repeats", "1",
                          "--warmup", "0", "--plot", str(tmp_path / "s.png")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "2 emulated nodes x 1" in res.stdout
    rows = {line.split("|")[1].strip(): line for line in res.stdout.splitlines() if line.startswith("| ")}
    for name in ("dense", "zigzag", "token-striped", "block-striped", "hierarchical"):
        assert name in rows, res.stdout
    sent = {name: float(rows[name].split("|")[6]) for name in ("dense", "block-striped")}
    assert sent["dense"] == sent["block-striped"] > 0
