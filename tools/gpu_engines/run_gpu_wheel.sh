#!/bin/bash
# What a user without a compiler gets, on a GPU machine, from the repository root:
#   tools/gpu_engines/run_gpu_wheel.sh tests   # the wheels from dist/, compiler hidden, nox -s gpu
#   tools/gpu_engines/run_gpu_wheel.sh unit    # only the GPU unit tests (pytest -m gpu, core + vLLM)
#   tools/gpu_engines/run_gpu_wheel.sh vllm K  # only the real-vLLM GPU tests selected by pytest -k K
#   tools/gpu_engines/run_gpu_wheel.sh bench   # benchmarks/vllm_gpu_kernels.py: wheel / JIT / no binary
# `nox -s build` (on any machine) makes dist/; .eng holds the vLLM bundle and nox's wheels
# (README.md here). The compiler is hidden from everything but the benchmark's JIT row:
# CUDA_HOME and CUDA_PATH are unset and every PATH entry holding nvcc is dropped. Each stage
# checks that the wheel's kernels load (python -m lmcache.gpu_ops --require); the test stages
# also that nothing was compiled (no JIT build folder in ~/.cache/lmcache afterwards).
# Logs: $LMC_GPU_LOGS, else $OUT, else /tmp/lmcache-gpu-run. Limits: LMC_TESTS_S, LMC_BENCH_S.
set -uo pipefail
STAGE=${1:-tests}
cd "$(dirname "$0")/../.."
LOGS=${LMC_GPU_LOGS:-${OUT:-/tmp/lmcache-gpu-run}}; mkdir -p "$LOGS"
CUDA_ROOT=${CUDA_HOME:-/usr/local/cuda}
unset CUDA_HOME CUDA_PATH
PATH=$(echo "$PATH" | tr ':' '\n' | while read -r d; do [ -x "$d/nvcc" ] || echo "$d"; done | paste -sd:)
export PATH
if command -v nvcc >/dev/null; then echo "nvcc still on PATH: $(command -v nvcc)"; exit 1; fi
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/lmcache
python3 -m pip install -q --no-index --no-deps --force-reinstall \
  dist/lmcache_core-*manylinux*.whl dist/lmcache_vllm-*.whl dist/lmcache_sglang-*.whl || exit 1
python3 -m nox --version >/dev/null 2>&1 ||
  python3 -m pip install -q --no-index --find-links .eng/nox-wheels nox || exit 1
python3 -m lmcache.gpu_ops --require 2>&1 | tee "$LOGS/gpu_ops-$STAGE.txt" || exit 1
unpack_vllm() {
  python3 -c "import sys; sys.path.insert(0, 'tools/gpu_engines'); from bundles import *
for e, p in gpu_bundles().items(): unpack_bundle(e, p)" >/dev/null
}
VLLM_ENV=(PYTHONPATH=/tmp/lmcache-vllm-site HF_HUB_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
  VLLM_USE_FLASHINFER_SAMPLER=0)

if [ "$STAGE" = bench ]; then
  unpack_vllm
  timeout -k 10 "${LMC_BENCH_S:-540}" env "${VLLM_ENV[@]}" python3 benchmarks/vllm_gpu_kernels.py \
    --cuda-home "$CUDA_ROOT" "${@:2}" 2>&1 | tee "$LOGS/vllm_gpu_kernels.log" | grep -E '^(row |=== |[a-z]+ +[0-9]|.*: [0-9.]+x|.*against)'
  exit $?
fi
rm -rf "$CACHE"/kernels-*
PYTEST=(python3 -m pytest -q -rs -p no:cacheprovider)
case $STAGE in
  tests) cmd=(python3 -m nox -s gpu) ;;
  unit) cmd=("${PYTEST[@]}" -m gpu packages/lmcache-core/tests packages/lmcache-vllm/tests/unit) ;;
  vllm) unpack_vllm
        cmd=(env "${VLLM_ENV[@]}" "${PYTEST[@]}" -m gpu packages/lmcache-vllm/tests/gpu -k "$2") ;;
  *) echo "unknown stage $STAGE"; exit 2 ;;
esac
timeout -k 10 "${LMC_TESTS_S:-540}" "${cmd[@]}" >"$LOGS/$STAGE.log" 2>&1; rc=$?
echo "== $STAGE: exit $rc (log $LOGS/$STAGE.log)"
grep -E "^(FAILED|ERROR|SKIPPED)|[0-9]+ (passed|failed)|nox > (Session|.*no bundle)" \
  "$LOGS/$STAGE.log" | tail -n 30
built=$(ls -d "$CACHE"/kernels-* 2>/dev/null)
if [ -n "$built" ]; then echo "compiled during the tests: $built"; rc=1; else echo "nothing compiled"; fi
exit $rc
