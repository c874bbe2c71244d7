#!/usr/bin/env bash
# One GPU call that runs several measurement steps under one deadline and brings every result back as a
# single archive (a call returns at most 8 files; the parts write more). Each step gets its own time limit,
# cut to what is left before the deadline; a step that is cut still leaves its log and whatever JSON it wrote
# (the benchmarks write after every group), and the archive is rewritten after every step, so a call killed
# at its limit still returns everything finished before.
#
#   bash experiments/gpu_session.sh OUT DEADLINE_S STEP...
#   STEP: tests:SECONDS | kernels:SECONDS[:quick] | PART:SECONDS[:quick]   (PART: a gpu_run.sh part)
#   e.g. bash experiments/gpu_session.sh $OUT 570 tests:140 kernels:190:quick best:240:quick
#
# Carry .gpu (the runtime bundle and the kernel library); results land in OUT/results.tgz (one folder per
# step) and OUT/session.log.
set -uo pipefail
out=${1:?usage: gpu_session.sh OUT DEADLINE_S STEP...}
deadline=${2:?usage: gpu_session.sh OUT DEADLINE_S STEP...}
shift 2
mkdir -p "$out" && out=$(cd "$out" && pwd) || exit 1
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo" || exit 1
work=$(mktemp -d)
log=$out/session.log
export PYTHONUNBUFFERED=1
# Compile caches outside the carried .gpu (a carried path is replaced on every call): a later call on the
# same warm machine reuses them.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/pipedp-inductor}

if ! python3 -c "import tvm_ffi" 2>/dev/null && compgen -G ".gpu/wheels/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/wheels/*.whl >>"$log" 2>&1 \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
[ -d .gpu/tvmlib ] && export PIPEDP_TVM_LIB=$repo/.gpu/tvmlib
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>&1 | tee -a "$log"

pack() { tar czf "$out/results.tgz.tmp" -C "$work" . && mv "$out/results.tgz.tmp" "$out/results.tgz"; }
status=0
for step in "$@"; do
  IFS=: read -r name secs quick <<<"$step"
  if ! [[ $secs =~ ^[0-9]+$ ]]; then echo "== $step: not run, give it seconds (NAME:SECONDS)" | tee -a "$log"; continue; fi
  left=$(( deadline - SECONDS - 5 ))
  [ "$secs" -gt "$left" ] && secs=$left
  if [ "$secs" -lt 30 ]; then echo "== $name: not run, ${secs}s is under 30 s (${left}s left before the deadline)" | tee -a "$log"; continue; fi
  mkdir -p "$work/$name"
  echo "== $name: ${secs}s (at ${SECONDS}s)" | tee -a "$log"
  quickflag=${quick:+--quick}
  if [ "$name" = "kernels" ]; then
    cmd=(env GPU_KERNELS_BUDGET=$(( secs - 10 )) bash experiments/gpu_kernels.sh "$work/$name" $quickflag)
  else
    cmd=(bash experiments/gpu_run.sh "$work/$name" "$name" $quickflag)
  fi
  # Each step in a session of its own: a part's own `timeout` puts its Python in another process group, which the
  # step's limit does not reach, and benchmarks spawn worker processes; everything left in the session is ended
  # before the next step takes the GPU.
  setsid timeout -k 5 "$secs" "${cmd[@]}" >>"$log" 2>&1 &
  sid=$!
  wait "$sid" || { echo "== $name: exit $?" | tee -a "$log"; status=1; }
  pkill -9 -s "$sid" 2>/dev/null
  pack
done
echo "== done at ${SECONDS}s" | tee -a "$log"
exit $status
