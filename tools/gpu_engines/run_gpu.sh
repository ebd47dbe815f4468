#!/bin/bash
# Everything the GPU machine checks, in one command from the repository root (README.md here):
#   tools/gpu_engines/run_gpu.sh [--quick]
# Installs nox from the carried wheels ($LMCACHE_NOX_WHEELS, default .eng/nox-wheels) and our
# packages (editable, --no-deps, no network), runs `nox -s gpu` (GPU unit tests; real vLLM and
# SGLang from the bundles in .eng / .eng-sgl), then benchmarks/gpu_transfer.py and
# benchmarks/vllm_gpu.py, and prints the test summary and both tables last. Full logs go to
# $LMC_GPU_LOGS (default: $OUT when set, else /tmp/lmcache-gpu-run). --quick: fewer repetitions
# and the 8-layer model in the benchmarks (the tests are the same).
set -uo pipefail
QUICK=; [ "${1:-}" = --quick ] && QUICK=--quick
cd "$(dirname "$0")/../.."
LOGS=${LMC_GPU_LOGS:-${OUT:-/tmp/lmcache-gpu-run}}; mkdir -p "$LOGS"
WHEELS=${LMCACHE_NOX_WHEELS:-.eng/nox-wheels}
python3 -m nox --version >/dev/null 2>&1 ||
  python3 -m pip install -q --no-index --find-links "$WHEELS" nox || exit 1
python3 -m pip install -q --no-build-isolation --no-deps \
  -e packages/lmcache-core -e packages/lmcache-vllm -e packages/lmcache-sglang || exit 1
step() {  # step NAME LIMIT_S CMD...: run, log, time
  local name=$1 limit=$2; shift 2; local t=$SECONDS
  echo "[$(date +%T)] $name ..."
  timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1; local rc=$?
  echo "[$(date +%T)] $name: exit $rc in $((SECONDS - t)) s (log $LOGS/$name.log)"
  return $rc
}
step tests "${LMC_TESTS_S:-360}" python3 -m nox -s gpu; TESTS=$?
# vLLM from the site folder `nox -s gpu` unpacked (noxfile.py: GPU_SITE)
export PYTHONPATH=/tmp/lmcache-vllm-site${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1
export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0
step gpu_transfer "${LMC_TRANSFER_S:-150}" python3 benchmarks/gpu_transfer.py $QUICK; XFER=$?
step vllm_gpu "${LMC_VLLM_S:-300}" python3 benchmarks/vllm_gpu.py $QUICK; VLLM=$?
echo; echo "== nox -s gpu (exit $TESTS) =="
grep -E "^(FAILED|ERROR)|^SKIPPED|passed|failed|nox > (Session|.*: no bundle)" "$LOGS/tests.log" | tail -n 40
for name in gpu_transfer vllm_gpu; do  # each prints its table after a line starting with "=== "
  echo; echo "== $name =="
  if grep -q '^=== ' "$LOGS/$name.log"; then sed -n '/^=== /,$p' "$LOGS/$name.log"
  else tail -n 25 "$LOGS/$name.log"; fi
done
[ $TESTS -eq 0 ] && [ $XFER -eq 0 ] && [ $VLLM -eq 0 ]
