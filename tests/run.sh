#!/usr/bin/env bash
# The whole test suite, on any machine; the README's test command and CI's.
#
# Without a GPU: two pytest processes, side by side on the two cores. The
# reference path and fake-CUDA tracing run in the first; the real Triton
# kernels under triton's interpreter in the second (TRITON_INTERPRET must be
# set before triton is imported). Hypothesis uses the "ci" profile (bounded,
# derandomized: the same examples every run).
#
# With a GPU: every layer on CUDA in one pytest process, Hypothesis on the
# "gpu" profile (bounded examples, a random seed printed at the start so a
# failure can be replayed with HYPOTHESIS_SEED=<seed>), with the Triton and
# Inductor caches in .cache/ (or $TRITON_CACHE_DIR / $TORCHINDUCTOR_CACHE_DIR)
# so that a second run, or a machine the folder is carried to, compiles
# nothing again. The log goes to $TEST_LOG (default .cache/gpu-tests.log).
# Where pytest-xdist is installed, $TEST_WORKERS processes (default 8) share
# the GPU: a cold run's time is Triton compiling kernel variants on the CPU,
# which one process does on one core.
#
# Every layer runs even when an earlier one fails; the exit status is non-zero
# if any failed, and the failed layers are named at the end.
# Extra arguments go to every pytest call (e.g. -k attention, -x).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}  # the GPU machines have python3 only

failed=()
record() {  # record NAME RC SECONDS: a layer's end, and a failure remembered
  echo "=== layer: $1: exit $2 after $3 s"
  # 5: pytest collected nothing, which a -k/-m filter does to a layer on purpose.
  [ "$2" -eq 0 ] || [ "$2" -eq 5 ] || failed+=("$1 (exit $2)")
}
run_layer() {  # run_layer NAME COMMAND...: run one layer
  local name=$1
  shift
  echo "=== layer: $name"
  local start=$SECONDS
  "$@"
  record "$name" $? $((SECONDS - start))
}

if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-gpu}
  export HYPOTHESIS_SEED=${HYPOTHESIS_SEED:-$("$PY" -c "import random; print(random.randrange(2**31))")}
  export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.cache/triton}
  export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$PWD/.cache/inductor}
  TEST_LOG=${TEST_LOG:-$PWD/.cache/gpu-tests.log}
  mkdir -p "$TRITON_CACHE_DIR" "$TORCHINDUCTOR_CACHE_DIR" "$(dirname "$TEST_LOG")"
  echo "GPU run: Hypothesis profile $HYPOTHESIS_PROFILE, seed $HYPOTHESIS_SEED (replay: HYPOTHESIS_SEED=$HYPOTHESIS_SEED)"
  echo "Triton cache $TRITON_CACHE_DIR ($(find "$TRITON_CACHE_DIR" -type f | wc -l) files), log $TEST_LOG"
  logged_pytest() {  # pytest's own exit status, not tee's
    "$PY" -m pytest "$@" 2>&1 | tee "$TEST_LOG"
    return "${PIPESTATUS[0]}"
  }
  workers=()
  if "$PY" -c "import xdist" 2>/dev/null && [ "${TEST_WORKERS:-8}" -gt 1 ]; then workers=(-n "${TEST_WORKERS:-8}"); fi
  # Work stealing (xdist 3.2+): xdist's default hands each worker its share of the tests up front, and a cold
  # H100 run on 2026-11-27 ended with one worker still holding seven queued max-autotune compile tests while the
  # other fifteen sat idle, cut by its time limit at 99%. Stealing lets idle workers take queued tests.
  if [ ${#workers[@]} -gt 0 ] && "$PY" -c "
import sys, xdist
sys.exit(0 if tuple(int(x) for x in xdist.__version__.split('.')[:2]) >= (3, 2) else 1)" 2>/dev/null; then
    workers+=(--dist worksteal)
  fi
  run_layer "cuda: every layer" logged_pytest tests "${workers[@]}" --hypothesis-seed="$HYPOTHESIS_SEED" --durations=30 "$@"
else
  export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci}
  # The two layers run side by side, one pytest process per core (each is
  # single-threaded but for torch's own ops, and they share nothing but the
  # compile caches, which are safe for concurrent writers): the run takes
  # the longer core's time, not the sum. The reference layer is the longer,
  # so its files that spawn ranks or compile PTX for sm_90 run on the
  # interpreter's core once that layer ends, and the two cores end together.
  # Their logs follow when all end.
  echo "CPU run: Hypothesis profile $HYPOTHESIS_PROFILE, the two layers side by side"
  logs=$(mktemp -d)
  timed() {  # timed LOG COMMAND...: a layer, its exit status and seconds in LOG.rc
    local log=$1
    shift
    start=$SECONDS
    "$@" > "$log" 2>&1
    echo "$? $((SECONDS - start))" > "$log.rc"
  }
  late=(tests/test_sm90_compile.py tests/test_sm90_compile_gluon.py tests/test_distributed_train.py
    tests/test_context_parallel.py tests/test_context_parallel_ring.py)
  ignored=()
  for file in "${late[@]}"; do ignored+=(--ignore="$file"); done
  timed "$logs/reference" "$PY" -m pytest tests "${ignored[@]}" -m "not kernels" --durations=15 "$@" &
  # One thread: the interpreter's numpy work gains nothing from a second,
  # which the other layer's torch ops use. The package's torch.empty & co.
  # come filled with NaN / 0x7F bytes (tests/poison.py): a kernel that reads
  # an element nobody wrote fails here, not only on a GPU whose allocator
  # handed it another test's NaNs (COMPILE_OPS_POISON_EMPTY=0 turns it off).
  (
    timed "$logs/interpreter" env TRITON_INTERPRET=1 OMP_NUM_THREADS=1 \
      COMPILE_OPS_POISON_EMPTY="${COMPILE_OPS_POISON_EMPTY:-1}" "$PY" -m pytest tests -m kernels --durations=15 "$@"
    timed "$logs/late" "$PY" -m pytest "${late[@]}" -m "not kernels" --durations=15 "$@"
  ) &
  wait
  for layer in "reference:cpu: reference path + fake-CUDA tracing" "interpreter:cpu: Triton interpreter" \
    "late:cpu: reference path, the rank-spawning and sm_90 compile files"; do
    log=$logs/${layer%%:*}
    echo "=== layer: ${layer#*:}"
    cat "$log"
    read -r rc seconds < "$log.rc"
    record "${layer#*:}" "$rc" "$seconds"
  done
  rm -r "$logs"
fi

if [ ${#failed[@]} -ne 0 ]; then
  echo "FAILED layers:"
  printf '  %s\n' "${failed[@]}"
  exit 1
fi
echo "all layers passed"
