#!/usr/bin/env bash
# The whole test suite, on any machine; the README's test command and CI's.
#
# Without a GPU: five pytest processes, two at a time on the two cores. The
# reference path and fake-CUDA tracing run in one; the real Triton kernels
# under triton's interpreter in another (TRITON_INTERPRET must be set before
# triton is imported); the sm_90 compile files and the files that spawn ranks
# in three more. Hypothesis uses the "ci" profile (bounded, derandomized: the
# same examples every run).
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
  # Five pytest processes, two at a time (one per core; each is single-threaded
  # but for torch's own ops, and they share nothing but the compile caches,
  # which are safe for concurrent writers). Each core takes the next process
  # of the list when its last one ends, so the run takes about half the sum.
  # The list starts with the longest on a fresh machine: there the sm_90 files
  # compile every kernel variant, while a warm Triton cache makes them short
  # and the core that runs them takes the rest of the list.
  echo "CPU run: Hypothesis profile $HYPOTHESIS_PROFILE, five processes on two cores"
  logs=$(mktemp -d)
  late=(tests/test_sm90_compile.py tests/test_sm90_compile_gluon.py tests/test_distributed_train.py
    tests/test_context_parallel.py tests/test_context_parallel_ring.py)
  ignored=()
  for file in "${late[@]}"; do ignored+=(--ignore="$file"); done
  names=("cpu: reference path + fake-CUDA tracing" "cpu: Triton interpreter" "cpu: sm_90 compile"
    "cpu: sm_90 compile, the Gluon cores" "cpu: reference path, the rank-spawning files")
  cpu_process() {  # cpu_process INDEX PYTEST_ARGS...: the INDEX-th process of names
    local index=$1
    shift
    case $index in
      0) "$PY" -m pytest tests "${ignored[@]}" -m "not kernels" --durations=15 "$@" ;;
      # One thread: the interpreter's numpy work gains nothing from a second,
      # which the other process's torch ops use. The package's torch.empty & co.
      # come filled with NaN / 0x7F bytes (tests/poison.py): a kernel that reads
      # an element nobody wrote fails here, not only on a GPU whose allocator
      # handed it another test's NaNs (COMPILE_OPS_POISON_EMPTY=0 turns it off).
      1) env TRITON_INTERPRET=1 OMP_NUM_THREADS=1 COMPILE_OPS_POISON_EMPTY="${COMPILE_OPS_POISON_EMPTY:-1}" \
        "$PY" -m pytest tests -m kernels --durations=15 "$@" ;;
      2) "$PY" -m pytest "${late[0]}" -m "not kernels" --durations=15 "$@" ;;
      3) "$PY" -m pytest "${late[1]}" -m "not kernels" --durations=15 "$@" ;;
      4) "$PY" -m pytest "${late[@]:2}" -m "not kernels" --durations=15 "$@" ;;
    esac
  }
  echo 0 > "$logs/next"
  core() {  # core ARGS...: take the next process of names until none is left
    local i start
    while i=$(flock "$logs/next" bash -c 'read -r i < "$0" && echo $((i + 1)) > "$0" && echo "$i"' "$logs/next") &&
      [ "$i" -lt ${#names[@]} ]; do
      start=$SECONDS
      cpu_process "$i" "$@" > "$logs/$i" 2>&1
      echo "$? $((SECONDS - start))" > "$logs/$i.rc"
    done
  }
  core "$@" &
  core "$@" &
  wait
  for i in "${!names[@]}"; do
    echo "=== layer: ${names[$i]}"
    cat "$logs/$i"
    read -r rc seconds < "$logs/$i.rc"
    record "${names[$i]}" "$rc" "$seconds"
  done
  rm -r "$logs"
fi

if [ ${#failed[@]} -ne 0 ]; then
  echo "FAILED layers:"
  printf '  %s\n' "${failed[@]}"
  exit 1
fi
echo "all layers passed"
