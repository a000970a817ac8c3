#!/bin/bash
# The verify-cost measurement on a lent GPU (MLX's CUDA backend), in the two
# back-to-back device calls a 15-minute lease allows after its start.
#
#   here:   bash bench/gpu.sh prepare
#   call 1: carry [".gpu/p1"]:  bash bench/gpu.sh copy
#   call 2: carry [".gpu/p2"]:  DEADLINE=500 bash bench/gpu.sh measure
#   then:   the table is the call's last output; logs and JSON are in its $OUT
#
# prepare stages MLX-CUDA's wheel in two halves (../shared/gpu/prepare.sh),
# the wheels mlx_mtp needs that the GPU image lacks, and the demo converted to
# 4-bit (6 MiB) into .gpu/p2. The demo's fp32 weights (36 MiB) travel with
# every call as tracked files and do not fit beside a wheel half: untrack them
# for the two calls (prepare prints how, and how to undo it).
#
# measure installs, then runs, most important first, each step cut off by
# what is left of DEADLINE seconds (its logs say so):
#   1. the CUDA kernel tests (tests/test_kernels_cuda.py: qmv_rows bit for bit
#      MLX's one-row op, the other twins against their references);
#   2. bench/verify_cost.py: each 27B projection at M = 1..8 rows, MLX's
#      quantized matmul and qmv_rows, GDN / conv / attention at M tokens;
#   3. greedy identity with mlx_lm on the demo at 4 bits, depths 1 and 3;
#   4. bench.py on Qwen3.6-27B shapes, 4-bit, oracle drafts at 0.8 and 0.9:
#      depths 0, 3, auto, verify(k+1)/decode for k = 1..4, identity with
#      mlx_lm, cold start (each graph's first run compiles its kernels);
#   5. the same 27B run with MLX's op for every product (MLX_MTP_QMV_ROWS=0:
#      the before), then bf16 weights.
# `LOCAL=1 OUT=/tmp/x bash bench/gpu.sh measure` runs the same steps here on
# tiny shapes (verify_cost through the emulated CUDA twin): a smoke test of
# the script, whose numbers say nothing about a GPU.
set -u
usage() { echo "usage: bench/gpu.sh prepare | copy | measure" >&2; exit 2; }
[ $# -ge 1 ] || usage
cmd=$1; shift
case $cmd in
prepare)
  root=$(git rev-parse --show-toplevel); cd "$root"
  [ -d .gpu/p1 ] || bash ../shared/gpu/prepare.sh || exit 1
  rm -rf .gpu/p2/whl .gpu/p2/demo_q4 && mkdir -p .gpu/p2/whl
  # mlx_mtp.params needs jsonschema, which the GPU image lacks
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 -d .gpu/p2/whl jsonschema jsonschema-specifications referencing \
    rpds-py || exit 1
  python -m mlx_mtp.convert --hf-path mlx_mtp/demo --mlx-path .gpu/p2/demo_q4 -q --dtype bfloat16 \
    >/dev/null || exit 1
  du -sh .gpu/p1 .gpu/p2
  echo "the demo's weights travel with every call: untrack them for the two calls"
  echo "  git rm -q --cached mlx_mtp/demo/*.safetensors; echo '/mlx_mtp/demo/*.safetensors' >> .git/info/exclude"
  echo "and afterwards (before any commit): git reset -q -- mlx_mtp/demo; sed -i '\|^/mlx_mtp/demo/|d' .git/info/exclude"
  ;;
copy)
  mkdir -p /tmp/mlxw && cp .gpu/p1/part_* /tmp/mlxw/ && nvidia-smi -L
  ;;
measure)
  : "${OUT:?the device sets OUT (LOCAL=1 runs need it set)}"
  T0=$(date +%s)
  el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
  left() { echo $(( ${DEADLINE:-500} - $(date +%s) + T0 )); }
  # run NAME SECONDS CMD...: the step, cut at min(SECONDS, what is left minus 20 s for the table)
  step() {
    local name=$1 want=$2; shift 2
    local t=$(( $(left) - 20 )); [ "$t" -gt "$want" ] && t=$want
    if [ "$t" -lt 15 ]; then el "$name: skipped, no time left"; echo skipped > "$OUT/$name.rc"; return; fi
    el "$name: up to ${t}s"
    timeout "$t" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?; echo $rc > "$OUT/$name.rc"
    el "$name: rc=$rc$([ $rc = 124 ] && echo ' (cut off: see its log)')"
  }
  mkdir -p "$OUT"
  export PYTHONUNBUFFERED=1
  emu=  # LOCAL: this machine's MLX, tiny shapes; verify_cost through the emulated CUDA twin
  if [ -n "${LOCAL:-}" ]; then
    emu="env MLX_MTP_KERNELS=emu-cuda"
    demo=${DEMO_Q4:-.gpu/p2/demo_q4}; tiny=--tiny; few="--max-tokens 8"; py=python
    depths=0,1; rates=0.8; costs=1,2
  else
    bash .gpu/p2/install.sh || exit 1
    export PYTHONPATH=/tmp/site:$PWD
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/p2/whl/*.whl \
      || exit 1
    demo=.gpu/p2/demo_q4; tiny=; few="--max-tokens 48"; py=python3
    depths=0,3,auto; rates=0.8,0.9; costs=1,2,3,4
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
  fi
  printf 'a\n\nb\n' > "$OUT/two_prompts.txt"  # 27B shapes: random tokens, one per paragraph
  b27="bench/bench.py --synthetic-27b $tiny --prompts $OUT/two_prompts.txt --rounds 1 $few"
  step kernel_tests 150 $py -m pytest -q -x tests/test_kernels_cuda.py
  step verify_cost_q4 120 $emu $py bench/verify_cost.py $tiny --bits 4 --iters 10 --json "$OUT/verify_cost_q4.json"
  step demo_q4 90 $py bench/bench.py --model "$demo" --depths 1,3 --rounds 1 --max-tokens 64 \
    --json "$OUT/demo_q4.json"
  step bench_q4 330 $py $b27 --bits 4 --oracle-rate $rates --depths $depths --cost-depths $costs \
    --json "$OUT/bench_q4.json"
  step bench_q4_mlx_op 150 env MLX_MTP_QMV_ROWS=0 $py $b27 --bits 4 --oracle-rate 0.8 --depths 0,3 \
    --cost-depths $costs --json "$OUT/bench_q4_mlx_op.json"
  step verify_cost_bf16 60 $emu $py bench/verify_cost.py $tiny --bits 0 --rows 1,2,3,4,5 --iters 5 \
    --json "$OUT/verify_cost_bf16.json"
  step bench_bf16 150 $py $b27 --oracle-rate 0.8 --depths 0,3 --cost-depths $costs \
    --json "$OUT/bench_bf16.json"
  el "done; the table:"
  $py bench/gpu_table.py "$OUT"
  ;;
*) usage ;;
esac
