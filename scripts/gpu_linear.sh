#!/usr/bin/env bash
# One device call for the linear family on GPU (I3): install fla from the carried wheels, the GPU
# tests of linear attention / GDN through fla, then the one-GPU bench against fla's own kernels.
#
#   bash scripts/gpu_linear.sh [OUT_DIR]        (from the repository root, on the GPU machine)
#
# fla wheels: the device has no package registry. .whl/ (git-ignored) holds
#   flash_linear_attention-0.6.0-py3-none-any.whl, fla_core-0.6.0-py3-none-any.whl, einops-0.8.2-py3-none-any.whl;
# carry it with the working tree (device run: carry [".whl", ".triton"]; copy it from /work/main/.whl into the
# checkout first if it is not there), and this script runs
#   pip install --no-deps .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl .whl/einops-*.whl
# Budget: under ~4 minutes on one H100/H200 -- install ~10 s, tests <= 90 s (first fla calls autotune),
# bench <= 140 s (W = 1 at 32K x 16 x 128 bf16, then W = 2, 4 on one GPU; W = 8 via LINEAR_BENCH_ARGS).
# Everything is written as it goes (a time-out keeps what finished): OUT_DIR/env.txt, gpu_linear_test.log,
# bench_linear.jsonl, bench_linear.log. Overrides: LINEAR_TEST_TIMEOUT, LINEAR_BENCH_TIMEOUT, LINEAR_BENCH_ARGS.
set -u
OUT_DIR=${1:-${OUT:-/tmp/gpu_linear}}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
if ! $PY -c "import fla" 2>/dev/null; then
  ls .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl .whl/einops-*.whl >/dev/null || {
    echo "no fla wheels in .whl/: carry .whl (see the header)"; exit 2; }
  $PY -m pip install --quiet --no-deps .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl .whl/einops-*.whl 2>&1 | tail -3
fi
# a carried Triton >= 3.7.1 first on PYTHONPATH (fla's gated backward kernels on Hopper: scripts/triton_bundle.sh)
. scripts/carried_triton.sh
FLA_TRITON=$(carried_triton_path "$PY")
[ -n "$FLA_TRITON" ] && export PYTHONPATH="$FLA_TRITON:$PYTHONPATH"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import torch, triton, fla; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'fla', getattr(fla, '__version__', '?'), torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT_DIR/env.txt"
timeout ${LINEAR_TEST_TIMEOUT:-90} $PY -m pytest -q -p no:cacheprovider --durations=10 tests/gpu/test_gpu_linear.py \
  2>&1 | tee "$OUT_DIR/gpu_linear_test.log"
echo "gpu linear test exit: ${PIPESTATUS[0]}" | tee -a "$OUT_DIR/gpu_linear_test.log"
timeout ${LINEAR_BENCH_TIMEOUT:-140} $PY -m megatron_burst.bench linear --gpu --out "$OUT_DIR/bench_linear.jsonl" \
  ${LINEAR_BENCH_ARGS:---seq 32768 --heads 16 --head-dim 128 --worlds 2 4 --repeats 5 --warmup 2 --max-seconds 2} \
  2>&1 | tee "$OUT_DIR/bench_linear.log"
echo "bench linear exit: ${PIPESTATUS[0]}" | tee -a "$OUT_DIR/bench_linear.log"
