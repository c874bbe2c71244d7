#!/usr/bin/env bash
# The GPU measurement, in parts: each part is one call of well under 10 minutes
# (its steps carry their own timeouts), needs no network, and writes JSON +
# logs + the device name into OUTDIR. Run the parts in any order, in one
# session or several; then `report` (CPU is enough) turns every JSON found in
# OUTDIR into speed.md: the README's baseline table, pipedp rows, ceiling share,
# profiler busy fractions and issue 17's goals checked.
#
#   bash experiments/gpu_run.sh OUTDIR list          # the parts, in priority order, with estimated minutes
#   bash experiments/gpu_run.sh OUTDIR <part> [--quick]
#
# --quick: a smoke run of the part (one small model, one batch size), a minute or two.
# Digits on a host without scikit-learn: write the arrays beforehand, where it is installed:
#   python -c "from experiments.data import save_digits; save_digits('.gpu/digits.npz')"
# torch.compile's caches go to .gpu/inductor (ignored by git; kept while the machine stays warm).
set -uo pipefail
out=${1:?usage: gpu_run.sh OUTDIR list|<part> [--quick]}
part=${2:-list}
quick=${3:-}
py=${PYTHON:-python3}

# part | estimated minutes on one H100 (tests, r18, r50, mbv2: as measured 2026-11-25) | what it measures
parts=(
  "tests|2|the CUDA tests (engine, graphs, trials, baselines, ceiling, benchmark rows)"
  "best|5|issue 26: pipedp stages=auto vs the strongest alternative (eager/compile/graph/graph+compile x NCHW/channels_last, accumulation), CIFAR ResNet-18 batch 64, fp32 and bf16"
  "best-b128|5|the same at batch 128"
  "r18-fp32|2|CIFAR ResNet-18, batch 32/64/128/256, fp32: eager, graph, pipedp auto and fixed SxM"
  "r18-bf16cl|2|the same in bf16 autocast + channels_last"
  "r34-fp32|3|CIFAR ResNet-34, as r18"
  "r34-bf16cl|3|"
  "r50-fp32|4|CIFAR ResNet-50, as r18"
  "r50-bf16cl|4|"
  "mbv2-fp32|3|CIFAR MobileNetV2, as r18"
  "mbv2-bf16cl|3|"
  "imagenet|7|ImageNet-shaped ResNet-50 (224x224, 1000 classes), batch 64, fp32 and bf16cl"
  "ceiling-cifar|8|K=1,2,4 graphed copies on K streams: ResNet-18/34, batch 32..256, both numerics"
  "ceiling-r50|7|the same for CIFAR ResNet-50 and MobileNetV2"
  "ceiling-imagenet|3|the same for ImageNet-shaped ResNet-50, batch 64"
  "compile-r18|9|whole-step graphs of the compiled model (default, max-autotune) vs pipedp (graph; graph+compile), ResNet-18, batch 64, bf16cl"
  "compile-r18-b128|9|the same at batch 128"
  "compile-r18-fp32|9|the same in fp32"
  "compile-r50|9|the same for ResNet-50 (CIFAR), batch 128, bf16cl"
  "paper-cifar|6|paper speed table: ResNet-18/34/50 at CIFAR-10 and CIFAR-100 shapes, batch 128, fp32"
  "paper-caltech|8|paper speed table: ResNet-18/34/50 at Caltech-101 shape (224x224, 101 classes), batch 64, fp32"
  "digits|4|reproduce-paper accuracy: ResNet-18 on digits, plain vs pipedp"
  "paper-speed|6|reproduce-paper end to end on synthetic CIFAR-shaped data: ResNet-18/34/50 speed table + a pipeline trace"
  "dp|3|data-parallel sync machinery on one GPU (a group of one) vs none and vs DDP"
  "forecast|3|issue 28: H100 block profiles of CIFAR ResNet-18/34/50 and the layout forecast for 2, 4, 8 GPUs over PCIe 4 and NVLink 4, global batch 128"
  "layouts-4procs|5|issue 28: every dp x pp layout of 4 CPU processes (4 threads each) measured against its forecast (ResNet-18/50, global batch 64)"
  "layouts-8procs|8|the same with 8 processes of 2 threads"
  "cpu-stages|2|concurrent CPU stages on the GPU host's 16 cores vs plain and the best single stage (ResNet-18, batch 128)"
)

