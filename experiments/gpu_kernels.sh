#!/usr/bin/env bash
# The GPU measurement of the depthwise kernels as one command (no network, no compiler; about 5 minutes on
# an H100, each step cut to fit 560 s in all):
#   (a) the CUDA kernel tests: every kernel of the carried library against torch on the GPU;
#   (b) a tuning round, if one is carried in .gpu/round (tune-kernels --remote-round .gpu/round), measured;
#   (c) the benchmark: fwd, grad-input and grad-weight of MobileNetV2's and EfficientNet-B0's depthwise
#       convolutions at 32x32 and 224x224, batch 64 and 128, fp32 and bf16, against torch's best layout per
#       shape, with the memory bound at each size (experiments/bench_depthwise_gpu.py);
#   (d) a MobileNetV2 training step (CIFAR, batch 128) with kernels="auto" vs plain torch, each in its best
#       layout, kernels="auto" deciding by (c)'s timings.
# Results go to OUTDIR (at most 6 files: device.txt, run.log, depthwise_gpu.json, depthwise_gpu.md,
# train_step.json, round_results.json).
#   bash experiments/gpu_kernels.sh OUTDIR [--quick | --dry-run]
# GPU_KERNELS_BUDGET (560), GPU_KERNELS_TESTS_S (90), GPU_KERNELS_ROUND_S (150) and GPU_KERNELS_KEEP_S (330, what
# the round leaves for the benchmark and the step) size a shorter call.
# --dry-run: set up as for a run and check it (the imports, the CUDA tests collected, the benchmark's plan),
# time nothing (no GPU needed).
# Carry .gpu: the runtime bundle (bash ../shared/tools/gpu-bundle.sh: .gpu/wheels, .gpu/tvmlib) and the
# library (python -m experiments.build_gpu_kernels --arch sm_90 --out .gpu/kernels).
set -uo pipefail
out=${1:?usage: gpu_kernels.sh OUTDIR [--quick | --dry-run]}
quick=${2:-}
mkdir -p "$out"
out=$(cd "$out" && pwd)
log=$out/run.log
budget=${GPU_KERNELS_BUDGET:-560}  # seconds for the whole command (a run gets 600): each step is cut to fit
tests_s=${GPU_KERNELS_TESTS_S:-90}  # (a)'s limit
round_s=${GPU_KERNELS_ROUND_S:-150}  # (b)'s limit
keep_s=${GPU_KERNELS_KEEP_S:-330}  # what (b) leaves for (c) and (d)
left() { echo $(( budget - SECONDS - $1 )); }  # seconds left, keeping $1 for the steps after this one
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo" || exit 1
export PYTHONUNBUFFERED=1
status=0

# The TVM runtime (tvm_ffi and libtvm_runtime*.so) from the bundle, where the host has none of its own.
if ! python3 -c "import tvm_ffi" 2>/dev/null && compgen -G ".gpu/wheels/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/pipedp-site .gpu/wheels/*.whl \
    && export PYTHONPATH=/tmp/pipedp-site${PYTHONPATH:+:$PYTHONPATH}
