#!/usr/bin/env bash
# The checks that need a machine with a CUDA GPU, in one run of at most 10 minutes (the
# steps' limits and their kill delays; on an H200 machine, 2026-11-27, the steps took 47, 178, 109
# and 51 s, before bench_trainer_gpu also ran the one-process tables):
#
#     bash scripts/gpu_checks.sh OUTDIR
#
# 0. the host: python, torch, cores, the kernel's clock source and what a read of each clock costs
#    (the Trainer reads perf_counter six times a step; a clock source without a fast user-space
#    read makes each a system call, which weighs on the guard's 0.3-0.7 ms one-process step);
# 1. tests/test_cuda.py (NCCL, AMP, FSDP2 on the GPU, sharded checkpoints);
# 2. benchmarks/bench_trainer_guard.py, issue 29's three ratios on CPU ranks (gloo), which need
#    idle cores that the two ranks do not share: a GPU machine's many cores, with CUDA hidden;
# 3. benchmarks/bench_trainer_gpu.py --quick, one process, DDP and FSDP in fp32 and bf16;
# 4. benchmarks/bench_fsdp_memory.py (gloo, CUDA hidden).
#
# It runs from the repository with the machine's own python and torch (PYTHON, default python3),
# distkit taken from src/ (PYTHONPATH), so nothing is installed. Each step has a time limit and
# writes OUTDIR/<step>.txt as it goes (a step cut off by its limit keeps what it printed); the
# summary at the end gives each step's exit status and seconds. A failing step does not stop the
# others: the exit status is 1 when any step failed.
set -uo pipefail
out=${1:?usage: bash scripts/gpu_checks.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
export PYTHONPATH=src:tests${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
# distkit's pytest plugin (the `ranks` fixture) is registered by its entry point once distkit is
# installed; from src/ it must be named. Its entry point has the module's name, so naming it again
# is a no-op; an install older than that named it `distkit`, and then naming it is an error.
plugin=(-p distkit.testing.plugin)
if "$py" -c "import sys
from importlib.metadata import entry_points
sys.exit(0 if any(e.name == 'distkit' for e in entry_points(group='pytest11')) else 1)"; then
  plugin=()
fi

summary=()
failed=0
step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2 began code
  shift 2
  echo "== $name (limit ${limit} s): $*"
  began=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$out/$name.txt" 2>&1
  code=$?
  tail -n 30 "$out/$name.txt"
  summary+=("$(printf '%-20s exit %3d   %4d s' "$name" "$code" $((SECONDS - began)))")
  [ "$code" -eq 0 ] || failed=1
}

step host 10 "$py" -c "
import os, sys, time, timeit, torch
source = '/sys/devices/system/clocksource/clocksource0/current_clocksource'
print('python', sys.version.split()[0], 'torch', torch.__version__, 'cores', os.cpu_count())
print('clock source', open(source).read().strip() if os.path.exists(source) else 'unknown')
for name in ('perf_counter', 'process_time', 'thread_time'):
    best = min(timeit.repeat(getattr(time, name), number=20_000, repeat=5))
    print(f'time.{name}(): {best * 50:.3f} us a call')
"
step test_cuda 80 "$py" -m pytest -q -p no:cacheprovider "${plugin[@]}" tests/test_cuda.py
step guard 210 env CUDA_VISIBLE_DEVICES= "$py" benchmarks/bench_trainer_guard.py --rounds 7
step bench_trainer_gpu 170 "$py" benchmarks/bench_trainer_gpu.py --quick --strategy single ddp fsdp
step bench_fsdp_memory 80 env CUDA_VISIBLE_DEVICES= "$py" benchmarks/bench_fsdp_memory.py --blocks 3

echo "== summary (outputs in $out)"
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
exit "$failed"
