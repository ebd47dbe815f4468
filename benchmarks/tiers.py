# SPDX-License-Identifier: Apache-2.0
"""Store / retrieve GB/s of the disk and Redis tiers next to their raw ceilings, same run.

A 16k-token prompt of Llama-3-8B geometry (32 layers, 8 KV heads of 128, bf16: 128 KiB of KV per
token, 2 GiB in all) is cut into 256-token chunks (32 MiB each) held in host memory, then:

- disk: the tier's store (``submit_write`` of every chunk + ``flush``: temp file, write, fsync,
  rename) and retrieve (``read_into`` of every chunk: read, verify header and checksum), next to
  the raw ceiling: plain sequential ``write`` + ``fsync`` of the same bytes into one file per chunk,
  and plain ``readinto`` of them into the same host buffers;
- Redis: the tier's store and retrieve (pipelined, verified) next to raw redis-py ``SET`` / ``GET``
  of the same bytes (the faster of one command per chunk and pipelines of 8) against the same
  ``redis-server`` (started here on 127.0.0.1, no persistence).

Reads come from the page cache when the data fits in RAM (both the tier and the ceiling: the
comparison is fair, the absolute figure is memory-bound). Run with ``nox -s bench`` or
``python benchmarks/tiers.py [--tokens N] [--folder DIR] [--repeat N]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lmcache.metrics import LMCacheMetrics
from lmcache.tiers import ReadRequest, tensor_checksum
from lmcache.tiers.chunk_format import fingerprint_digest
from lmcache.tiers.disk.tier import DiskTier
from lmcache.tiers.lower_tier import LowerTier

LAYERS, KV_HEADS, HEAD_DIM, CHUNK = 32, 8, 128, 256
WIDTH = 2 * KV_HEADS * HEAD_DIM
FP = fingerprint_digest(b"benchmark/llama-3-8b-geometry")


class _Lease:
    """The part of a memory lease the tiers use: ``tensor``, ``nbytes``, ``share``/``release``."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.nbytes = tensor.numel() * tensor.element_size()

    def share(self) -> _Lease:
        return self

    def release(self) -> None:
        pass


def _rounds(
    steps: list[tuple[str, Callable[[], None], Callable[[], None] | None]], repeat: int
) -> dict[str, float]:
    """Best time of each step over ``repeat`` rounds; a round runs every step once, in order, so
    a tier and its ceiling see the same machine load. ``setup`` (if any) is not timed."""
    best: dict[str, float] = {}
    for _ in range(repeat):
        for name, fn, setup in steps:
            if setup is not None:
                setup()
            started = time.perf_counter()
            fn()
            took = time.perf_counter() - started
            best[name] = min(best.get(name, took), took)
    return best


def _chunks(tokens: int) -> tuple[list[bytes], list[torch.Tensor]]:
    n = tokens // CHUNK
    gen = torch.Generator().manual_seed(0)
    chunks = [torch.randn(LAYERS, CHUNK, WIDTH, generator=gen).to(torch.bfloat16) for _ in range(n)]
    keys = [i.to_bytes(16, "little") for i in range(n)]
    return keys, chunks


def _tier_store(tier: LowerTier, keys, chunks, metrics, checksums) -> Callable[[], None]:
    def run() -> None:
        for key, chunk, checksum in zip(keys, chunks, checksums, strict=True):
            assert tier.submit_write(FP, key, _Lease(chunk), checksum, metrics)
        assert tier.flush(600)

    return run


def _tier_retrieve(tier: LowerTier, keys, outs, metrics) -> Callable[[], None]:
    def run() -> None:
        done = tier.read_into(
            FP, [ReadRequest(k, o) for k, o in zip(keys, outs, strict=True)], metrics
        )
        assert done == len(keys), f"read {done} of {len(keys)} chunks"

    return run


def _time_tier(
    tier: LowerTier,
    keys,
    chunks,
    outs,
    checksums,
    raw_writes: list[tuple[str, Callable[[], None]]],
    raw_reads: list[tuple[str, Callable[[], None]]],
    repeat: int,
) -> dict[str, float]:
    """Best times of the ``raw_writes``, the tier's ``store``, the ``raw_reads`` and the tier's
    ``retrieve``, in that order in each of ``repeat`` rounds; then close the tier and check that
    ``outs`` hold ``chunks``. The tier is cleared before each timed store: it does not rewrite
    what it holds."""
    metrics = LMCacheMetrics()
    try:
        t = _rounds(
            [
                *((name, fn, None) for name, fn in raw_writes),
                (
                    "store",
                    _tier_store(tier, keys, chunks, metrics, checksums),
                    clear(tier, metrics),
                ),
                *((name, fn, None) for name, fn in raw_reads),
                ("retrieve", _tier_retrieve(tier, keys, outs, metrics), None),
            ],
            repeat,
        )
    finally:
        tier.close()
    assert all(
        torch.equal(o.view(torch.int16), c.view(torch.int16))
        for o, c in zip(outs, chunks, strict=True)
    )
    return t


