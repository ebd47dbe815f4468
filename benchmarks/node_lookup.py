# SPDX-License-Identifier: Apache-2.0
"""The node cache seen from a second engine process: lookup latency and read bandwidth.

Starts a real node cache owner (``python -m lmcache.node serve``, in a temporary folder of
``/dev/shm``) and a
writer process that stores, through its own node tier, a 32k-token prompt (128 chunk keys of
256 tokens, tiny chunks) with a real :class:`~lmcache.cache_engine.LMCacheEngine`, and ``--chunks``
chunks of ``--chunk-mb`` MiB through the tier. This process then times, after a warm-up:

Lookup rows (p50 / p99, beside the 0.2 ms target), each also on a per-process
:class:`~lmcache.tiers.CPUTier` holding the same chunks (the default mode, for comparison):

- ``missing(128 keys)``: one index query for the whole prompt (one request to the owner);
- ``prefix lookup``: the engine's lookup of the CPU tier (:func:`lmcache.tiers.prefix_query.present_prefix`:
  runs of 1, 2, 4, ... 128 keys, one request each);
- ``engine.lookup`` and ``engine.lookup_and_lease`` of the whole prompt (what a vLLM worker runs:
  hashing, and for the lease one ``get`` per chunk; checksums off so no chunk bytes are read);
- ``tier.get_many``: the same leases in one request (:meth:`NodeTier.get_many`; the per-process
  column is one ``get`` per chunk), and in runs of 1, 2, 4, ... keys (8 requests: what the hit
  path does with a tier that has ``get_many``).

Read rows (GB/s, beside ``memcpy``: ``torch.Tensor.copy_`` of as many private chunk-sized
buffers into one destination, measured in the same run): ``get`` of every chunk (lease + xxh3 verification) and the
copy of the leased bytes into a private buffer (what feeds an H2D copy), for chunks stored by
the other process, by this process through the node tier, and in a per-process tier.

Run ``python benchmarks/node_lookup.py [--repeats N] [--chunks N] [--chunk-mb MB]``.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lmcache.cache_engine import LMCacheEngine
from lmcache.config import LMCacheConfig
from lmcache.gpu_connector.interface import EngineInfo, TransferSpec
from lmcache.keys import chunk_keys
from lmcache.memory import HostMemoryPool, MemoryLease
from lmcache.metadata import LMCacheMetadata
from lmcache.metrics import LMCacheMetrics
from lmcache.testing import PagedCPUConnector
from lmcache.testing.node_owner import NodeOwner, python_child
from lmcache.tiers import CPUTier, process_cpu_tier, reset_process_cpu_tiers
from lmcache.tiers.cpu_tier import tensor_checksum
from lmcache.tiers.node_tier import NodeTier
from lmcache.tiers.prefix_query import present_prefix

TARGET_P99_MS = 0.2
CS, TOKENS = 256, 32768
WARMUP = 20

_WRITER = """
import sys, torch
sys.path.insert(0, sys.argv[4])
import node_lookup as bench
from lmcache.tiers.node_tier import NodeTier
from lmcache.node.client import NodeClient
from lmcache.metrics import LMCacheMetrics
folder, chunks, chunk_mb = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
engine = bench.engine(folder)
engine.store(bench.prompt(), None, bench.TransferSpec(torch.arange(bench.TOKENS)))
tier = NodeTier(NodeClient(folder, budget_bytes=0, autostart=False), LMCacheMetrics())
tier.client.connect(10)
bench.store_big(tier, b"other", chunks, chunk_mb)
print("stored", flush=True)
sys.stdin.read()
"""


def prompt() -> torch.Tensor:
    return torch.randint(0, 128_000, (TOKENS,), generator=torch.Generator().manual_seed(0))


def engine(folder: str | None) -> LMCacheEngine:
    """An engine over a 32k-token CPU cache, on the node tier of ``folder`` (or its own)."""
    md = LMCacheMetadata("bench/node", 1, 0, 0, 1, torch.bfloat16, 1, 1, 4, 4, chunk_size=CS)
    config = LMCacheConfig(
        chunk_size=CS,
        max_local_cpu_size=0.25,
        checksum=False,
        node_cache=folder is not None,
        node_cache_dir=folder,
        node_cache_autostart=False,
    )
    caches = [torch.zeros(TOKENS, 1, md.kv_width, dtype=torch.bfloat16)]
    info = EngineInfo("mock", "cpu", caches, extra={"page_size": 1})
    metrics = LMCacheMetrics()
    tier = process_cpu_tier(config, metrics) if folder is not None else None
    return LMCacheEngine(
        config, md, PagedCPUConnector(config, md, info), metrics=metrics, tier=tier, lower_tiers=()
    )


def big_keys(tag: bytes, n: int) -> list[bytes]:
    return [tag[:8].ljust(8, b"_") + i.to_bytes(8, "little") for i in range(n)]


def store_big(tier: CPUTier, tag: bytes, n: int, chunk_mb: float) -> None:
    """Store ``n`` checksummed chunks of ``chunk_mb`` MiB (bfloat16 ``[1, k]``)."""
    shape = (1, int(chunk_mb * (1 << 20)) // 2)
    leases = tier.allocate_many(shape, torch.bfloat16, n)
    if len(leases) < n:
        raise RuntimeError(f"only {len(leases)} of {n} chunks fit; raise the budget")
    gen = torch.Generator().manual_seed(1)
    for i, (key, lease) in enumerate(zip(big_keys(tag, n), leases, strict=True)):
        lease.tensor.copy_(torch.randn(shape, generator=gen).to(torch.bfloat16))
        tier.put(
            key, lease, tensor_checksum(lease.tensor), parent=big_keys(tag, n)[i - 1] if i else None
        )
        lease.release()


def ms(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    for _ in range(WARMUP):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    samples.sort()
    pick = lambda q: samples[min(len(samples) - 1, int(q * len(samples)))] * 1e3  # noqa: E731
    return pick(0.5), pick(0.99)


def in_runs(tier: NodeTier, keys: list[bytes]) -> list[MemoryLease | None]:
    """The hit path with ``get_many``: runs of 1, 2, 4, ... keys, as the engine reads its lazy
    key chain (what ``HitReader._cpu_run`` would do with a tier that has ``get_many``)."""
    out: list[MemoryLease | None] = []
    run = 1
    while len(out) < len(keys):
        batch = keys[len(out) : len(out) + run]
        got = tier.get_many(batch)
        out += got
        if len(got) < len(batch):
            break
        run *= 2
    return out


def release(leases: list[MemoryLease | None]) -> None:
    if len(leases) != TOKENS // CS:
        raise RuntimeError(f"{len(leases)} chunks leased, expected {TOKENS // CS}")
    for lease in leases:
        assert lease is not None
        lease.release()


Timed = Callable[[], tuple[int, float]]
"""A read: returns the bytes it read and the seconds its timed part took."""


def read_fns(tier: CPUTier, keys: list[bytes]) -> tuple[Timed, Timed]:
    """``get_all`` (lease + verify every chunk) and ``copy_all`` (every chunk leased first, then
    each one's bytes copied into a private buffer; only the copies are timed)."""
    first = tier.get(keys[0])
    assert first is not None, "chunk missing"
    dst = torch.empty_like(first.tensor)
    first.release()

    def get_all() -> tuple[int, float]:
        total, start = 0, time.perf_counter()
        for key in keys:
            lease = tier.get(key)
            assert lease is not None
            total += lease.nbytes
            lease.release()
        return total, time.perf_counter() - start

    def copy_all() -> tuple[int, float]:
        held = [tier.get(key) for key in keys]  # leased (and verified) first: 64 MiB+ > caches
        start = time.perf_counter()
        for lease in held:
            assert lease is not None
            dst.copy_(lease.tensor)
        seconds = time.perf_counter() - start
        for lease in held:
            assert lease is not None
            lease.release()
        return sum(lease.nbytes for lease in held if lease is not None), seconds

    return get_all, copy_all


def interleaved_gbps(fns: dict[str, Timed], repeats: int) -> dict[str, float]:
    """Best GB/s of each read over ``repeats`` rounds (after one warm-up round), the reads taking
    turns within a round, so that a busy machine slows all of them alike."""
    best = dict.fromkeys(fns, 0.0)
    for i in range(repeats + 1):
        for name, fn in fns.items():
            nbytes, seconds = fn()
            if i:
                best[name] = max(best[name], nbytes / seconds / 1e9)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--chunk-mb", type=float, default=8.0)
    args = parser.parse_args()
    big = args.chunks * int(args.chunk_mb * (1 << 20))
    print(
        f"node cache from a second process ({platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads)"
    )
    shm = "/dev/shm" if Path("/dev/shm").is_dir() else None  # the arena is memory, as in use
    with tempfile.TemporaryDirectory(prefix="lmc-", dir=shm) as tmp:
        folder = str(Path(tmp) / "node")
        owner = NodeOwner(folder, 3 * big + (64 << 20), grace_s=2.0).start()
        here = str(Path(__file__).resolve().parent)
        writer = python_child(_WRITER, folder, str(args.chunks), str(args.chunk_mb), here)
        try:
            assert writer.stdout is not None and writer.stdout.readline().strip() == "stored"
            node_engine = engine(folder)
            own_engine = engine(None)
            own_engine.store(prompt(), None, TransferSpec(torch.arange(TOKENS)))
            tokens = prompt()
            if node_engine.lookup(tokens) != TOKENS:
                raise RuntimeError("the writer's prompt is not found whole in the node cache")
            node_tier = node_engine.tier
            assert isinstance(node_tier, NodeTier)
            keys = chunk_keys(tokens, node_engine.metadata.fingerprint(), CS, salt="\0")
            rows = [
                (
                    "missing(128 keys), one request",
                    node_tier.missing,
                    own_engine.tier.missing,
                    keys,
                ),
            ]
            print(
                f"\nlookup of a 32k-token prompt ({len(keys)} chunk keys), ms"
                f"{'':8}node p50   p99   | per-process p50   p99   | target p99"
            )
            lookups: list[tuple[str, Callable[[], object], Callable[[], object]]] = [
                ("missing(128 keys), one request", lambda: node_tier.missing(keys),
                 lambda: own_engine.tier.missing(keys)),
                ("prefix lookup (runs 1..128)", lambda: present_prefix(keys, node_tier.missing),
                 lambda: present_prefix(keys, own_engine.tier.missing)),
                ("engine.lookup", lambda: node_engine.lookup(tokens), lambda: own_engine.lookup(tokens)),
                ("engine.lookup_and_lease", lambda: node_engine.lookup_and_lease(tokens).release(),
                 lambda: own_engine.lookup_and_lease(tokens).release()),
                ("tier.get_many(128 keys), one request", lambda: release(node_tier.get_many(keys)),
                 lambda: release([own_engine.tier.get(k) for k in keys])),
                ("get_many in runs 1..128 (8 requests)", lambda: release(in_runs(node_tier, keys)),
                 lambda: release([own_engine.tier.get(k) for k in keys])),
            ]  # fmt: skip
            for name, node_fn, own_fn in lookups:
                n50, n99 = ms(node_fn, args.repeats)
                o50, o99 = ms(own_fn, args.repeats)
                verdict = "met" if n99 < TARGET_P99_MS else "missed"
                print(f"  {name:32} {n50:7.3f} {n99:7.3f} | {o50:13.3f} {o99:7.3f} | "
                      f"{TARGET_P99_MS:.1f} ({verdict})")  # fmt: skip

            store_big(node_tier, b"mine", args.chunks, args.chunk_mb)
            private = CPUTier(HostMemoryPool(big + (16 << 20), pin=False), LMCacheMetrics())
            store_big(private, b"private", args.chunks, args.chunk_mb)
            step = int(args.chunk_mb * (1 << 20)) // 2 * 2
            src = torch.ones(
                args.chunks, step, dtype=torch.uint8
            )  # private, as large as the chunks
            dst = torch.empty(step, dtype=torch.uint8)
            reps = max(5, args.repeats // 25)

            def memcpy_all() -> tuple[int, float]:  # each chunk-sized buffer once, into dst
                start = time.perf_counter()
                for row in src:
                    dst.copy_(row)
                return src.numel(), time.perf_counter() - start

            fns: dict[str, Timed] = {"memcpy": memcpy_all}
            rows = (
                ("stored by another process (node)", node_tier, b"other"),
                ("stored by this process (node)", node_tier, b"mine"),
                ("per-process CPU tier", private, b"private"),
            )
            for name, tier, tag in rows:
                fns[name + " get"], fns[name + " copy"] = read_fns(tier, big_keys(tag, args.chunks))
            rates = interleaved_gbps(fns, reps)
            print(f"\nread of {args.chunks} chunks of {args.chunk_mb} MiB, GB/s (best of {reps} "
                  "interleaved rounds): get = lease + xxh3 verify; copy = leased bytes -> private "
                  "buffer, the copy alone")  # fmt: skip
            for name, _, _ in rows:
                print(f"  {name:34} get {rates[name + ' get']:6.2f}  copy "
                      f"{rates[name + ' copy']:6.2f}  (memcpy ceiling {rates['memcpy']:.2f})")  # fmt: skip
            node_engine.close()
            own_engine.close()
        finally:
            if writer.stdin is not None:
                writer.stdin.close()
            writer.wait(30)
            reset_process_cpu_tiers()
            owner.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
