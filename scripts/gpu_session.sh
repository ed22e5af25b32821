#!/usr/bin/env bash
# Everything a GPU session should run, in priority order, within one device call (default 540 s of
# the call's 600), writing results as it goes so a time-out keeps what finished:
#
#   bash scripts/gpu_session.sh [OUT_DIR] [BUDGET_S]        (repository root, on the GPU machine)
#
# 1. I1  scripts/gpu_check.sh: the GPU suite (tests/gpu except the linear file) and the attention
#        bench (dense 32K headline, documents/windows, sparse, rank blocks)        ~ 45 % of the budget
# 2. I3  scripts/gpu_linear.sh: fla from the carried wheels, LASP-2 / GDN through fla, the linear
#        bench at W = 1, 2                                                          ~ 30 %
# 3. I2  the fused-loss bench (--quick) and its GPU test                          the rest
# Carry `.whl` (git-ignored): fla_core, flash_linear_attention, einops (I3); liger_kernel,
# cut_cross_entropy (the loss bench's peers) and megatron_core (its Megatron variants), e.g.
#   pip download --no-deps -d .whl flash-linear-attention fla-core einops liger-kernel cut-cross-entropy
#   pip download --no-deps -d .whl --python-version 3.12 --only-binary=:all: megatron-core==0.16.1 Every part's own script header lists its outputs; this one
# adds OUT_DIR/session.log (each part's start, exit status and seconds). Rerun a single part with
# its own script and a larger share if it ran out of time.
set -u
OUT_DIR=${1:-${OUT:-/tmp/gpu_session}}
BUDGET=${2:-540}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
START=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
part() {  # part NAME SECONDS COMMAND...: run with at most SECONDS (and never past the budget)
  local name=$1 want=$2; shift 2
  local have; have=$(left)
  local limit=$(( want < have ? want : have ))
  if (( limit < 20 )); then echo "$name: skipped (its limit would be ${limit}s; ${have}s of the budget left)" | tee -a "$OUT_DIR/session.log"; return; fi
  local t0; t0=$(date +%s)
  echo "$name: start (limit ${limit}s)" | tee -a "$OUT_DIR/session.log"
  timeout "$limit" "$@"
  echo "$name: exit $? after $(( $(date +%s) - t0 ))s" | tee -a "$OUT_DIR/session.log"
}
share() { echo $(( BUDGET * $1 / 100 )); }

part attention $(share 45) env GPU_TEST_TIMEOUT=$(( $(share 45) * 55 / 100 )) GPU_BENCH_TIMEOUT=$(( $(share 45) * 40 / 100 )) \
  GPU_TEST_ARGS="--ignore=tests/gpu/test_gpu_linear.py --ignore=tests/gpu/test_gpu_fused_loss.py" bash scripts/gpu_check.sh "$OUT_DIR/attention"
part linear $(share 30) env LINEAR_TEST_TIMEOUT=$(( $(share 30) * 40 / 100 )) LINEAR_BENCH_TIMEOUT=$(( $(share 30) * 50 / 100 )) \
  LINEAR_BENCH_ARGS="--seq 32768 --heads 16 --head-dim 128 --worlds 2 --repeats 5 --warmup 2 --max-seconds 2" \
  bash scripts/gpu_linear.sh "$OUT_DIR/linear"
mkdir -p "$OUT_DIR/loss"
for pkg in liger_kernel:liger_kernel cut_cross_entropy:cut_cross_entropy megatron.core:megatron_core; do
  if ! $PY -c "import ${pkg%%:*}" 2>/dev/null && ls .whl/${pkg##*:}-*.whl >/dev/null 2>&1; then
    $PY -m pip install --quiet --no-deps .whl/${pkg##*:}-*.whl 2>&1 | tail -2
  fi
done
part loss-test 60 bash -o pipefail -c "$PY -m pytest -q -p no:cacheprovider --timeout=50 tests/gpu/test_gpu_fused_loss.py 2>&1 | tee '$OUT_DIR/loss/gpu_loss_test.log'"
part loss-bench 120 bash -o pipefail -c "$PY -m megatron_burst.bench loss --quick 2>&1 | tee '$OUT_DIR/loss/bench_loss.log'"
echo "session: $(( $(date +%s) - START ))s of ${BUDGET}s" | tee -a "$OUT_DIR/session.log"
