python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 && export PYTHONPATH=/tmp/site:. || exit 1
export PYTHONUNBUFFERED=1
timeout 200 python -m pytest -q --tb=line tests/test_ops_registry.py tests/test_rope.py -k "qk_norm_rope" -p no:cacheprovider 2>&1 | grep -v DEBUG | tail -6
timeout 200 python bench/run.py --ops qk_norm_rope --out bench/results --merge 2>&1 | grep -v "^\[" | grep -v "^ *$" | tail -5
cp bench/results/h100.json bench/results/h100.png $OUT/
