"""Run a module or script with every thread's Python stack printed to stderr every N seconds, so a
GPU-session part that prints nothing before its time limit (Triton autotuning, a compile, a hang)
still says where it was:

    python scripts/traced.py SECONDS -m MODULE [ARGS...]
    python scripts/traced.py SECONDS SCRIPT.py [ARGS...]

SECONDS 0 runs it without stack dumps.
"""
from __future__ import annotations

import faulthandler
import runpy
import sys


def main() -> None:
    if len(sys.argv) < 3 or (sys.argv[2] == "-m" and len(sys.argv) < 4):
        sys.exit(__doc__)
    every = float(sys.argv[1])
    if every > 0:
        faulthandler.dump_traceback_later(every, repeat=True, file=sys.stderr)
    if sys.argv[2] == "-m":
        sys.argv = [sys.argv[3]] + sys.argv[4:]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = sys.argv[2:]
        runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
