python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 && export PYTHONPATH=/tmp/site:. || exit 1
export PYTHONUNBUFFERED=1
timeout 120 python -m pytest -q --tb=line tests/test_rope.py -m kernels -p no:cacheprovider 2>&1 | grep -E "passed|failed|Error|error" | tail -5
timeout 380 python -m pytest -q --tb=line tests/test_ops_registry.py -k "rope or qk" -p no:cacheprovider 2>&1 | grep -E "passed|failed|FAILED|Error" | grep -v DEBUG | tail -12
