# SPDX-License-Identifier: Apache-2.0
"""GPU-side gather/scatter/checksum bandwidth of each implementation of the lmcache ops (the
compiled kernels when they load, their Triton port, vectorized torch, the per-chunk reference)
next to the device-to-device copy ceiling measured in the same run.

Run on a CUDA machine (``python benchmarks/gpu_fallback.py``; ``LMCACHE_DISABLE_CEXT=1`` leaves
the compiled kernels out). Geometries, timing and ``GB/s`` as in ``benchmarks/gpu_kernels.py``
(whose helpers this reuses): KV bytes moved once, median of ``--reps`` CUDA-event timings after
warm-up, pages shuffled, 256-token chunks. Each implementation is first checked bit for bit
against the reference (bytes and checksums) on the same inputs; a mismatch is printed and its
row skipped. The reference loops per chunk with host reads, so it runs only up to 8192 tokens.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial
from types import ModuleType
from typing import Any

import torch
from gpu_kernels import CHUNK, Geometry, _median_ms, _slots

from lmcache.gpu_ops import PagedKV, _cext, _ref, _vectorized, implementation


def _impls() -> dict[str, Callable[[str], Callable[..., None]]]:
    """Name -> op getter of every implementation this machine can run."""
    found: dict[str, Callable[[str], Callable[..., None]]] = {}
    if _cext.load().loaded:
        found["cuda-kernels"] = lambda op: getattr(torch.ops.lmcache, op).default
    try:
        from lmcache.gpu_ops import _triton

        triton_ops: ModuleType | None = _triton
    except ImportError as exc:
        print(f"triton: not available ({exc})")
        triton_ops = None
    if triton_ops is not None:
        found["triton"] = lambda op: getattr(triton_ops, op)
    found["torch-vectorized"] = lambda op: getattr(_vectorized, op)
    found["torch-reference"] = lambda op: getattr(_ref, op)
    return found


def _args(
    kv: PagedKV,
    slots: torch.Tensor,
    offsets: torch.Tensor,
    staging: torch.Tensor,
    sums: torch.Tensor | None,
) -> tuple[Any, ...]:
    return (list(kv.k), list(kv.v), slots, offsets, staging, sums, 0, kv.num_layers, False, 0)


def _agrees(get: Callable[[str], Callable[..., None]], geo: Geometry, tokens: int) -> bool:
    """Gather, scatter and checksums of ``get`` equal the reference's on the same inputs."""
    kv, _, bufs = geo.build(tokens)
    slots = _slots(kv, tokens)
    slots[::7] = -1  # skipped tokens
    offsets = torch.tensor([*range(0, tokens, CHUNK), tokens], device="cuda")
    n = tokens * kv.num_layers * kv.kv_width
    init = torch.randn(n, device="cuda").to(kv.dtype)  # never zeros: they hide unwritten rows
    outs = []
    for op_get in (lambda op: getattr(_ref, op), get):
        staging = init.clone()
        sums = torch.zeros(offsets.numel() - 1, dtype=torch.int64, device="cuda")
        op_get("gather_kv")(*_args(kv, slots, offsets, staging, sums))
        scatter_sums = torch.zeros_like(sums)
        saved = [b.clone() for b in bufs]
        op_get("scatter_kv")(*_args(kv, slots, offsets, staging.roll(1), scatter_sums))
        after = [b.clone() for b in bufs]
        for b, s in zip(bufs, saved, strict=True):
            b.copy_(s)
        whole = torch.empty_like(sums)
        op_get("checksum_chunks")(staging, offsets, kv.num_layers * kv.kv_width * 2, whole)
        outs.append((staging.view(torch.int16), sums, scatter_sums, after, whole))
    (a, b) = outs
    same = all(torch.equal(x, y) for x, y in zip(a[:3], b[:3], strict=True))
    same = same and all(torch.equal(x, y) for x, y in zip(a[3], b[3], strict=True))
    return same and torch.equal(a[4], b[4])


def run(geo: Geometry, tokens: int, reps: int) -> list[tuple[str, float, float]]:
    kv, _, _ = geo.build(tokens)
    slots = _slots(kv, tokens)
    offsets = torch.tensor([*range(0, tokens, CHUNK), tokens], dtype=torch.int64, device="cuda")
    nbytes = tokens * kv.num_layers * kv.kv_width * 2
    staging = torch.empty(tokens * kv.num_layers * kv.kv_width, dtype=kv.dtype, device="cuda")
    sums = torch.empty(offsets.numel() - 1, dtype=torch.int64, device="cuda")
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    rows = [("ceiling: d2d copy", _median_ms(lambda: dst.copy_(src), reps))]
    for name, get in _impls().items():
        if name == "torch-reference" and tokens > 8192:
            continue
        if not _agrees(get, geo, min(tokens, 2048)):
            print(f"{geo.name} {name}: MISMATCH against the reference; rows skipped")
            continue
        gather, scatter, csum = get("gather_kv"), get("scatter_kv"), get("checksum_chunks")
        cases: list[tuple[str, Callable[[], None]]] = [
            ("gather", partial(gather, *_args(kv, slots, offsets, staging, None))),
            ("gather + checksums", partial(gather, *_args(kv, slots, offsets, staging, sums))),
            ("scatter + checksums", partial(scatter, *_args(kv, slots, offsets, staging, sums))),
            ("checksum_chunks", partial(csum, staging, offsets, nbytes // tokens, sums)),
        ]
        for label, fn in cases:
            rows.append((f"{name}: {label}", _median_ms(fn, reps)))
    return [(label, ms, nbytes / ms / 1e6) for label, ms in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--tokens", type=int, nargs="*", default=[256, 2048, 16384])
    args = parser.parse_args()
    reps = max(args.reps, 20)
    status = _cext.load()
    print(f"extension: {status.mode} {status.detail}; wrappers use {implementation('cuda')}")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    geos = [
        Geometry("Llama-8B vLLM NHD", "vllm_nhd", 32, 8, 128, 16),
        Geometry("Llama-8B SGLang pools", "sglang_nhd", 32, 8, 128, 1),
        Geometry("DeepSeek-V3 MLA vLLM", "vllm_mla", 61, 1, 576, 64),
    ]
    print(f"{'geometry':24} {'tokens':>6}  {'case':44} {'ms':>8} {'GB/s':>8} {'%ceil':>6}")
    for geo in geos:
        for tokens in args.tokens if geo.layout == "vllm_nhd" else [2048]:
            rows = run(geo, tokens, reps)
            ceiling = rows[0][2]
            for label, ms, gbs in rows:
                pct = 100 * gbs / ceiling
                print(f"{geo.name:24} {tokens:>6}  {label:44} {ms:>8.3f} {gbs:>8.0f} {pct:>5.0f}%")
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
