#!/usr/bin/env bash
# One-time set-up on a fresh machine. On CPU machines torch 2.13.0 (CPU build) is installed
# first from the local wheel, so the unpinned 'torch' dependency never pulls a CUDA build;
# where torch is already installed (the GPU image's 2.11) it is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import torch" 2>/dev/null; then
  python3 -m pip install -q "torch==2.13.0"
fi
python3 -m pip install -q -e ".[test]"
