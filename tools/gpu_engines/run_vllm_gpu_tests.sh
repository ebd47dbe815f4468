#!/bin/bash
# Real vLLM on a CUDA GPU with lmcache, on a machine without network (see README.md here).
#   tools/gpu_engines/run_vllm_gpu_tests.sh BUNDLE_DIR
# Unpacks BUNDLE_DIR/*.tar.xz (from build_bundle.sh vllm) into /tmp/lmcache-vllm-site, installs
# lmcache-core and lmcache-vllm from this checkout (editable, no network), and runs the CUDA tests:
# the connectors' GPU unit tests and real vLLM store -> reset -> hit (V1 and V2 model runners,
# batched and layerwise), then the save/load overlap benchmark.
set -euo pipefail
BUNDLE=$(realpath "${1:?usage: $0 BUNDLE_DIR}")
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SITE=/tmp/lmcache-vllm-site
python3 -c "import glob, sys, tarfile; [tarfile.open(f).extractall(sys.argv[1]) for f in sorted(glob.glob(sys.argv[2] + '/*.tar.xz'))]" "$SITE" "$BUNDLE"
export PYTHONPATH=$SITE VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1
cd "$ROOT"
python3 -m pip install -q --no-build-isolation --no-deps -e packages/lmcache-core -e packages/lmcache-vllm
python3 -m pytest -m gpu -q -rs packages/lmcache-core/tests packages/lmcache-vllm/tests/unit packages/lmcache-vllm/tests/gpu
python3 benchmarks/vllm_save_overlap.py
