# SPDX-License-Identifier: Apache-2.0
"""KV store/load bandwidth of the ``vllm.cuda`` connector against the pinned-copy ceiling.

Run on a CUDA machine (``python benchmarks/gpu_transfer.py``). Geometry: Llama-8B (32 layers,
8 KV heads, head size 128, bf16), vLLM's CUDA FlashAttention layout (per layer a
``[blocks, kv_heads, block_size, 2 * head_size]`` view of a ``[blocks, block_size, kv_heads, C]``
buffer), 16-token pages, shuffled pages. For each request size it measures, with CUDA events after
warm-up (medians):

- ``ceiling``: one pinned host<->device ``copy_`` of the same number of bytes (the PCIe ceiling
  measured in the same run);
- ``store``: ``LMCacheEngine.store`` of the request (gather from the paged cache into pinned chunk
  buffers; checksums off so the figure is the transfer alone, ``--checksum`` keeps them on);
- ``load``: ``LMCacheEngine.retrieve`` of the request into the paged cache.

It first checks that a store followed by a load reproduces the KV bit for bit (poisoned pages).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lmcache.cache_engine import LMCacheEngine
from lmcache.config import LMCacheConfig
from lmcache.gpu_connector import CreateGPUConnector, EngineInfo, TransferSpec
from lmcache.metadata import LMCacheMetadata

LAYERS, HEADS, HEAD, PAGE = 32, 8, 128, 16
DTYPE = torch.bfloat16


def _caches(num_blocks: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    raw = torch.randn(LAYERS, num_blocks, PAGE, HEADS, 2 * HEAD, device="cuda", dtype=DTYPE)
    return raw, [raw[i].permute(0, 2, 1, 3) for i in range(LAYERS)]


def _median_ms(fn, reps: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _measure(
    engine: LMCacheEngine, layers: list[torch.Tensor], num_blocks: int, n: int, reps: int
) -> tuple[int, int, float, float, float, float, bool]:
    """Ceilings, store and load times (ms) and bit-exactness for one request of ``n`` tokens."""
    pages = torch.randperm(num_blocks - 1, device="cuda")[: (n + PAGE - 1) // PAGE] + 1
    slots = (pages[:, None] * PAGE + torch.arange(PAGE, device="cuda")).reshape(-1)[:n]
    nbytes = n * LAYERS * HEADS * 2 * HEAD * 2
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    d2h = _median_ms(lambda: host.copy_(dev, non_blocking=True), reps)
    h2d = _median_ms(lambda: dev.copy_(host, non_blocking=True), reps)
    tokens = torch.randint(0, 100_000, (n,), generator=torch.Generator().manual_seed(n))

    def store() -> None:
        engine.clear()
        engine.store(tokens, None, TransferSpec(slots))

    store()
    expect = torch.stack([layer[pages] for layer in layers]).clone()
    for layer in layers:  # poison, load, compare bits on the full pages
        layer[pages] = float("nan")
    mask = engine.retrieve(tokens, None, TransferSpec(slots))
    torch.cuda.synchronize()
    got = torch.stack([layer[pages] for layer in layers])
    full = n // PAGE
    ok = bool(mask.all()) and torch.equal(
        got[:, :full].view(torch.int16), expect[:, :full].view(torch.int16)
    )
    st = _median_ms(store, reps)
    ld = _median_ms(lambda: engine.retrieve(tokens, None, TransferSpec(slots)), reps)
    return n, nbytes, d2h, st, h2d, ld, ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096, 8192])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument(
        "--checksum",
        action="store_true",
        help="keep lmcache's default per-chunk xxh3 checksums (computed on store, verified on load)",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_transfer.py needs a CUDA GPU")

    max_tokens = max(args.tokens)
    num_blocks = 4 * max_tokens // PAGE + 1
    chunk = 256
    config = LMCacheConfig(chunk_size=chunk, max_local_cpu_size=12.0, checksum=args.checksum)
    meta = LMCacheMetadata(
        "bench/llama-8b", 1, 0, 0, 1, DTYPE, LAYERS, HEADS, HEAD, HEAD, chunk_size=chunk
    )
    raw, layers = _caches(num_blocks)
    conn = CreateGPUConnector(
        config, meta, EngineInfo("vllm", "cuda", layers, {"block_size": PAGE})
    )
    print(f"connector: {type(conn).__module__}.{type(conn).__name__}")
    engine = LMCacheEngine(config, meta, conn)

    rows = [_measure(engine, layers, num_blocks, n, args.reps) for n in args.tokens]
    print(
        f"\n{'tokens':>7} {'MiB':>7} {'d2h ceil GB/s':>14} {'store GB/s':>11} {'%':>5} "
        f"{'h2d ceil GB/s':>14} {'load GB/s':>10} {'%':>5} {'bit-exact':>9}"
    )
    for n, nbytes, d2h, st, h2d, ld, ok in rows:

        def gbs(ms: float, nbytes: int = nbytes) -> float:
            return nbytes / ms / 1e6

        print(
            f"{n:>7} {nbytes / 2**20:>7.1f} {gbs(d2h):>14.1f} {gbs(st):>11.1f} "
            f"{100 * d2h / st:>5.0f} {gbs(h2d):>14.1f} {gbs(ld):>10.1f} {100 * h2d / ld:>5.0f} "
            f"{'yes' if ok else 'NO':>9}"
        )
    del raw


if __name__ == "__main__":
    main()
