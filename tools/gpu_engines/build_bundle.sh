#!/bin/bash
# Build a trimmed, sm_90-only bundle of vLLM 0.26.0 or SGLang 0.5.17 for the
# nvidia-h200 image (Python 3.12.3, torch 2.11.0+cu130), to carry in ONE call.
#   build_bundle.sh vllm|vllm-nofa|sglang OUT_DIR [SCRATCH]
# OUT_DIR gets *.tar.xz files: each is a site-packages tree to unpack into one
# folder that goes first on PYTHONPATH on the device (see tools/gpu_engines/README.md).
#   build_bundle.sh nox OUT_DIR
# OUT_DIR/nox-wheels gets nox and its pure-Python dependencies as Python 3.12 wheels
# (~7 MiB); on the device: pip install --no-index --find-links OUT_DIR/nox-wheels nox
# Needs: a python3 with pip (any version that has `pip download --platform`),
# readelf, xz, unzip. Wheels come from PyPI with --no-deps.
set -euo pipefail
ENGINE=$1; OUT=$(realpath -m "$2"); SCR=$(realpath -m "${3:-$(mktemp -d)}")
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT" "$SCR/whl" "$SCR/stage"
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64
  --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
  --platform manylinux_2_5_x86_64)
dl() { PIP_CONSTRAINT= python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$SCR/whl" "$@"; }
# The small pure/compiled deps that the image lacks and that the engine imports
# at module level on the CUDA path (found with the import probes beside this file).
VLLM_DEPS="pydantic==2.14.4 pydantic-core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0
  cbor2==6.3.0 pyzmq==27.3.0 openai-harmony==0.0.8 openai==3.57.0 httpx2==2.16.2 sniffio==1.3.1
  msgspec==0.23.0 pybase64==1.5.1 cachetools==8.0.2 llguidance==1.7.6 xgrammar==0.2.7
  apache-tvm-ffi==0.1.10 fastapi==0.136.3 starlette==1.10.0 partial-json-parser==0.2.1.1.post7
  setproctitle==1.3.8"
SGL_DEPS="transformers==5.12.1 tokenizers==0.22.2 flashinfer-python==0.6.15.post1 apache-tvm-ffi==0.1.11
  compressed-tensors==0.20.1 dill==0.4.1 distro==1.9.0 fastapi==0.165.0 gguf==0.19.0 ipython==9.18.1
  traitlets==5.16.1 loguru==0.7.3 msgspec==0.23.0 openai==2.6.1 opentelemetry-api==1.45.2
  orjson==3.13.0 partial-json-parser==0.2.1.1.post7 pybase64==1.5.1 pydantic==2.14.4
  pydantic-core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0 pyzmq==27.3.0
  setproctitle==1.3.8 sniffio==1.3.1 starlette==1.10.0 uvicorn==0.54.0"
unpack_deps() {  # unzip each listed wheel into one tree, then xz it
  mkdir -p "$SCR/stage/deps"
  for r in $1; do n=${r%%==*}; v=${r#*==}; pat=$(echo "$n" | tr '-' '_')
    w=$(ls "$SCR/whl" | grep -i "^${pat}-${v}-" | head -1); unzip -q -o "$SCR/whl/$w" -d "$SCR/stage/deps"; done
  tar -C "$SCR/stage/deps" -cf - . | xz -T0 -6 > "$OUT/deps.tar.xz"
}
case $ENGINE in
nox)
  PIP_CONSTRAINT= python3 -m pip download -q --only-binary=:all: --python-version 3.12 \
    --implementation py --abi none --platform any -d "$OUT/nox-wheels" "nox>=2024.3.2"
  ls "$OUT/nox-wheels"; du -sh "$OUT/nox-wheels"; exit 0 ;;
vllm|vllm-nofa)
  dl vllm==0.26.0 $VLLM_DEPS
  S=$SCR/stage/vllm; mkdir -p "$S"; unzip -q -o "$SCR"/whl/vllm-0.26.0-*.whl -d "$S"
  # drop: Rust frontend (off by default), MoE/FlashMLA/QuTLASS kernels, FA2 (sm_80 only;
  # sm_90 uses FA3), DeepGEMM/sm100/FA4 sources. Trim _C to sm_90 code.
  rm -f "$S"/vllm/vllm-rs "$S"/vllm/_moe_C_stable_libtorch.abi3.so "$S"/vllm/_flashmla_C.abi3.so \
        "$S"/vllm/_flashmla_extension_C.abi3.so "$S"/vllm/_qutlass_C.abi3.so \
        "$S"/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so
  rm -rf "$S"/vllm/third_party/deep_gemm "$S"/vllm/third_party/fmha_sm100 "$S"/vllm/third_party/tml_fa4
  [ "$ENGINE" = vllm-nofa ] && rm -f "$S"/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so
  python3 "$HERE/fatbin_trim.py" "$S"/vllm/_C_stable_libtorch.abi3.so --keep 90 --out "$SCR/_C.so" | tail -1
  mv "$SCR/_C.so" "$S"/vllm/_C_stable_libtorch.abi3.so
  tar -C "$S" -cf - . | xz -T0 -6 > "$OUT/$ENGINE-0.26.0-sm90.tar.xz"
  unpack_deps "$VLLM_DEPS" ;;
sglang)
  dl sglang==0.5.17 sglang-kernel==0.4.5 xgrammar==0.2.1 $SGL_DEPS
  S=$SCR/stage/sglang; mkdir -p "$S"; unzip -q -o "$SCR"/whl/sglang-0.5.17-*.whl -d "$S"
  unzip -q -o "$SCR"/whl/sglang_kernel-0.4.5-*.whl -d "$S"
  unzip -q -o "$SCR"/whl/xgrammar-0.2.1-*.whl -d "$S"
  # drop: FA3 (flash_ops, 1.1 GB), FlashMLA, InfLLM, the sm100 common_ops; xgrammar's static lib.
  rm -f "$S"/sgl_kernel/flash_ops.abi3.so "$S"/sgl_kernel/flashmla_ops.abi3.so "$S"/sgl_kernel/infllm_ops*.so
  rm -rf "$S"/sgl_kernel/sm100; find "$S"/xgrammar -name '*.a' -delete
  python3 "$HERE/fatbin_trim.py" "$S"/sgl_kernel/sm90/common_ops.abi3.so --keep 90 --out "$SCR/co.so" | tail -1
  mv "$SCR/co.so" "$S"/sgl_kernel/sm90/common_ops.abi3.so
  tar -C "$S" -cf - . | xz -T0 -6 > "$OUT/sglang-0.5.17-sm90.tar.xz"
  unpack_deps "$SGL_DEPS" ;;
*) echo "usage: $0 vllm|vllm-nofa|sglang|nox OUT_DIR [SCRATCH]"; exit 2 ;;
esac
ls -l "$OUT"; du -cb "$OUT"/*.tar.xz | tail -1 | awk '{printf "total %.2f MiB\n", $1/1048576}'
