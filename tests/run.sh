#!/usr/bin/env bash
# The whole test suite, on any machine. With a GPU every layer runs on CUDA in
# one pytest process. Without one: the reference path and fake-CUDA tracing in
# one process, then the real Triton kernels under triton's interpreter in a
# second (TRITON_INTERPRET must be set before triton is imported).
set -euo pipefail
cd "$(dirname "$0")/.."
if python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  python -m pytest tests "$@"
else
  python -m pytest tests -m "not kernels" "$@"
  TRITON_INTERPRET=1 python -m pytest tests -m kernels "$@"
fi
