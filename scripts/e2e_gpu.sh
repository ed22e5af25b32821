#!/usr/bin/env bash
# End to end on one GPU (issue I2 part 4): a 1.17B-parameter GPT (24 layers, hidden 2048, 16 heads /
# 8 KV groups, SwiGLU, RMSNorm) at 16K tokens, bf16, trained by Megatron-LM's pretrain_gpt.py
# (core_v0.16.1 + our patch, from .mlm/: `bash scripts/mlm_bundle.sh` here first) with our attention
# and fused loss (mlm_burst) and with Megatron's own attention (mlm_megatron_local, last); between
# them by `python -m megatron_burst.train` (megatron.core Float16Module + DDP + fp32 main params); then
# with full recompute, with full recompute + --seq-selective-ckpt-ratio 0.5, with torch SDPA as core
# attention, and with megatron.core's own (local, TE-free) DotProductAttention. Per variant: tokens/s,
# MFU, peak memory (formulas: examples/e2e_gpt_1b.py's docstring).
#
#   bash scripts/e2e_gpu.sh [OUT_DIR] [-- extra args for examples/e2e_gpt_1b.py, e.g. --variants burst sdpa]
#   bash scripts/e2e_gpu.sh /tmp/smoke -- --smoke        # tiny model, any machine (CPU too): ~30 s
#
# Writes as it goes (finished variants survive a time-out): OUT_DIR/env.txt, OUT_DIR/e2e_results.json,
# OUT_DIR/e2e.log. Budget: about 5 minutes on one H100/H200 (5 variants x 30-70 s: ~25 s of start-up each,
# mostly the CPU initialization of 1.17B weights; each capped by --per-run-timeout 120 s, the whole script
# by E2E_TIMEOUT, default 360 s).
#
# megatron-core is not installed on the GPU machine (torch 2.11 + CUDA 13, Python 3.12, no network):
# it travels as a wheel in .whl/ (git-ignored through .git/info/exclude). Fetch it here, once:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl megatron-core==0.16.1
#   -> .whl/megatron_core-0.16.1-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl (2.6 MB);
#      its requirements (torch, numpy, packaging) are already on the GPU machine.
# Megatron-LM's training side also imports pydantic (absent there): scripts/mlm_bundle.sh puts its wheels in .whl.
# Device call: run(command="bash scripts/e2e_gpu.sh $OUT", carry=[".whl", ".mlm"], timeout_s=450)
set -u
OUT_DIR=${1:-${OUT:-/tmp/e2e_gpu}}
shift || true
[ "${1:-}" = "--" ] && shift
mkdir -p "$OUT_DIR"
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}  # make env's venv here
export PYTHONUNBUFFERED=1
# fragmentation matters for the 16K-token runs (Megatron-LM recommends it too)
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
if ! $PY -c "import megatron.core, pydantic" 2>/dev/null; then
  ls .whl/megatron_core-*.whl >/dev/null 2>&1 || { echo "megatron-core is not installed and .whl/ has no wheel: see this script's header" >&2; exit 1; }
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import torch, megatron.core; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'megatron-core', megatron.core.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"
  $PY -c "import triton; print('triton', triton.__version__)" 2>/dev/null
} 2>&1 | tee "$OUT_DIR/env.txt"
timeout ${E2E_TIMEOUT:-360} $PY examples/e2e_gpt_1b.py --out "$OUT_DIR" "$@"
status=$?
echo "e2e exit: $status" | tee -a "$OUT_DIR/env.txt"
exit $status
