#!/usr/bin/env bash
# One GPU session's checks in one command: the whole GPU test suite (cold,
# xdist workers), then the FP8 end-to-end comparison with torchao on Flux in
# the time left. Logs and results go to $1 (default $OUT, the device tool's
# folder, else .cache/gpu-check).
#
#   bash bench/gpu_check.sh [OUT_DIR]
#
# Needs diffusers and torchao importable (on the lent machines: carried wheels
# installed to a --target folder on PYTHONPATH); carry .whl/ for expecttest.
# Environment: TEST_WORKERS (default 16), SUITE_LIMIT (seconds for the suite,
# default 420: a cold H200 took 402 s on 2026-11-27), TOTAL_LIMIT
# (seconds for everything, default 585: a device call's 10 minutes), E2E_ARGS
# (diffusers_e2e.py's arguments).
set -u
cd "$(dirname "$0")/.."
out=${1:-${OUT:-.cache/gpu-check}}
mkdir -p "$out/results"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
# The lent machines have no package index and no expecttest (test_norm.py and
# test_modulate.py import it): a wheel carried in .whl/ is installed aside.
if ! python3 -c "import expecttest" 2>/dev/null && ls .whl/expecttest-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/compile-ops-site .whl/expecttest-*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/compile-ops-site
fi
start=$SECONDS
TEST_WORKERS=${TEST_WORKERS:-16} TEST_LOG=$out/gpu-tests.log timeout "${SUITE_LIMIT:-420}" bash tests/run.sh \
  > "$out/run-tests.out" 2>&1
echo "GPU suite: exit $? after $((SECONDS - start)) s"
grep -E "passed|failed|^FAILED|seed" "$out/run-tests.out" | tail -15
left=$((${TOTAL_LIMIT:-585} - SECONDS))
if [ "$left" -gt 60 ]; then
  # shellcheck disable=SC2086  # E2E_ARGS is a list of arguments
  timeout "$left" python3 bench/diffusers_e2e.py --out "$out/results" ${E2E_ARGS:---cases flux_step --fp8 \
    --repeats 3 --compile regional --replay --rep-ms 1500 --providers native_compiled,fp8_compiled,torchao_fp8_compiled}
fi
