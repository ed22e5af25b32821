"""bench documents --quick: the measured zigzag-vs-balanced step runs end to end on local gloo ranks,
every variant is exact against the per-document reference, and balanced sends no more bytes than
zigzag. Timings are printed but never checked (they do not gate CI)."""
import json
import subprocess
import sys


def test_documents_quick_is_exact_and_balanced_sends_less(tmp_path):
    summary_path = tmp_path / "summary.json"
    res = subprocess.run([sys.executable, "-m", "megatron_burst.bench", "documents", "--quick",
                          "--json", str(summary_path)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in res.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    header, body = rows[0], rows[1:]
    assert [c.strip() for c in header][:2] == ["algo", "layout"]
    seen = {(r[0].strip(), r[1].strip()) for r in body}
    assert {("ring", "zigzag"), ("ring", "balanced"), ("burst", "zigzag"), ("burst", "balanced")} <= seen, res.stdout
    assert all(r[-1].strip() == "yes" for r in body), res.stdout  # the "exact" column

    summary = json.loads(summary_path.read_text())["summary"]
    for key, s in summary.items():
        assert s["exact"] and s["max_err"] < 1e-4, (key, s["errors"])
    for algo in ("ring", "burst"):
        zigzag, balanced = summary[f"{algo}|zigzag"], summary[f"{algo}|balanced"]
        assert 0 < balanced["sent_max"] <= zigzag["sent_max"], (algo, balanced["sent_max"], zigzag["sent_max"])
        # placed for the nodes (2 x 2), every split document stays inside a node; planned as for one
        # node, the cosets {r, r + 2} span both
        assert summary[f"{algo}|balanced"]["inter_max"] == 0
        assert summary[f"{algo}|balanced/one-node-plan"]["inter_max"] > 0
