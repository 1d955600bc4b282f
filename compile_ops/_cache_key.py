"""compile_ops' sources in torch.compile's cache keys.

Why: torch.compile's caches (AOTAutograd's and Inductor's FX graph cache,
on disk under ``TORCHINDUCTOR_CACHE_DIR``) key a graph by the graph Dynamo
captured, where a ``fused`` op is a call by name. A compiled artifact holds
what the op's body traced to (its kernels and launches, or its reference
path off the GPU), so after compile_ops changes, a warm cache would run the
old body: a silent wrong result. :func:`register` adds a fingerprint of the
package's sources to ``torch.compiler.config.cache_key_tag``, which every
one of those keys includes, so a changed compile_ops compiles afresh.
"""

import hashlib
import os

import torch

_PACKAGE = os.path.dirname(os.path.abspath(__file__))
_PREFIX = "compile_ops:"


def source_fingerprint(package: str = _PACKAGE) -> str:
    """16 hex digits of a SHA-256 over every ``.py`` file under ``package``
    (a directory): each file's path relative to it and its bytes, in sorted
    order."""
    digest = hashlib.sha256()
    for root, dirs, files in os.walk(package):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(root, name)
            digest.update(os.path.relpath(path, package).replace(os.sep, "/").encode())
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()[:16]


def tagged(tag: str, fingerprint: str) -> str:
    """``tag`` (a user's ``cache_key_tag``) with ``compile_ops:<fingerprint>``
    in place of any earlier compile_ops part, joined by ``|``."""
    parts = [p for p in tag.split("|") if p and not p.startswith(_PREFIX)]
    return "|".join(parts + [_PREFIX + fingerprint])


def register() -> None:
    """Put this package's fingerprint in ``torch.compiler.config.cache_key_tag``,
    keeping the rest of the tag (``TORCH_COMPILE_CACHE_KEY_TAG`` or a value set
    before the import). A tag set after the import replaces it."""
    config = torch.compiler.config
    config.cache_key_tag = tagged(config.cache_key_tag, source_fingerprint())
