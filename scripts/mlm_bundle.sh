#!/usr/bin/env bash
# Megatron-LM's training side for a machine without it (the GPU machine: no network, megatron-core
# only as a wheel): core_v0.16.1's pretrain_gpt.py and megatron/{training,legacy,post_training,rl}
# with patches/pretrain_gpt.patch applied, as .mlm/ (about 2 MB, git-ignored), plus the wheels its
# imports need there (pydantic and its needs) in .whl/.
#
#   bash scripts/mlm_bundle.sh [MEGATRON_LM_GIT_DIR_OR_CHECKOUT] [REF]      (repository root, here)
#
# Defaults: the fetched mirror /work/.mirror/NVIDIA+Megatron-LM/repo and core_v0.16.1. megatron.core
# itself comes from the megatron-core wheel (.whl/megatron_core-*), merged with .mlm/megatron as
# one namespace package. Then on the GPU machine (carry [".whl", ".mlm"]):
#   bash scripts/e2e_gpu.sh $OUT -- --variants mlm_burst mlm_sdpa_free
# which runs `.mlm/pretrain_gpt.py` (examples/e2e_gpt_1b.py's mlm_* variants).
set -eu
SRC=${1:-/work/.mirror/NVIDIA+Megatron-LM/repo}
REF=${2:-core_v0.16.1}
if [ -d "$SRC/.git" ]; then GIT_DIR="$SRC/.git"; else GIT_DIR="$SRC"; fi
git --git-dir "$GIT_DIR" rev-parse --verify -q "$REF^{commit}" >/dev/null \
  || { echo "no $REF in $GIT_DIR: fetch NVIDIA/Megatron-LM with its tags first" >&2; exit 1; }
for ignored in /.whl/ /.mlm/; do
  grep -qxF "$ignored" .git/info/exclude 2>/dev/null || echo "$ignored" >> .git/info/exclude
done
rm -rf .mlm && mkdir -p .mlm
git --git-dir "$GIT_DIR" archive "$REF" pretrain_gpt.py gpt_builders.py model_provider.py \
  megatron/training megatron/legacy megatron/post_training megatron/rl | tar -x -C .mlm
patch -s -p1 -d .mlm < patches/pretrain_gpt.patch
echo "$REF $(git --git-dir "$GIT_DIR" rev-parse "$REF^{commit}") + patches/pretrain_gpt.patch" > .mlm/SOURCE
# imports of `import pretrain_gpt` that the GPU image lacks (its package list: the device library's
# KINDS.md): pydantic (megatron.rl) and its needs, at the versions this project's environment has
WHEELS="pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0"
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl $WHEELS
du -sh .mlm .whl
