python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 && export PYTHONPATH=/tmp/site:. || exit 1
export PYTHONUNBUFFERED=1
for i in 1 2; do timeout 100 python -m pytest -q --tb=line tests/test_rope.py -m kernels -k "qk_norm" -p no:cacheprovider 2>&1 | grep -v DEBUG | tail -3; done
timeout 200 python bench/run.py --ops qk_norm_rope --out bench/results --merge 2>&1 | grep -v "^\[" | grep -v "^ *$" | grep qk_norm | tail -14
cp bench/results/h100.json bench/results/h100.png $OUT/
timeout 150 python bench/sweep_rope.py $OUT/sweep_qk.json rope_qk 2048/4/4,1024/4/4,1024/8/4,2048/2/4 2>&1 | tail -16
