python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 && export PYTHONPATH=/tmp/site:. || exit 1
export PYTHONUNBUFFERED=1
timeout 200 python -m pytest -q -x --tb=short tests/test_rope.py -m kernels -p no:cacheprovider 2>&1 | grep -v DEBUG | tail -8
timeout 360 python bench/sweep_rope.py $OUT/sweep_rope.json 2>&1 | tail -100
