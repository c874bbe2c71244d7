#!/usr/bin/env bash
# The whole GPU measurement as one command (no network, well under 10 minutes):
# the CUDA tests, the pipeline benchmark, the data-parallel sync check (one GPU,
# a data-parallel group of one: sync machinery vs none, and vs DDP), then
# reproduce-paper: the CIFAR-shaped speed table for ResNet-18/34/50 on synthetic
# data with a pipeline trace, and ResNet-18's accuracy on digits.
# Results (JSON + tables + plots + logs + device) go to OUTDIR.
#   bash experiments/gpu_run.sh OUTDIR [--quick]
# Digits on a host without scikit-learn: write the arrays beforehand, where it is installed:
#   python -c "from experiments.data import save_digits; save_digits('.gpu/digits.npz')"
# The folder holds more than a dozen files: pack it (tar) if what comes back is limited.
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
[ -f .gpu/digits.npz ] && export PIPEDP_DIGITS_NPZ=$PWD/.gpu/digits.npz
paper=(--device cuda --no-progress --batch-size 128 --microbatches 4)
if [ "$quick" = "--quick" ]; then
  speed=(--models resnet18 --train-images 1024); acc=(--epochs 2)
else
  speed=(--models resnet18,resnet34,resnet50 --train-images 4096); acc=(--epochs 10)
fi
timeout 300 python3 -m experiments.reproduce_paper "${paper[@]}" "${speed[@]}" --dataset synthetic --epochs 2 \
  --test-images 512 --trace "$out/trace.json" --out "$out/paper_speed" 2>&1 | tee "$out/paper_speed.log" || status=1
timeout 180 python3 -m experiments.reproduce_paper "${paper[@]}" "${acc[@]}" --models resnet18 --dataset digits \
  --out "$out/paper_digits" 2>&1 | tee "$out/paper_digits.log" || status=1
exit $status