if [ "$part" = "list" ]; then
  for p in "${parts[@]}"; do IFS='|' read -r name mins what <<<"$p"; printf '%-17s ~%2s min  %s\n' "$name" "$mins" "$what"; done
  echo "report            (CPU) speed.md from every bench_*.json / ceiling_*.json in OUTDIR"
  exit 0
fi

mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$PWD/.gpu/inductor}
status=0
log() { tee -a "$out/$part.log"; }

if [ "$part" = "report" ]; then
  shopt -s nullglob
  bench=("$out"/bench_*.json); ceil=("$out"/ceiling_*.json)
  [ ${#bench[@]} -gt 0 ] || { echo "no bench_*.json in $out: run the bench parts first" >&2; exit 1; }
  args=("${bench[@]}")
  [ ${#ceil[@]} -gt 0 ] && args+=(--ceiling "${ceil[@]}")
  $py -m experiments.speed_report "${args[@]}" --out "$out/speed.md"
  exit $?
fi

$py - <<'PY' | tee "$out/device_$part.txt"
import torch
print(f"torch {torch.__version__} cuda {torch.version.cuda} device {torch.cuda.get_device_name()}")
PY

batches=32,64,128,256
eager_rows="eager;graph;pipedp:graph;pipedp:graph,branches,split_grads;pipedp:S=1,M=1,graph;pipedp:S=2,M=2,graph;pipedp:S=2,M=4,graph;pipedp:S=1,M=4,graph,recompute"
# The compiled baselines that count are whole-step captures of the compiled model (graph+compile,
# graph+max-autotune): compile and max-autotune alone leave the optimizer step and the host on the critical
# path (0.19x and 0.61x of the graphed eager step, ResNet-18 bf16cl batch 64, H100, 2026-11-25). max-autotune
# compiles for minutes per model, so a part times one batch size.
compile_rows="eager;graph;graph+compile;graph+max-autotune;pipedp:graph;pipedp:graph,compile"
bench() {  # bench NAME MODELS BATCHES NUMERICS CONFIGS [TIMEOUT_S]
  local name=$1 models=$2 b=$3 nums=$4 configs=$5 limit=${6:-530}
  if [ "$quick" = "--quick" ]; then models=${models%%,*}; b=${b%%,*}; limit=240; fi
  timeout "$limit" $py -m experiments.bench_pipeline --device cuda --models "$models" --batch "$b" \
    --numerics "$nums" --configs "$configs" --out "$out/bench_$name.json" 2>&1 | log || status=1
}
ceiling() {  # ceiling NAME MODELS BATCHES
  local name=$1 models=$2 b=$3 limit=530
  if [ "$quick" = "--quick" ]; then models=${models%%,*}; b=${b%%,*}; limit=240; fi
  timeout "$limit" $py -m experiments.ceiling --device cuda --models "$models" --batch "$b" \
    --out "$out/ceiling_$name.json" 2>&1 | log || status=1
}

case "$part" in
  best|best-b128)
    # BEST_MODELS, BEST_BATCH, BEST_PRECISION and BEST_FLAGS (more bench_best options, e.g. --streams --rounds 3)
    # override the defaults; groups run in the order given and each is written when done, so a cut run keeps them.
    limit=540; b=${BEST_BATCH:-64}; [ "$part" = "best-b128" ] && b=128
    precisions=${BEST_PRECISION:-fp32,bf16}; if [ "$quick" = "--quick" ]; then precisions=fp32; limit=240; fi
    # shellcheck disable=SC2086
    timeout "$limit" $py -m experiments.bench_best --device cuda --models "${BEST_MODELS:-resnet18}" --batch "$b" \
      --precision "$precisions" ${BEST_FLAGS:-} --out "$out/${part}_gpu.json" --md "$out/${part}_gpu.md" 2>&1 \
      | log || status=1 ;;
  tests)
    timeout 500 $py -m pytest -q -m cuda -p no:cacheprovider tests/test_cuda.py tests/test_build.py \
      tests/experiments/test_baselines.py tests/experiments/test_ceiling.py tests/experiments/test_bench_pipeline.py \
      2>&1 | log || status=1 ;;
  r18-fp32|r18-bf16cl|r34-fp32|r34-bf16cl|r50-fp32|r50-bf16cl|mbv2-fp32|mbv2-bf16cl)
    declare -A model=([r18]=resnet18 [r34]=resnet34 [r50]=resnet50 [mbv2]=mobilenet_v2)
    bench "$part" "${model[${part%%-*}]}" "$batches" "${part#*-}" "$eager_rows" ;;
  imagenet)
    # Fewer rows: each graphed configuration keeps its activations (about 10 GB at 224x224) while windows alternate.
    bench imagenet resnet50@224/1000 64 fp32,bf16cl "eager;graph;pipedp:graph;pipedp:S=2,M=4,graph" ;;
  ceiling-cifar)
    ceiling cifar resnet18,resnet34 "$batches" ;;
  ceiling-r50)
    ceiling r50 resnet50,mobilenet_v2 "$batches" ;;
  ceiling-imagenet)
    ceiling imagenet resnet50@224/1000 64 ;;
  compile-r18)
    bench compile_r18 resnet18 64 bf16cl "$compile_rows" 540 ;;
  compile-r18-b128)
    bench compile_r18_b128 resnet18 128 bf16cl "$compile_rows" 540 ;;
  compile-r18-fp32)
    bench compile_r18_fp32 resnet18 64 fp32 "$compile_rows" 540 ;;
  compile-r50)
    bench compile_r50 resnet50 128 bf16cl "$compile_rows" 540 ;;
  paper-cifar)
    bench paper_cifar resnet18@32/10,resnet18@32/100,resnet34@32/10,resnet34@32/100,resnet50@32/10,resnet50@32/100 \
      128 fp32 "eager;graph;pipedp:graph" ;;
  paper-caltech)
    bench paper_caltech resnet18@224/101,resnet34@224/101,resnet50@224/101 64 fp32 "eager;graph;pipedp:graph" ;;
  digits)
    [ -f .gpu/digits.npz ] && export PIPEDP_DIGITS_NPZ=$PWD/.gpu/digits.npz
    epochs=10; [ "$quick" = "--quick" ] && epochs=2
    timeout 500 $py -m experiments.reproduce_paper --device cuda --no-progress --batch-size 128 --microbatches 4 \
      --epochs "$epochs" --models resnet18 --dataset digits --out "$out/paper_digits" 2>&1 | log || status=1 ;;
  paper-speed)
    models=resnet18,resnet34,resnet50; images=4096; [ "$quick" = "--quick" ] && { models=resnet18; images=1024; }
    timeout 500 $py -m experiments.reproduce_paper --device cuda --no-progress --batch-size 128 --microbatches 4 \
      --models "$models" --train-images "$images" --dataset synthetic --epochs 2 --test-images 512 \
      --trace "$out/trace.json" --out "$out/paper_speed" 2>&1 | log || status=1 ;;
  forecast)
    timeout 300 $py -m experiments.forecast_table --device cuda --models resnet18,resnet34,resnet50 --batch 128 \
      --devices 2,4,8 --links pcie4,nvlink4 --out "$out/forecast_h100.json" 2>&1 | log || status=1 ;;
  layouts-4procs|layouts-8procs)
    procs=${part#layouts-}; procs=${procs%procs}
    timeout 500 $py -m experiments.bench_layouts --device cpu --procs "$procs" --threads $((16 / procs)) --models resnet18,resnet50 \
      --batch 64 --rounds 2 --out "$out/layouts_${procs}procs.json" 2>&1 | log || status=1 ;;
  cpu-stages)
    rounds=3; [ "$quick" = "--quick" ] && rounds=2
    timeout 300 $py -m experiments.bench_cpu_stages --models resnet18 --rounds "$rounds" --steps 2 \
      --auto-microbatches auto --out "$out/cpu_stages_16core.json" 2>&1 | log || status=1 ;;
  dp)
    timeout 300 $py -m experiments.bench_dp --device cuda --procs 1 --models resnet18,resnet50 --batch 128 \
      --stages 2 --microbatches 4 --rounds 5 --steps 10 --out "$out/dp.json" 2>&1 | log || status=1 ;;
  *)
    echo "unknown part '$part': bash experiments/gpu_run.sh OUTDIR list" >&2; exit 2 ;;
esac
exit $status
