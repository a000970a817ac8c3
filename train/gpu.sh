#!/bin/bash
# One training stage of the demo on a lent GPU (MLX's CUDA backend), in the
# two back-to-back device calls a 15-minute lease allows. train/README.md,
# "Stages 8-9 on a lent GPU", tells the whole procedure and what it gave.
#
#   here:   bash train/gpu.sh prepare RUN INIT [train.train data flags...]
#   call 1: carry [".gpu/p1", ".gpu/d1"]:  bash train/gpu.sh copy
#   call 2: carry [".gpu/p2", ".gpu/d2"]:  DEADLINE=540 bash train/gpu.sh run RUN [the same data flags, training flags...]
#
# prepare builds the stage's token stream here (train.train --smoke on a tiny
# batch: the data does not depend on the batch), packs it as uint16 with the
# tokenizer and the wheels MLX's code needs there (.gpu/d1), and the init
# weights as float16 (.gpu/d2: the wheel halves fill most of each call's
# 64 MiB). run trains until DEADLINE seconds after it started minus the time
# the export and the head need, then, if HEAD=1, retrains the head
# (train/head.py) and brings back the trunk checkpoint (15 MiB pieces) and
# the head's, with the run's config.json, into the device's $OUT. Join the pieces here with
# `cat NAME.part_* > RUN/ckpt.safetensors` (NAME: RUN's last part), then
# export and ship on the CPU: `python -m train.export RUN mlx_mtp/demo`.
# `LOCAL=1 OUT=/tmp/x DEADLINE=... bash train/gpu.sh run ...` dry-runs it here.
set -u
usage() { echo "usage: train/gpu.sh prepare RUN INIT [flags] | copy | run RUN [flags]" >&2; exit 2; }
[ $# -ge 1 ] || usage
cmd=$1; shift
case $cmd in
prepare)
  [ $# -ge 2 ] || usage
  run=$1; init=$2; shift 2
  root=$(git rev-parse --show-toplevel); cd "$root"
  [ -d .gpu/p1 ] || bash ../shared/gpu/prepare.sh
  python -m train.train --out "$run" --init "$init" --smoke --batch 1 --seq 16 "$@" >/dev/null || exit 1
  rm -rf .gpu/d1 .gpu/d2 && mkdir -p .gpu/d1/whl .gpu/d2
  cp -r "$run/tokenizer" "$run/heldout.txt" .gpu/d1/
  python - "$run" "$init" <<'EOF' || exit 1
import sys, numpy as np, mlx.core as mx
from train.train import initial_weights  # a ckpt.safetensors or a model folder (mlx_mtp/demo)
z = np.load(f"{sys.argv[1]}/tokens.npz")
np.savez_compressed(".gpu/d1/tokens16.npz", train=z["train"].astype(np.uint16), held=z["held"].astype(np.uint16))
w = initial_weights(sys.argv[2])
mx.save_safetensors(".gpu/d2/init16.safetensors", {k: v.astype(mx.float16) for k, v in w.items()})
EOF
  # mlx_mtp.params needs jsonschema, which the GPU image lacks (it has attrs)
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 -d .gpu/d1/whl jsonschema jsonschema-specifications referencing rpds-py \
    || exit 1
  du -sh .gpu/p1 .gpu/d1 .gpu/p2 .gpu/d2
  echo "the demo's weights travel with every call: untrack them for the two calls"
  echo "  git rm -q --cached mlx_mtp/demo/*.safetensors; echo '/mlx_mtp/demo/*.safetensors' >> .git/info/exclude"
  echo "and afterwards: git reset -q -- mlx_mtp/demo; sed -i '\|^/mlx_mtp/demo/|d' .git/info/exclude"
  ;;
copy)
  mkdir -p /tmp/mlxw /tmp/c && cp .gpu/p1/part_* /tmp/mlxw/ && cp -r .gpu/d1 /tmp/c/ && nvidia-smi -L
  ;;
run)
  [ $# -ge 1 ] || usage
  : "${OUT:?the device sets OUT (LOCAL=1 runs need it set)}"
  run=$1; shift
  T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
  left() { echo $(( ${DEADLINE:-540} - $(date +%s) + T0 )); }
  C=/tmp/c/d1; G=/tmp/g; name=$(basename "$run")
  if [ -n "${LOCAL:-}" ]; then  # a dry run on this machine's MLX: LOCAL=1 OUT=/tmp/x
    C=.gpu/d1; G=$(mktemp -d); mkdir -p "$OUT"
  else
    bash .gpu/p2/install.sh || exit 1
    export PYTHONPATH=/tmp/site:$PWD
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $C/whl/*.whl || exit 1
  fi
  export PYTHONUNBUFFERED=1
  mkdir -p $G/$name $G/head && cp -r $C/tokenizer $G/$name/ && cp $C/heldout.txt $G/head/
  python3 - <<EOF || exit 1
import numpy as np, mlx.core as mx
z = np.load("$C/tokens16.npz")
for d in ("$G/$name", "$G/head"):
    np.savez(f"{d}/tokens.npz", train=z["train"].astype(np.int32), held=z["held"].astype(np.int32))
w = mx.load(".gpu/d2/init16.safetensors")
mx.save_safetensors("$G/init.safetensors", {k: v.astype(mx.float32) for k, v in w.items()})
EOF
  reserve=60; [ "${HEAD:-0}" = 1 ] && reserve=300
  tl=$(python3 -c "print(round(max(1.0, ($(left) - $reserve) / 60), 2))")
  el "training $tl min"
  # The export's reload check fails on CUDA (its logits differ from the
  # chunked training forward by ~1e-2 there, 2e-5 on the CPU): the run
  # stops there, after its checkpoint is saved; export here. The slack
  # covers the corpus build before the time limit starts and the final save.
  timeout $(python3 -c "print(int($tl * 60 + 90))") python3 -m train.train --out $G/$name \
    --init $G/init.safetensors --steps 100000 --time-limit $tl "$@" > $OUT/train.log 2>&1
  el "train rc=$?"; grep -v "^ \|^Traceback" $OUT/train.log | tail -3
  grep -q "^\[.*\] training: " $OUT/train.log || { el "training did not finish: no checkpoint"; exit 1; }
  split -b 15m $G/$name/ckpt.safetensors $OUT/$name.part_ && cp $G/$name/config.json $OUT/ || exit 1
  if [ "${HEAD:-0}" = 1 ]; then
    python3 -m train.export $G/$name $G/demo --no-reload-check || { el "export failed"; exit 1; }
    timeout 100 python3 -m train.head cache --out $G/head --demo-dir $G/demo --train-tokens 262144 --greedy-tokens 32768 > $OUT/head.log 2>&1
    htl=$(python3 -c "print(round(max(0.3, ($(left) - 75) / 60), 2))")
    timeout $(python3 -c "print(int($htl * 60 + 60))") python3 -m train.head train --out $G/head --demo-dir $G/demo \
      --steps 5000 --time-limit $htl >> $OUT/head.log 2>&1 || el "head training rc=$? (head.log)"
    cp $G/head/head_ckpt.safetensors $OUT/ || exit 1; tail -2 $OUT/head.log
  fi
  ls -la $OUT; el done
  ;;
*) usage ;;
esac
