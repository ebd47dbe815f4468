# SPDX-License-Identifier: Apache-2.0
"""GPU-side gather/scatter bandwidth of the lmcache CUDA kernels next to the device-to-device
copy ceiling measured in the same run.

Run on a CUDA machine with a toolkit (``python benchmarks/gpu_kernels.py``; the first run
JIT-builds the extension). Each row moves the KV of ``tokens`` tokens between a paged cache
(shuffled pages) and chunk-major staging (256-token chunks, the host chunk layout), all layers
in one launch unless said otherwise, and reports the median of ``--reps`` (>= 20) CUDA-event
timings after warm-up. ``GB/s`` counts the KV bytes moved once (each is read once and written
once, so device memory traffic is twice that); ``ceiling`` is ``dst.copy_(src)`` of the same
number of bytes between two contiguous device buffers, counted the same way. ``torch index``
is the one advanced-indexing op over an all-layer view that the vLLM connector uses today.

Geometries: Llama-8B on vLLM's CUDA FlashAttention layout (32 layers, 8 KV heads of 128,
bf16, 16-token pages, one buffer: per layer a ``[blocks, heads, block_size, 2 * 128]`` view of
``[blocks, block_size, heads, 256]``), the same on SGLang's per-layer K and V pools, and
DeepSeek-V3 MLA on vLLM (61 layers, latent 576, bf16, 64-token pages).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

from lmcache.gpu_ops import PagedKV, _cext, gather_kv, scatter_kv

CHUNK = 256


def _median_ms(fn: Callable[[], None], reps: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


class Geometry:
    def __init__(self, name: str, layout: str, layers: int, heads: int, head: int, page: int):
        self.name, self.layout = name, layout
        self.layers, self.heads, self.head, self.page = layers, heads, head, page

    def build(self, tokens: int) -> tuple[PagedKV, torch.Tensor | None, list[torch.Tensor]]:
        """``(kv, fused all-layer view or None, buffers)`` with room for ``tokens`` + slack."""
        pages = tokens // self.page + 64
        L, H, D, N = self.layers, self.heads, self.head, self.page
        if self.layout == "vllm_nhd":
            raw = torch.randn(L, pages, N, H, 2 * D, device="cuda", dtype=torch.bfloat16)
            kv = PagedKV.from_vllm([raw[i].permute(0, 2, 1, 3) for i in range(L)], D)
            return kv, raw.view(L, pages * N, H * 2 * D), [raw]
        if self.layout == "vllm_mla":
            raw = torch.randn(L, pages, N, D, device="cuda", dtype=torch.bfloat16)
            return (
                PagedKV.from_vllm_mla([raw[i] for i in range(L)]),
                raw.view(L, pages * N, D),
                [raw],
            )
        ks = [torch.randn(pages * N, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(L)]
        vs = [torch.randn(pages * N, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(L)]
        return PagedKV.from_sglang(ks, vs), None, ks + vs


def _slots(kv: PagedKV, tokens: int) -> torch.Tensor:
    pages = torch.randperm(kv.num_pages, device="cuda")[
        : (tokens + kv.page_size - 1) // kv.page_size
    ]
    per = torch.arange(kv.page_size, device="cuda")
    return (pages[:, None] * kv.page_size + per).reshape(-1)[:tokens].contiguous()


def run(geo: Geometry, tokens: int, reps: int, extra: bool) -> list[tuple[str, float, float]]:
    kv, fused, _ = geo.build(tokens)
    slots = _slots(kv, tokens)
    offsets = torch.tensor([*range(0, tokens, CHUNK), tokens], dtype=torch.int64, device="cuda")
    nbytes = tokens * kv.num_layers * kv.kv_width * 2
    staging = torch.empty(tokens * kv.num_layers * kv.kv_width, dtype=kv.dtype, device="cuda")
    sums = torch.empty(offsets.numel() - 1, dtype=torch.int64, device="cuda")
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    rows = []

    def add(label: str, ms: float) -> None:
        rows.append((label, ms, nbytes / ms / 1e6))

    add("ceiling: d2d copy", _median_ms(lambda: dst.copy_(src), reps))
    add("gather", _median_ms(lambda: gather_kv(kv, slots, offsets, staging), reps))
    add(
        "gather + checksums",
        _median_ms(lambda: gather_kv(kv, slots, offsets, staging, checksums=sums), reps),
    )
    add("scatter", _median_ms(lambda: scatter_kv(kv, slots, offsets, staging), reps))
    add(
        "scatter + checksums",
        _median_ms(lambda: scatter_kv(kv, slots, offsets, staging, checksums=sums), reps),
    )
    if extra:
        one = torch.empty(tokens * kv.kv_width, dtype=kv.dtype, device="cuda")

        def layerwise() -> None:
            for layer in range(kv.num_layers):
                gather_kv(kv, slots, offsets, one, layers=range(layer, layer + 1))

        add(f"gather, {kv.num_layers} one-layer calls", _median_ms(layerwise, reps))
        for sms in (8, 16, 32, 66):
            add(
                f"gather, max_sms={sms}",
                _median_ms(lambda s=sms: gather_kv(kv, slots, offsets, staging, max_sms=s), reps),
            )
        if fused is not None:
            layer_idx = torch.arange(kv.num_layers, device="cuda").view(-1, 1)
            out = torch.empty(kv.num_layers, tokens, fused.shape[-1], dtype=kv.dtype, device="cuda")

            def index() -> None:
                torch.ops.aten.index.Tensor_out(fused, [layer_idx, slots.view(1, -1)], out=out)

            add("torch index (today's path)", _median_ms(index, reps))
    return rows


def check(geo: Geometry, tokens: int) -> bool:
    """The kernels against the pure-torch reference on this geometry (random data, poisoned
    staging, some skipped slots): gather bytes and checksums, then a scatter into poisoned
    pages, all bit for bit."""
    from lmcache.gpu_ops import _ref

    kv, _, buffers = geo.build(tokens)
    slots = _slots(kv, tokens)
    slots[::7] = -1
    offsets = torch.tensor([*range(0, tokens, CHUNK), tokens], dtype=torch.int64, device="cuda")
    staging = torch.randn(tokens * kv.num_layers * kv.kv_width, device="cuda").to(kv.dtype)
    want = staging.clone()
    sums = torch.empty(offsets.numel() - 1, dtype=torch.int64, device="cuda")
    ref_sums = torch.zeros_like(sums)
    gather_kv(kv, slots, offsets, staging, checksums=sums)
    args = (list(kv.k), list(kv.v), slots, offsets, want, ref_sums, 0, kv.num_layers, False, 0)
    _ref.gather_kv(*args)
    ok = torch.equal(staging.view(torch.int16), want.view(torch.int16)) and torch.equal(
        sums, ref_sums
    )
    for t in buffers:
        t.normal_()
    expected = [t.clone() for t in buffers]
    scatter_kv(kv, slots, offsets, staging, checksums=sums)
    got = [t.clone() for t in buffers]
    for t, e in zip(buffers, expected, strict=True):
        t.copy_(e)
    ref_sums.zero_()
    _ref.scatter_kv(*args[:4], staging, ref_sums, *args[6:])
    ok &= all(
        torch.equal(a.view(torch.int16), b.view(torch.int16))
        for a, b in zip(got, buffers, strict=True)
    )
    ok &= torch.equal(sums, ref_sums)
    return bool(ok)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--tokens", type=int, nargs="*", default=[256, 2048, 8192, 32768])
    args = parser.parse_args()
    reps = max(args.reps, 20)
    status = _cext.load()
    print(f"extension: {status.mode} ({status.seconds:.1f} s) {status.detail}")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    geos = [
        Geometry("Llama-8B vLLM NHD", "vllm_nhd", 32, 8, 128, 16),
        Geometry("Llama-8B SGLang pools", "sglang_nhd", 32, 8, 128, 1),
        Geometry("DeepSeek-V3 MLA vLLM", "vllm_mla", 61, 1, 576, 64),
    ]
    for geo in geos:
        print(f"check {geo.name}: {'bit-exact' if check(geo, 2048) else 'MISMATCH'}")
    print(
        f"{'geometry':24} {'tokens':>6} {'MiB':>7}  {'case':34} {'ms':>8} {'GB/s':>8} {'%ceil':>6}"
    )
    for geo in geos:
        sizes = args.tokens if geo.layout == "vllm_nhd" else [8192]
        for tokens in sizes:
            rows = run(geo, tokens, reps, extra=tokens == 8192)
            ceiling = rows[0][2]
            mib = (
                tokens
                * 2
                * (geo.layers * geo.heads * geo.head * (1 if geo.layout.endswith("mla") else 2))
                / 2**20
            )
            for label, ms, gbs in rows:
                print(
                    f"{geo.name:24} {tokens:>6} {mib:>7.0f}  {label:34} {ms:>8.3f} {gbs:>8.0f} {100 * gbs / ceiling:>5.0f}%"
                )
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
