#!/usr/bin/env bash
# Everything a GPU session should run, in priority order, within one device call (default 540 s of
# the call's 600), writing results as it goes so a time-out keeps what finished:
#
#   bash scripts/gpu_session.sh [OUT_DIR] [BUDGET_S]        (repository root, on the GPU machine)
#
# 1. benches: attention (sparse 64K, documents/windows, rank blocks, dense 32K: what is not yet
#    re-measured first), fused loss (--quick,
#    Liger / CCE), linear (fla) -- on a quiet GPU, in that order
# 2. end to end (I2): the 1.17B GPT at 16K through Megatron-LM's pretrain_gpt.py with our attention and
#    fused loss (examples/e2e_gpt_1b.py mlm_burst; needs .mlm from scripts/mlm_bundle.sh, carried)
# 3. the whole GPU suite (tests/gpu: attention, sparse, fused loss, linear), xdist workers when installed
# Shares of the budget: ATTN_BENCH_SHARE 23, LOSS_BENCH_SHARE 15, LINEAR_BENCH_SHARE 14, E2E_SHARE 15, SUITE_SHARE 33,
# PROBE_S 40 (seconds for scripts/gpu_probe_cudnn.py; 0 skips it), PROFILE_S 0 (seconds for scripts/gpu_profile.py: kernel tables of the loss and 64-document cases, profile.txt; PROFILE_ARGS="--sections fusions" times what --te-free-fusions replaces), TUNE_SHARE 0 (scripts/gpu_tune_masked.py: Triton masked kernel launch configs) (percent; 0 skips a part); GPU_BENCH_ARGS, LINEAR_BENCH_ARGS, GPU_TEST_ARGS, GPU_MULTI_ARGS, GPU_LINEAR_ARGS override each part's arguments.
# LINEAR_TESTS_EARLY=1 starts tests/gpu/test_gpu_linear.py (carried Triton) right after the loss bench, beside the parts
# after it (mostly fla's compiles: CPU work), and waits for it within the budget at the end; the attention bench, the
# profile and the loss bench time one variant after another, so they run first, on a quiet GPU; GPU_LINEAR_WORKERS (6) its xdist workers.
# Carry `.whl`, `.mlm` and `.triton` (git-ignored). .whl: fla_core, flash_linear_attention, einops (I3);
# liger_kernel, cut_cross_entropy (the loss bench's peers), megatron_core and pydantic (+ its needs:
# scripts/mlm_bundle.sh, which also writes .mlm, Megatron-LM's patched training side). .triton:
# scripts/triton_bundle.sh, a Triton >= 3.7.1 that only the linear parts run with (fla 0.6 refuses its
# gated backward kernels on Hopper with the image's Triton 3.6); test_gpu_linear.py then runs in its own
# process beside the suite (gpu_test_linear.log). E.g.
#   pip download --no-deps -d .whl flash-linear-attention fla-core einops liger-kernel cut-cross-entropy
#   pip download --no-deps -d .whl --python-version 3.12 --only-binary=:all: megatron-core==0.16.1
# More than 8 files come back: run it as `bash scripts/gpu_session.sh /tmp/s; tar czf $OUT/s.tgz -C /tmp/s .;
# cp /tmp/s/verdict.md $OUT/` (a device call returns at most 8 files). After the session,
# `mkdir -p .autotune && tar xzf <files>/s.tgz -O ./autotune.tgz | tar xz -C .autotune` and carry .autotune
# next time (Triton's autotuning results, below; CACHE_PACK_MB=N also packs the compiled kernels into
# triton_cache.tgz when they compress to <= N MB: unpack it into .autotune the same way).
# Outputs: OUT_DIR/session.log (versions; each part's start, exit status and seconds), gpu_test.log,
# gpu_test_multi.log, gpu_failures.log (each failure as it happens),
# bench_gpu.{jsonl,log}, bench_loss.{jsonl,log}, bench_linear.jsonl, e2e/e2e_results.json (the e2e log: e2e/e2e.log; the linear log goes to session.log;
# verdict.md: every figure against the open issues' done-when bars, python -m megatron_burst.bench verdict;
# bench gpu / linear can redraw their plots here from the JSON lines).
# scripts/gpu_check.sh and scripts/gpu_linear.sh run one family alone with a larger share.
set -u
OUT_DIR=${1:-${OUT:-/tmp/gpu_session}}
BUDGET=${2:-540}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)  # absolute: parts and pack_autotune write here from other folders
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
  pack_autotune
}
# Triton's autotuning results, kept across sessions: fla's kernels benchmark every launch config on
# first use (compiling each), which took a fresh machine's whole 80-90 s linear share twice (2026-11-27).
# A carried .autotune/ (in .gitignore: unpack the last session's OUT_DIR/autotune.tgz into it) seeds
# the cache; each part's end packs every *.autotune.json again (small: the chosen configs' timings,
# no binaries), so a later session compiles only the chosen configs.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton_cache}
mkdir -p "$TRITON_CACHE_DIR"
[ -d .autotune ] && cp -r .autotune/. "$TRITON_CACHE_DIR/" && echo "autotune: seeded from .autotune ($(find .autotune -name '*.autotune.json' | wc -l) results)" | tee -a "$OUT_DIR/session.log"
pack_autotune() {
  (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar czf "$OUT_DIR/autotune.tgz" -T - 2>/dev/null) || true
  # CACHE_PACK_MB > 0: the compiled kernels too (OUT_DIR/triton_cache.tgz, unpacked into .autotune/ like the
  # above), when they compress to at most that size: two autotune configs per fla kernel still compiled for
  # ~60 s per LASP-2 form on a fresh machine (2026-11-27). Off by default: .whl + .mlm + .triton already
  # fill ~60 of the 64 MiB a call carries (a linear-only session can leave .mlm behind).
  if (( ${CACHE_PACK_MB:-0} > 0 )); then
    (cd "$TRITON_CACHE_DIR" && tar czf "$OUT_DIR/triton_cache.tgz.part" . 2>/dev/null) || true
    local size; size=$(stat -c %s "$OUT_DIR/triton_cache.tgz.part" 2>/dev/null || echo 0)
    if (( size > 0 && size <= CACHE_PACK_MB * 1048576 )); then mv "$OUT_DIR/triton_cache.tgz.part" "$OUT_DIR/triton_cache.tgz"
    else rm -f "$OUT_DIR/triton_cache.tgz.part"; echo "triton cache: $size bytes packed, over CACHE_PACK_MB=$CACHE_PACK_MB: not kept" >> "$OUT_DIR/session.log"; fi
  fi
}
share() { echo $(( BUDGET * $1 / 100 )); }