fi
[ -d .gpu/tvmlib ] && export PIPEDP_TVM_LIB=${PIPEDP_TVM_LIB:-$repo/.gpu/tvmlib}
# Every command runs from an overlay: a folder of links to this checkout in which pipedp/ holds kernels/ and
# experiments/ as the installed wheel maps them (pipedp.kernels, pipedp.experiments), beside the checkout's
# experiments/, tests/, .gpu/ and pyproject.toml. `python3 -m` and pytest put the working folder first on
# sys.path, so run from the checkout its pipedp/ (which has no kernels/) would shadow any overlay given in
# PYTHONPATH, and an installed pipedp too: from the overlay, this checkout's code is what runs, installed or
# not, one copy of it (PYTHONPATH names the overlay too, for processes started in another folder).
overlay=$(mktemp -d)
trap 'rm -rf "$overlay"' EXIT
mkdir "$overlay/pipedp"
for f in "$repo"/pipedp/*; do ln -s "$f" "$overlay/pipedp/"; done
ln -s "$repo/kernels" "$overlay/pipedp/kernels"
ln -s "$repo/experiments" "$overlay/pipedp/experiments"
for f in experiments kernels tests .gpu pyproject.toml; do
  [ -e "$repo/$f" ] && ln -s "$repo/$f" "$overlay/$f"
done
export PYTHONPATH=$overlay${PYTHONPATH:+:$PYTHONPATH}
cd "$overlay" || exit 1
if ! python3 -c "import pipedp.kernels.tvm.cli, pipedp.experiments, experiments.bench_depthwise_gpu" >/dev/null; then
  echo "gpu_kernels.sh: pipedp.kernels or the experiments do not import from $overlay (see above)" | tee -a "$log"
  exit 1
fi
if [ "$quick" = "--dry-run" ]; then
  python3 -c "import os, pipedp, pipedp.kernels; print('pipedp', os.path.dirname(pipedp.__file__), 'kernels', \
os.path.dirname(pipedp.kernels.__file__))" || exit 1
  python3 -m pytest -q --collect-only -p no:cacheprovider tests/experiments/test_depthwise_gpu_numerics.py || exit 1
  python3 -m experiments.bench_depthwise_gpu --dry-run | tail -n 1 || exit 1
  exit 0
fi

python3 - <<'PY' | tee "$out/device.txt"
import torch
print(f"torch {torch.__version__} cuda {torch.version.cuda} device {torch.cuda.get_device_name()}")
PY

echo "== (a) CUDA kernel tests" | tee -a "$log"
timeout "$tests_s" python3 -m pytest -q -m cuda -p no:cacheprovider tests/experiments/test_depthwise_gpu_numerics.py 2>&1 \
  | tee -a "$log" || status=1

t=$(left "$keep_s"); [ "$t" -gt "$round_s" ] && t=$round_s  # (the benchmark and the training step keep keep_s)
if [ -f .gpu/round/round.json ] && [ "$t" -gt 60 ]; then
  echo "== (b) tuning round .gpu/round" | tee -a "$log"
  timeout "$t" python3 -m pipedp.ops.measure .gpu/round --out "$out/round_results.json" --time-limit $((t - 30)) 2>&1 \
    | tee -a "$log" || status=1
fi

echo "== (c) depthwise benchmark" | tee -a "$log"
db=$(mktemp -d)/db
bench=(--kernels .gpu/kernels --out "$out" --db "$db")
t=$(left 120)  # (the training step keeps 120 s)
[ "$t" -lt 30 ] && t=$(left 0)  # a short budget: the benchmark first, the step only if time is left
if [ "$t" -lt 20 ]; then echo "== (c) not run: ${t}s left of GPU_KERNELS_BUDGET=$budget" | tee -a "$log"; exit 1; fi
if [ "$quick" = "--quick" ]; then
  bench+=(--sizes 32 --batches 128 --rounds 2 --time-limit $(( t * 2 / 3 < 60 ? t * 2 / 3 : 60 )))
else
  bench+=(--time-limit $(( t - (t / 3 > 60 ? t / 3 : 60) > 20 ? t - (t / 3 > 60 ? t / 3 : 60) : t * 2 / 3 )))  # rows not started by then say so; the rest writes
fi
timeout "$t" python3 -m experiments.bench_depthwise_gpu "${bench[@]}" 2>&1 | tee -a "$log" || status=1

echo "== (d) MobileNetV2 training step, kernels=auto vs torch, each in its best layout" | tee -a "$log"
if [ -f "$db/records.jsonl" ] && [ "$(left 0)" -ge 20 ]; then
  steps=(--windows 5 --window 5)
  [ "$quick" = "--quick" ] && steps=(--windows 2 --window 3)
  timeout "$(left 0)" python3 -m experiments.bench_kernels_train --device cuda --model mobilenet_v2 \
    --input-shape 128,3,32,32 --layout best --db "$db" "${steps[@]}" --out "$out/train_step.json" 2>&1 \
    | tee -a "$log" || status=1
else
  echo "no kernel database from (c) (no library carried?) or no time left: training step skipped" | tee -a "$log"
  status=1
fi
exit $status
