#!/usr/bin/env bash
# The GPU checks in one command: the whole GPU test suite (cold, xdist
# workers), then the FP8 end-to-end comparison with torchao on Flux in the
# time left. Logs and results go to $1 (default $OUT, the device tool's
# folder, else .cache/gpu-check).
#
#   bash bench/tools/gpu_check.sh [OUT_DIR]
#
# Needs diffusers and torchao importable (on the lent machines: carried wheels
# installed to a --target folder on PYTHONPATH); carry .whl/ for expecttest.
# Environment: TEST_WORKERS (default 16), SUITE_LIMIT (seconds for the suite,
# default 560: a device call's 10 minutes less the set-up), TOTAL_LIMIT
# (seconds for everything, default 585: a device call's 10 minutes), E2E_ARGS
# (bench/runners/diffusers_e2e.py's arguments), SUITE_PART: "attention" (the
# attention, block-sparse, sparse and sm_90 compile files) or "rest" (the
# others) for a suite split over two calls (a cold machine may not finish the
# whole suite in one), unset for all of it.
# The log names every test as it finishes (-vv), so a suite cut short by its
# limit still says which tests failed; they are listed at the end.
set -u
cd "$(dirname "$0")/../.."
out=${1:-${OUT:-.cache/gpu-check}}
mkdir -p "$out/results"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
# The lent machines have no package index and no expecttest (test_norm.py and
# test_modulate.py import it): a wheel carried in .whl/ is installed aside.
if ! python3 -c "import expecttest" 2>/dev/null && ls .whl/expecttest-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/compile-ops-site .whl/expecttest-*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/compile-ops-site
fi
attention_files=(test_attention.py test_attention_backward.py test_attention_8bit.py test_attention_launch.py
  test_attention_sm90.py test_block_sparse.py test_sparse_attention.py test_sm90_compile.py test_sm90_compile_gluon.py)
part=()
for f in "${attention_files[@]}"; do
  case ${SUITE_PART:-} in
    attention) ;;
    rest) part+=("--ignore=tests/$f") ;;
    "") ;;
    *) echo "SUITE_PART must be attention, rest or unset, got $SUITE_PART" >&2; exit 2 ;;
  esac
done
if [ "${SUITE_PART:-}" = attention ]; then
  for f in tests/test_*.py; do
    case " ${attention_files[*]} " in *" $(basename "$f") "*) ;; *) part+=("--ignore=$f") ;; esac
  done
fi
start=$SECONDS
TEST_WORKERS=${TEST_WORKERS:-16} TEST_LOG=$out/gpu-tests.log timeout "${SUITE_LIMIT:-560}" bash tests/run.sh -vv \
  "${part[@]}" > "$out/run-tests.out" 2>&1
echo "GPU suite${SUITE_PART:+ ($SUITE_PART)}: exit $? after $((SECONDS - start)) s"
grep -E "passed|failed|seed" "$out/run-tests.out" | grep -v "PASSED\|FAILED" | tail -5
echo "$(grep -c " PASSED " "$out/gpu-tests.log") passed, failed or errors so far:"
grep -E " (FAILED|ERROR) " "$out/gpu-tests.log" | sed 's/^\[gw[0-9]*\] \[ *[0-9]*%\] //' | sort -u | head -30
left=$((${TOTAL_LIMIT:-585} - SECONDS))
if [ "$left" -gt 60 ]; then
  # shellcheck disable=SC2086  # E2E_ARGS is a list of arguments
  timeout "$left" python3 bench/runners/diffusers_e2e.py --out "$out/results" ${E2E_ARGS:---cases flux_step --fp8 \
    --repeats 3 --compile regional --replay --rep-ms 1500 --providers native_compiled,fp8_compiled,torchao_fp8_compiled}
fi
