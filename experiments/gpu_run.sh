#!/usr/bin/env bash
# The whole GPU measurement as one command (no network, well under 10 minutes):
# the CUDA tests, the pipeline benchmark, then the data-parallel sync check
# (one GPU, a data-parallel group of one: sync machinery vs none, and vs DDP).
# Results (JSON + logs + device) go to OUTDIR.
#   bash experiments/gpu_run.sh OUTDIR [--quick]
set -uo pipefail
out=${1:?usage: gpu_run.sh OUTDIR [--quick]}
quick=${2:-}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
status=0
python3 - <<'PY' | tee "$out/device.txt"
import torch
print(f"torch {torch.__version__} cuda {torch.version.cuda} device {torch.cuda.get_device_name()}")
PY
timeout 240 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$out/cuda_tests.log" || status=1
if [ "$quick" = "--quick" ]; then
  bench=(--models resnet18 --rounds 2 --steps 5 --configs "plain;plain+graph;pipedp:S=2,M=2;pipedp:S=2,M=2,graph")
else
  bench=(--models resnet18,resnet34,resnet50)
fi
timeout 480 python3 -m experiments.bench_pipeline --device cuda "${bench[@]}" --out "$out/pipeline.json" 2>&1 \
  | tee "$out/bench.log" || status=1
timeout 180 python3 -m experiments.bench_dp --device cuda --procs 1 --models resnet18,resnet50 --batch 128 \
  --stages 2 --microbatches 4 --rounds 5 --steps 10 --out "$out/dp.json" 2>&1 | tee "$out/dp.log" || status=1
exit $status
