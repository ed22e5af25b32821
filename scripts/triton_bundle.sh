#!/usr/bin/env bash
# A newer Triton for the linear-attention part of a GPU session, small enough to carry.
#
#   bash scripts/triton_bundle.sh [VERSION=3.7.1] [PYTHON_TAG=312]      (repository root, here)
#
# Why: flash-linear-attention 0.6 refuses its gated backward kernels (per-token / per-head decay:
# Gated DeltaNet, GLA-style LASP-2) on Hopper with 3.4 <= Triton < 3.7.1, which compute them wrong
# (fla issue #640), and the GPU image has Triton 3.6. Then neither fla nor our fla path runs those
# forms there, and I3's comparison with fla's kernels cannot be made. A Triton wheel is ~190 MB,
# past the 64 MiB a device call carries; this keeps what compiling and running NVIDIA kernels needs
# (the python package, libtriton.so without its debug sections, ptxas, libdevice, CUDA headers) and
# drops the rest (AMD backend, profiler and its CUPTI libraries, Blackwell's ptxas, test plugins):
# .triton/triton-VERSION-cpTAG.tar.xz, ~40 MB, git-ignored. On the GPU machine (carry ".triton"),
# scripts/gpu_session.sh unpacks it to /tmp and runs only the linear parts with it first on
# PYTHONPATH (everything else keeps the image's Triton); `python3 -c "import triton"` with that
# PYTHONPATH names the version.
set -eu
VERSION=${1:-3.7.1}
TAG=${2:-312}
grep -qxF "/.triton/" .git/info/exclude 2>/dev/null || echo "/.triton/" >> .git/info/exclude
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$TAG" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$work/wheel" "triton==$VERSION"
mkdir -p "$work/site"
(cd "$work/site" && python3 -m zipfile -e "$work"/wheel/triton-*.whl .)
t="$work/site/triton"
rm -rf "$t/backends/amd" "$t/backends/nvidia/lib/cupti" "$t/backends/nvidia/bin/ptxas-blackwell" \
  "$t/_C/libproton.so" "$t/instrumentation" "$t/FileCheck" "$t"/plugins/*TestLib* "$t/profiler"
# backends are found through the entry points: drop the AMD one there too (and the profiler's scripts)
python3 - "$work"/site/triton-*.dist-info/entry_points.txt <<'PY'
import sys
path = sys.argv[1]
keep = [line for line in open(path) if not line.startswith(("amd =", "proton"))]
open(path, "w").writelines(keep)
PY
chmod +x "$t"/backends/nvidia/bin/* 2>/dev/null || true  # zipfile drops the mode bits
strip --strip-unneeded "$t/_C/libtriton.so"
mkdir -p .triton
out=".triton/triton-$VERSION-cp$TAG.tar.xz"
tar -C "$work/site" -cf - . | xz -9 -T0 > "$out"
du -h "$out"
