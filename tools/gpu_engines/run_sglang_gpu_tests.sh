#!/bin/bash
# Real SGLang 0.5.17 on a CUDA GPU with lmcache, on a machine without network (see README.md here).
#   tools/gpu_engines/run_sglang_gpu_tests.sh BUNDLE_DIR [PYTEST_ARGS...]
# Unpacks BUNDLE_DIR/*.tar.xz (from build_bundle.sh sglang) into /tmp/lmcache-sglang-site,
# installs lmcache-core and lmcache-sglang from this checkout (editable, no network), and runs the
# CUDA tests: the sglang.cuda connector's conformance suite and real SGLang store -> flush_cache()
# -> hit through --enable-lmcache and the HiCache storage backend (one engine at a time).
# PYTEST_ARGS replace the default test paths. Engine logs and summary.jsonl go to
# $LMC_GPU_LOG_DIR (default: pytest's temporary folder).
set -euo pipefail
BUNDLE=$(realpath "${1:?usage: $0 BUNDLE_DIR [PYTEST_ARGS...]}"); shift
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SITE=/tmp/lmcache-sglang-site
python3 -c "import glob, sys, tarfile; [tarfile.open(f).extractall(sys.argv[1]) for f in sorted(glob.glob(sys.argv[2] + '/*.tar.xz'))]" "$SITE" "$BUNDLE"
export PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
cd "$ROOT"
python3 -m pip install -q --no-build-isolation --no-deps -e packages/lmcache-core -e packages/lmcache-sglang
[ $# -gt 0 ] || set -- packages/lmcache-sglang/tests/unit packages/lmcache-sglang/tests/gpu
python3 -m pytest -m gpu -q -rs -p no:cacheprovider "$@"
