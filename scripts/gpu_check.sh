#!/usr/bin/env bash
# One device call's worth of GPU checks (I1): environment, the GPU test suite, the GPU bench.
# Run from the repository root on a GPU machine:  bash scripts/gpu_check.sh [OUT_DIR]
# Writes as it goes (results survive a time-out): OUT_DIR/env.txt, gpu_test.log, bench_gpu.jsonl,
# bench_gpu.log, bench_gpu.png. Budget: <= 8 minutes on one H100/H200 (test suite <= 5 min, bench 3 min);
# GPU_BENCH_ARGS / GPU_TEST_ARGS (extra pytest arguments) / GPU_TEST_TIMEOUT / GPU_BENCH_TIMEOUT override the defaults (e.g. a second call for
# --sections multi_rank, or --seqs 131072).
set -u
OUT_DIR=${1:-${OUT:-/tmp/gpu_check}}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'triton', triton.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT_DIR/env.txt"
timeout ${GPU_TEST_TIMEOUT:-300} $PY -m pytest -q -p no:cacheprovider --timeout=150 --durations=15 ${GPU_TEST_ARGS:-} tests/gpu 2>&1 | tee "$OUT_DIR/gpu_test.log"
echo "gpu-test exit: ${PIPESTATUS[0]}" | tee -a "$OUT_DIR/gpu_test.log"
# the I1 figures first (dense 32K is the headline), then documents/windows, sparse 64K, rank blocks
timeout ${GPU_BENCH_TIMEOUT:-180} $PY -m megatron_burst.bench gpu --out "$OUT_DIR/bench_gpu.jsonl" \
  --plot "$OUT_DIR/bench_gpu.png" ${GPU_BENCH_ARGS:---sections dense documents sparse rank_block --seqs 8192 32768 --repeats 5 --max-seconds 170} \
  2>&1 | tee "$OUT_DIR/bench_gpu.log"
echo "bench exit: ${PIPESTATUS[0]}" | tee -a "$OUT_DIR/bench_gpu.log"
