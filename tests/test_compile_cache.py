"""torch.compile's on-disk caches and compile_ops' own sources.

AOTAutograd's and Inductor's caches key a graph by what Dynamo captured,
where a ``fused`` op is a call by name; the compiled artifact holds what the
op's body traced to. ``compile_ops._cache_key`` puts a fingerprint of the
package's sources in ``torch.compiler.config.cache_key_tag``, so that a
changed compile_ops compiles afresh instead of running the old bodies.
"""

import os
import shutil
import subprocess
import sys

import torch

import compile_ops  # noqa: F401  (importing it sets the tag)
from compile_ops import _cache_key

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: One compiled call of a fused op in a fresh process: prints the largest difference to
#: the same call run eagerly, and AOTAutograd's cache hits.
PROBE = """
import torch
import compile_ops
from torch._dynamo.utils import counters

def f(x, w):
    return compile_ops.rmsnorm(x, w, 1e-6) * 2

x, w = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)), torch.ones(64)
got = torch.compile(f, fullgraph=True)(x, w)
print(float((got - f(x, w)).abs().max()), counters["aot_autograd"]["autograd_cache_hit"], compile_ops.__file__)
"""


def _probe(package_root, cache_dir):
    """``(difference to eager, AOTAutograd cache hits)`` of :data:`PROBE` run with
    compile_ops imported from ``package_root`` and Inductor's caches in ``cache_dir``."""
    env = {k: v for k, v in os.environ.items() if k != "TORCH_COMPILE_CACHE_KEY_TAG"}
    env.update(PYTHONPATH=str(package_root), TORCHINDUCTOR_CACHE_DIR=str(cache_dir), CUDA_VISIBLE_DEVICES="")
    env.pop("TRITON_INTERPRET", None)
    # cwd: ``python -c`` puts it first on sys.path, before PYTHONPATH.
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, cwd=cache_dir.parent, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    difference, hits, origin = done.stdout.split()[-3:]
    assert origin == os.path.join(str(package_root), "compile_ops", "__init__.py"), origin
    return float(difference), int(hits)


def test_a_changed_op_body_compiles_afresh_from_a_warm_cache(tmp_path):
    """Two installs of compile_ops that differ in one op's body (the second's
    reference ``rmsnorm``, the op's path off the GPU, scaled by 3) compile the
    same function one after the other with one Inductor cache directory. The
    first install a second time hits AOTAutograd's cache (so the cache is
    warm and shared); the changed install misses it and gets its own op's
    result. Without the sources in the key it hit and ran the first install's
    graph: a third of its eager result."""
    changed = tmp_path / "changed"
    shutil.copytree(
        os.path.join(ROOT, "compile_ops"), changed / "compile_ops", ignore=shutil.ignore_patterns("__pycache__")
    )
    norm = changed / "compile_ops" / "reference" / "norm.py"
    before = "xhat = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)"
    assert before in norm.read_text()
    norm.write_text(
        norm.read_text().replace(before, "xhat = 3 * xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)")
    )
    cache = tmp_path / "inductor-cache"
    # (Inductor's fused compiled graph rounds differently from eager in the last bits; stale is ~1 off.)
    runs = [_probe(ROOT, cache), _probe(ROOT, cache), _probe(changed, cache)]
    assert [hits for _, hits in runs] == [0, 1, 0], runs
    assert max(difference for difference, _ in runs) < 1e-5, runs


def test_the_fingerprint_follows_the_sources_and_keeps_a_users_tag(tmp_path):
    """The tag after import holds this package's fingerprint; the fingerprint
    changes with a file's bytes or its name; a user's tag is kept, and a
    repeated registration replaces compile_ops' part instead of adding one."""
    assert torch.compiler.config.cache_key_tag.endswith("compile_ops:" + _cache_key.source_fingerprint())
    package = tmp_path / "package"
    (package / "sub").mkdir(parents=True)
    (package / "a.py").write_text("x = 1\n")
    (package / "sub" / "b.py").write_text("y = 2\n")
    first = _cache_key.source_fingerprint(str(package))
    (package / "sub" / "b.py").write_text("y = 3\n")
    second = _cache_key.source_fingerprint(str(package))
    (package / "sub" / "b.py").rename(package / "sub" / "c.py")
    third = _cache_key.source_fingerprint(str(package))
    (package / "notes.txt").write_text("not source")
    assert len({first, second, third}) == 3 and _cache_key.source_fingerprint(str(package)) == third
    assert _cache_key.tagged("", first) == f"compile_ops:{first}"
    assert _cache_key.tagged(f"mine|compile_ops:{first}", second) == f"mine|compile_ops:{second}"