def _disk(folder: Path, keys, chunks, outs, checksums, repeat: int) -> list[tuple[str, float]]:
    nbytes = sum(c.numel() * 2 for c in chunks)
    raw = folder / "raw"
    raw.mkdir(parents=True)

    def raw_write() -> None:
        for i, chunk in enumerate(chunks):
            fd = os.open(raw / f"{i}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                view = chunk.reshape(-1).view(torch.uint8).numpy().data
                written = 0
                while written < len(view):
                    written += os.write(fd, view[written:])
                os.fsync(fd)
            finally:
                os.close(fd)

    def raw_read() -> None:
        for i, out in enumerate(outs):
            with open(raw / f"{i}.bin", "rb", buffering=0) as f:
                f.readinto(out.reshape(-1).view(torch.uint8).numpy().data)

    tier = DiskTier(str(folder / "tier"), 4 * nbytes, write_queue_bytes=2 * nbytes)
    t = _time_tier(
        tier,
        keys,
        chunks,
        outs,
        checksums,
        [("raw write", raw_write)],
        [("raw read", raw_read)],
        repeat,
    )
    gb = nbytes / 1e9
    return [
        ("disk store", gb / t["store"], gb / t["raw write"]),
        ("disk retrieve", gb / t["retrieve"], gb / t["raw read"]),
    ]


def clear(tier: LowerTier, metrics: LMCacheMetrics) -> Callable[[], None]:
    return lambda: tier.clear(None, metrics)


def _redis(tmp: Path, keys, chunks, outs, checksums, repeat: int) -> list[tuple[str, float]]:
    import redis

    from lmcache.testing.redis_server import RedisServer, redis_server_path
    from lmcache.tiers.redis.tier import RedisTier

    if redis_server_path() is None:
        print("redis: skipped (no redis-server or valkey-server on PATH)", flush=True)
        return []
    nbytes = sum(c.numel() * 2 for c in chunks)
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        views = [c.reshape(-1).view(torch.uint8).numpy().data for c in chunks]

        def raw_set_pipelined() -> None:
            for start in range(0, len(views), 8):
                pipe = client.pipeline(transaction=False)
                for i in range(start, min(start + 8, len(views))):
                    pipe.set(f"raw:{i}", views[i])
                pipe.execute()

        def raw_set_single() -> None:
            for i, view in enumerate(views):
                client.set(f"raw:{i}", view)

        def raw_get_pipelined() -> None:
            for start in range(0, len(outs), 8):
                pipe = client.pipeline(transaction=False)
                for i in range(start, min(start + 8, len(outs))):
                    pipe.get(f"raw:{i}")
                for i, value in zip(range(start, len(outs)), pipe.execute(), strict=False):
                    outs[i].reshape(-1).view(torch.uint8).numpy()[:] = memoryview(value)

        def raw_get_single() -> None:
            for i, out in enumerate(outs):
                out.reshape(-1).view(torch.uint8).numpy()[:] = memoryview(client.get(f"raw:{i}"))

        tier = RedisTier(server.url, timeout=30.0, write_queue_bytes=2 * nbytes)
        t = _time_tier(
            tier,
            keys,
            chunks,
            outs,
            checksums,
            [("raw set 1", raw_set_single), ("raw set 8", raw_set_pipelined)],
            [("raw get 1", raw_get_single), ("raw get 8", raw_get_pipelined)],
            repeat,
        )
    # The ceiling is the faster of one command per chunk and pipelines of 8.
    ceiling_w = min(t["raw set 1"], t["raw set 8"])
    ceiling_r = min(t["raw get 1"], t["raw get 8"])
    store, retrieve = t["store"], t["retrieve"]
    gb = nbytes / 1e9
    return [
        ("redis store", gb / store, gb / ceiling_w),
        ("redis retrieve", gb / retrieve, gb / ceiling_r),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384, help="prompt length (default 16k)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure; best is shown")
    parser.add_argument("--folder", default=None, help="where the disk tier writes (a tmp dir)")
    parser.add_argument("--skip-redis", action="store_true")
    args = parser.parse_args()

    keys, chunks = _chunks(args.tokens)
    nbytes = sum(c.numel() * 2 for c in chunks)
    print(
        f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, python {platform.python_version()}",
        flush=True,
    )
    print(
        f"prompt: {args.tokens} tokens, Llama-3-8B KV geometry ({LAYERS} layers x {KV_HEADS} KV "
        f"heads x {HEAD_DIM}, bf16), {len(chunks)} chunks of {CHUNK} tokens "
        f"({chunks[0].numel() * 2 / 2**20:.0f} MiB), {nbytes / 2**30:.2f} GiB",
        flush=True,
    )
    print(f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])}", flush=True)
    checksums = [tensor_checksum(c) for c in chunks]
    outs = [torch.empty_like(c) for c in chunks]
    tmp = Path(args.folder or tempfile.mkdtemp(prefix="lmcache-bench-tiers-"))
    tmp.mkdir(parents=True, exist_ok=True)
    rows: list[tuple[str, float, float]] = []
    try:
        print("disk tier ...", flush=True)
        rows += _disk(tmp / "disk", keys, chunks, outs, checksums, args.repeat)
        if not args.skip_redis:
            print("redis tier ...", flush=True)
            rows += _redis(tmp, keys, chunks, outs, checksums, args.repeat)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    print(f"| {'operation':<15} | {'tier GB/s':>9} | {'raw GB/s':>8} | {'tier/raw':>8} | target |")
    print(f"|{'-' * 17}|{'-' * 11}|{'-' * 10}|{'-' * 10}|--------|")
    for name, tier, raw in rows:
        ratio = tier / raw
        verdict = "met" if ratio >= 0.8 else "MISSED"
        print(f"| {name:<15} | {tier:9.2f} | {raw:8.2f} | {ratio:8.0%} | {verdict:<6} |")
    print(f"(best of {args.repeat} runs each; target: tier >= 80 % of raw)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