# the figures first, on a quiet GPU (bench timings), then the correctness suites (pytest-xdist workers
# share the GPU when installed: first Triton compiles and rank spawns dominate, not GPU time)
# (GPU_TEST_WORKERS=0: one process)
XDIST=$( (( ${GPU_TEST_WORKERS:-8} > 0 )) && $PY -c "import xdist" 2>/dev/null && echo "-n ${GPU_TEST_WORKERS:-8} --dist loadgroup")
# the multi-rank tests: one xdist worker per world size (W = 2, 3, 4 pools side by side; conftest.py groups them)
MULTI_XDIST=$($PY -c "import xdist" 2>/dev/null && echo "-n 3 --dist loadgroup")
# the linear tests in their own workers: first-use compiles of fla's kernels (one process compiled for
# > 240 s on 2026-11-27) spread over the cores (GPU_LINEAR_WORKERS=0: one process)
LINEAR_XDIST=$( (( ${GPU_LINEAR_WORKERS:-6} > 0 )) && $PY -c "import xdist" 2>/dev/null && echo "-n ${GPU_LINEAR_WORKERS:-6} --dist loadgroup")
TIMEOUT=$($PY -c "import pytest_timeout" 2>/dev/null && echo "--timeout=240")  # the GPU image has pytest-timeout
for pkg in liger_kernel:liger_kernel cut_cross_entropy:cut_cross_entropy megatron.core:megatron_core fla:fla_core fla:flash_linear_attention einops:einops \
           annotated_types:annotated_types typing_inspection:typing_inspection pydantic_core:pydantic_core pydantic:pydantic; do
  # a carried wheel is installed where its package does not import (asked only where there is a wheel)
  if ls .whl/${pkg##*:}-*.whl >/dev/null 2>&1 && ! $PY -c "import ${pkg%%:*}" 2>/dev/null; then
    $PY -m pip install --quiet --no-deps .whl/${pkg##*:}-*.whl 2>&1 | tail -2
  fi
done
# pydantic 2.14 wants typing_extensions >= 4.16: the carried one where the image's is older
$PY -c "import pydantic" 2>/dev/null || { ls .whl/typing_extensions-*.whl >/dev/null 2>&1 && $PY -m pip install --quiet --no-deps .whl/typing_extensions-*.whl 2>&1 | tail -2; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'triton', triton.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee -a "$OUT_DIR/session.log"
# the linear parts with a carried newer Triton first on PYTHONPATH when there is one (.triton: fla's gated
# backward kernels need Triton >= 3.7.1 on Hopper; scripts/triton_bundle.sh): the bench here, its GPU tests
# (tests/gpu/test_gpu_linear.py) beside the suite below (or, LINEAR_TESTS_EARLY=1,
# from the loss bench's end, beside the later parts: its first-use compiles are CPU work), in their own process with that Triton
. scripts/carried_triton.sh
FLA_TRITON=$(carried_triton_path "$PY")
LINEAR_PP="${FLA_TRITON:+$FLA_TRITON:}$PYTHONPATH"
PYTHONPATH="$LINEAR_PP" $PY -c "import triton; print('linear parts: triton', triton.__version__, triton.__file__)" 2>&1 | tee -a "$OUT_DIR/session.log"
LINEAR_TESTS="PYTHONPATH='$LINEAR_PP' $PY -m pytest -q -p no:cacheprovider $TIMEOUT $LINEAR_XDIST ${GPU_LINEAR_ARGS:-} tests/gpu/test_gpu_linear.py"
part cudnn-probe ${PROBE_S:-40} bash -o pipefail -c "$PY scripts/gpu_probe_cudnn.py 2>&1 | tee -a '$OUT_DIR/session.log'"
part attention-bench $(share ${ATTN_BENCH_SHARE:-23}) bash -o pipefail -c "$PY -m megatron_burst.bench gpu --out '$OUT_DIR/bench_gpu.jsonl' \
  ${GPU_BENCH_ARGS:---sections sparse documents rank_block dense --seqs 32768 --doc-seqs 32768 --no-flex --repeats 5 --max-seconds 2} 2>&1 | tee '$OUT_DIR/bench_gpu.log'"
part profile ${PROFILE_S:-0} bash -o pipefail -c "$PY scripts/gpu_profile.py --out '$OUT_DIR/profile.txt' ${PROFILE_ARGS:-} 2>&1 | tail -3"
part loss-bench $(share ${LOSS_BENCH_SHARE:-15}) bash -o pipefail -c "$PY -m megatron_burst.bench loss --quick --plot '' \
  --out '$OUT_DIR/bench_loss.jsonl' ${LOSS_BENCH_ARGS:-} 2>&1 | tee '$OUT_DIR/bench_loss.log'"
# not before: their GPU work would fall on some timed variants and not on others
EARLY_LINEAR=0
if [ -n "$FLA_TRITON" ] && [ "${LINEAR_TESTS_EARLY:-0}" = 1 ]; then
  echo "linear-tests: start early, beside the parts below" | tee -a "$OUT_DIR/session.log"
  LINEAR_T0=$(date +%s)
  bash -c "$LINEAR_TESTS" > "$OUT_DIR/gpu_test_linear.log" 2>&1 &
  EARLY_LINEAR=$!
fi
part masked-tune $(share ${TUNE_SHARE:-0}) bash -o pipefail -c "$PY scripts/gpu_tune_masked.py --out '$OUT_DIR/tune_masked.jsonl' 2>&1 | tail -3"
LINEAR_S=$(share ${LINEAR_BENCH_SHARE:-14})
# traced.py: every thread's stack each TRACE_S seconds on stderr (fla's autotuning and compiles print nothing)
part linear-bench $LINEAR_S bash -o pipefail -c "PYTHONPATH='$LINEAR_PP' $PY scripts/traced.py ${TRACE_S:-30} -m megatron_burst.bench linear --gpu --out '$OUT_DIR/bench_linear.jsonl' \
  ${LINEAR_BENCH_ARGS:---seq 32768 --heads 16 --head-dim 128 --worlds 2 --repeats 5 --warmup 2 --max-seconds 2} 2>&1 | tee -a '$OUT_DIR/session.log'"
part e2e $(share ${E2E_SHARE:-15}) bash -o pipefail -c "$PY examples/e2e_gpt_1b.py --out '$OUT_DIR/e2e' --per-run-timeout $(( $(share ${E2E_SHARE:-15}) - 20 )) \
  ${E2E_ARGS:---variants mlm_burst --profile-iter 4} 2>&1 | tail -5 | tee -a '$OUT_DIR/session.log'"
# the multi-rank tests (W processes per test sharing the GPU; one worker per W) run beside the xdist run of
# the rest: rank pools and xdist workers are kept apart; with a carried Triton the linear tests run beside
# them too, in a process of their own on that Triton (exit status: the single-process suite's, else the
# multi-rank one's, else the linear one's). GPU_TEST_ARGS goes to the single-process run only;
# GPU_MULTI_ARGS replaces the multi-rank run's (empty: no such run); GPU_SINGLE=0 leaves out the
# single-process run (e.g. a session that only re-runs the linear tests)
part gpu-suite $(share ${SUITE_SHARE:-33}) bash -o pipefail -c "export GPU_TEST_FAILLOG='$OUT_DIR/gpu_failures.log'
  multi=0 linear=0
  [ -n '${GPU_MULTI_ARGS-tests/gpu/test_gpu_cp_multi.py}' ] && { $PY -m pytest -q -p no:cacheprovider $TIMEOUT $MULTI_XDIST --durations=20 \
    ${GPU_MULTI_ARGS-tests/gpu/test_gpu_cp_multi.py} > '$OUT_DIR/gpu_test_multi.log' 2>&1 & multi=\$!; }
  [ -n '$FLA_TRITON' ] && [ $EARLY_LINEAR = 0 ] && { $LINEAR_TESTS > '$OUT_DIR/gpu_test_linear.log' 2>&1 & linear=\$!; }
  single=0
  if [ '${GPU_SINGLE:-1}' = 1 ]; then
    $PY -m pytest -q -p no:cacheprovider $XDIST $TIMEOUT --durations=15 ${GPU_TEST_ARGS:-} tests/gpu --ignore=tests/gpu/test_gpu_cp_multi.py \
      ${FLA_TRITON:+--ignore=tests/gpu/test_gpu_linear.py} 2>&1 | tee '$OUT_DIR/gpu_test.log'
    single=\$?
  fi
  if (( multi )); then wait \$multi; multi=\$?; fi; if (( linear )); then wait \$linear; linear=\$?; fi
  exit \$(( single ? single : (multi ? multi : linear) ))"
if (( EARLY_LINEAR )); then  # the early linear tests: waited for within the budget, then stopped
  while kill -0 $EARLY_LINEAR 2>/dev/null && (( $(left) > 0 )); do sleep 2; done
  kill -0 $EARLY_LINEAR 2>/dev/null && { pkill -TERM -P $EARLY_LINEAR; kill $EARLY_LINEAR; } 2>/dev/null
  wait $EARLY_LINEAR; echo "linear-tests: exit $? after $(( $(date +%s) - LINEAR_T0 ))s" | tee -a "$OUT_DIR/session.log"
fi
echo "session: $(( $(date +%s) - START ))s of ${BUDGET}s" | tee -a "$OUT_DIR/session.log"
# the figures against the issues' bars (reads the files above; no GPU work, about a second)
$PY -m megatron_burst.bench verdict "$OUT_DIR" --out "$OUT_DIR/verdict.md" 2>&1 | tail -n +3 | head -60
