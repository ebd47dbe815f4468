#!/bin/bash
# Everything the GPU machine checks, in one command from the repository root (README.md here):
#   tools/gpu_engines/run_gpu.sh [--quick]
# Installs nox from the carried wheels ($LMC_NOX_WHEELS, default .eng/nox-wheels) and our
# packages (editable, --no-deps, no network), runs `nox -s gpu` (GPU unit tests; real vLLM and
# SGLang from the bundles in .eng / .eng-sgl), then benchmarks/gpu_transfer.py and
# benchmarks/vllm_gpu.py, and prints the test summary and both tables last. Each step is cut
# at its share of $LMC_DEADLINE_S (default 570 s from the start: the tests get what the
# benchmarks leave). Logs: $LMC_GPU_LOGS (default $OUT when set, else /tmp/lmcache-gpu-run).
# --quick: fewer samples, and the 8-layer model in vllm_gpu.py (no 32-layer build).
set -uo pipefail
QUICK=(); VLLM_ARGS=(--rounds 1)  # one round of the four engines fits the time left
if [ "${1:-}" = --quick ]; then QUICK=(--quick); VLLM_ARGS=(--quick --layers 8 --rounds 1); fi
cd "$(dirname "$0")/../.."
LOGS=${LMC_GPU_LOGS:-${OUT:-/tmp/lmcache-gpu-run}}; mkdir -p "$LOGS"
DEADLINE=${LMC_DEADLINE_S:-570}
XFER_S=${LMC_TRANSFER_S:-75}
VLLM_S=${LMC_VLLM_S:-$([ ${#QUICK[@]} -gt 0 ] && echo 120 || echo 210)}
python3 -m nox --version >/dev/null 2>&1 ||
  python3 -m pip install -q --no-index --find-links "${LMC_NOX_WHEELS:-.eng/nox-wheels}" nox ||
  exit 1
python3 -m pip install -q --no-build-isolation --no-deps \
  -e packages/lmcache-core -e packages/lmcache-vllm -e packages/lmcache-sglang || exit 1
step() {  # step NAME LIMIT_S CMD...: run with a time limit, output to the log
  local name=$1 limit=$2; shift 2; local t=$SECONDS
  [ "$limit" -ge 30 ] || limit=30  # past the deadline: a short try rather than none
  echo "[$(date +%T)] $name (limit ${limit} s) ..."
  timeout -k 10 "$limit" "$@" >"$LOGS/$name.log" 2>&1; local rc=$?
  echo "[$(date +%T)] $name: exit $rc in $((SECONDS - t)) s$([ $rc -eq 124 ] && echo ', cut at its limit')"
  return $rc
}
step tests $((DEADLINE - SECONDS - XFER_S - VLLM_S)) python3 -m nox -s gpu; TESTS=$?
# vLLM from the folder `nox -s gpu` unpacked it into (tools/gpu_engines/bundles.py: GPU_SITE)
export PYTHONPATH=/tmp/lmcache-vllm-site${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1
export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0
step gpu_transfer "$XFER_S" python3 benchmarks/gpu_transfer.py "${QUICK[@]}"; XFER=$?
step vllm_gpu $((DEADLINE - SECONDS)) python3 benchmarks/vllm_gpu.py "${VLLM_ARGS[@]}"; VLLM=$?
echo; echo "== nox -s gpu (exit $TESTS; log $LOGS/tests.log) =="
grep -E "^(FAILED|ERROR|SKIPPED)|[0-9]+ (passed|failed)|nox > (Session|Command|.*no bundle)" \
  "$LOGS/tests.log" | tail -n 40
for name in gpu_transfer vllm_gpu; do  # each prints its table after a line starting with "=== "
  echo; echo "== $name (log $LOGS/$name.log) =="
  if grep -q '^=== ' "$LOGS/$name.log"; then sed -n '/^=== /,$p' "$LOGS/$name.log"
  else tail -n 25 "$LOGS/$name.log"; fi
done
[ $TESTS -eq 0 ] && [ $XFER -eq 0 ] && [ $VLLM -eq 0 ]
