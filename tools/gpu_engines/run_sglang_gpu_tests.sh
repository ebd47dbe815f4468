#!/bin/bash
# Real SGLang on a CUDA GPU with lmcache, on a machine without network: `nox -s gpu` over one bundle.
#   tools/gpu_engines/run_sglang_gpu_tests.sh BUNDLE_DIR [PYTEST_ARGS...]
# BUNDLE_DIR is what `build_bundle.sh sglang BUNDLE_DIR` wrote (plus `build_bundle.sh nox BUNDLE_DIR`
# when nox is not installed). PYTEST_ARGS go to every pytest run. See README.md here.
set -euo pipefail
BUNDLE=$(realpath "${1:?usage: $0 BUNDLE_DIR [PYTEST_ARGS...]}"); shift
cd "$(dirname "$0")/../.."
python3 -m nox --version >/dev/null 2>&1 ||
  python3 -m pip install -q --no-index --find-links "$BUNDLE/nox-wheels" nox
LMC_GPU_BUNDLES=$BUNDLE exec python3 -m nox -s gpu -- "$@"
