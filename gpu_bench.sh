python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 && export PYTHONPATH=/tmp/site:. || exit 1
export PYTHONUNBUFFERED=1
timeout 560 python bench/run.py --ops "$1" --out $OUT 2>&1 | grep -v "^\[" | tail -60
