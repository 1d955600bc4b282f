python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 && export PYTHONPATH=/tmp/site:. || exit 1
export PYTHONUNBUFFERED=1
timeout 260 python -m pytest -q --tb=line tests/test_ops_registry.py -k "rope or qk" -p no:cacheprovider 2>&1 | grep -v DEBUG | tail -12
timeout 320 python bench/run.py --ops rope,rope_qk,rope_grid,qk_norm_rope --out $OUT 2>&1 | grep -v "^\[" | grep -v "^ *$" | tail -12
