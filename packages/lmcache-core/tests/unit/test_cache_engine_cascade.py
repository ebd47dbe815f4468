# SPDX-License-Identifier: Apache-2.0
"""LMCacheEngine over CPU -> disk -> Redis: longest prefix across tiers, promotion, restarts,
write-through, integrity, salts, ``local_cpu: false`` and failing tiers.

Real tiers only: a :class:`DiskTier` in ``tmp_path`` and a :class:`RedisTier` on a real
``redis-server`` (skipped with the reason where none is installed). Engines use the paged CPU
connector with one-token pages; loads go into a NaN-poisoned cache and are compared bit for bit
with the source cache the chunks were stored from.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from lmcache.cache_engine import LMCacheEngine
from lmcache.config import LMCacheConfig
from lmcache.gpu_connector.interface import EngineInfo, TransferSpec
from lmcache.memory import HostMemoryPool
from lmcache.metadata import LMCacheMetadata
from lmcache.metrics import LMCacheMetrics
from lmcache.testing import PagedCPUConnector
from lmcache.testing.redis_server import RedisServer, redis_server_path
from lmcache.tiers import CPUTier, LowerTier
from lmcache.tiers.disk.tier import DiskTier
from lmcache.tiers.redis.tier import RedisTier

CS = 4
LAYERS, HEADS, HEAD = 2, 2, 4
WIDTH = HEADS * HEAD * 2
SLOTS = 256
DTYPE = torch.bfloat16
CHUNK_BYTES = LAYERS * CS * WIDTH * 2

needs_redis = pytest.mark.skipif(
    redis_server_path() is None,
    reason="no redis-server or valkey-server on PATH (apt-get install redis-server)",
)


def _cpu_tier(chunks: int = 64) -> CPUTier:
    pool = HostMemoryPool(chunks * CHUNK_BYTES, pin=False, slab_bytes=chunks * CHUNK_BYTES)
    return CPUTier(pool, LMCacheMetrics())


def _prompt(prompt: int, chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = chunks * CS
    tokens = torch.randint(0, 50_000, (n,), generator=torch.Generator().manual_seed(100 + prompt))
    return tokens, torch.arange(prompt * 32, prompt * 32 + n)


class Rig:
    """An engine over a private CPU tier and the given lower tiers; ``src`` is its KV."""

    def __init__(
        self,
        lower: Sequence[LowerTier],
        *,
        local_cpu: bool = True,
        model: str = "test/model",
        cpu_chunks: int = 64,
        salt: str = "",
    ) -> None:
        self.config = LMCacheConfig(
            chunk_size=CS, local_cpu=local_cpu, max_local_cpu_size=1.0, cache_salt=salt
        )
        self.metadata = LMCacheMetadata(
            model, 1, 0, 0, 1, DTYPE, LAYERS, HEADS, HEAD, HEAD, chunk_size=CS
        )
        gen = torch.Generator().manual_seed(7)
        self.src = [torch.randn(SLOTS, 1, WIDTH, generator=gen).to(DTYPE) for _ in range(LAYERS)]
        self.tier = _cpu_tier(cpu_chunks)
        self.engine = LMCacheEngine(
            self.config,
            self.metadata,
            self._connector(self.src),
            tier=self.tier,
            lower_tiers=lower,
        )

    def _connector(self, caches: list[torch.Tensor]) -> PagedCPUConnector:
        info = EngineInfo("mock", "cpu", caches, extra={"page_size": 1})
        return PagedCPUConnector(self.config, self.metadata, info)

    def store(self, prompt: int, chunks: int) -> int:
        tokens, slots = _prompt(prompt, chunks)
        stored = self.engine.store(tokens, None, TransferSpec(slots))
        for lower in self.engine.lower_tiers:
            assert lower.flush(30)
        return stored

    def lookup(self, prompt: int, chunks: int) -> int:
        return self.engine.lookup(_prompt(prompt, chunks)[0])

    def load(self, prompt: int, chunks: int, *, held: bool = False) -> tuple[int, bool]:
        """Retrieve into a poisoned cache: (tokens loaded, loaded bits equal src's)."""
        tokens, slots = _prompt(prompt, chunks)
        dst = [torch.full((SLOTS, 1, WIDTH), float("nan"), dtype=DTYPE) for _ in range(LAYERS)]
        self.engine.set_gpu_connector(self._connector(dst))
        try:
            hit = self.engine.lookup_and_lease(tokens) if held else None
            loaded = self.engine.retrieve(tokens, None, TransferSpec(slots), held=hit)
            if hit is not None:
                assert hit.num_tokens == int(loaded.sum())
                hit.release()
        finally:
            self.engine.set_gpu_connector(self._connector(self.src))
        n = int(loaded.sum())
        rows = slots[:n]
        exact = all(
            torch.equal(d[rows].view(torch.int16), s[rows].view(torch.int16))
            for d, s in zip(dst, self.src, strict=True)
        )
        untouched = all(bool(d[slots[n:]].isnan().all()) for d in dst)
        return n, exact and untouched

    def metric(self, name: str) -> float:
        return self.engine.metrics.value(name)


@pytest.fixture
def disk_dir(tmp_path: Path) -> Path:
    return tmp_path / "disk"


def _disk(folder: Path, chunks: int = 64) -> DiskTier:
    return DiskTier(str(folder), chunks * (CHUNK_BYTES + 4096))


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    if redis_server_path() is None:
        pytest.skip("no redis-server or valkey-server on PATH (apt-get install redis-server)")
    with RedisServer() as server:
        yield server.url


# ------------------------------------------------------------------ disk


@pytest.mark.parametrize("held", [False, True])
def test_restart_hits_from_disk_bit_exact_and_promotes(disk_dir: Path, held: bool) -> None:
    first = Rig([_disk(disk_dir)])
    assert first.store(0, 5) == 5 * CS
    assert first.metric("disk_stored_chunks") == 5
    # A restart: new CPU tier (empty), new disk tier instance rebuilding its index.
    second = Rig([_disk(disk_dir)])
    assert len(second.tier) == 0
    assert second.lookup(0, 5) == 5 * CS
    assert second.load(0, 5, held=held) == (5 * CS, True)
    assert second.metric("disk_hit_chunks") == 5
    assert len(second.tier) == 5  # promoted: the next load is served from host memory
    assert second.load(0, 5) == (5 * CS, True)
    assert second.metric("disk_hit_chunks") == 5


def test_longest_prefix_spans_tiers(disk_dir: Path) -> None:
    rig = Rig([_disk(disk_dir)], cpu_chunks=4)
    assert rig.store(0, 3) == 3 * CS  # on disk and in the CPU tier
    assert rig.store(1, 2) == 2 * CS  # evicts prompt 0's tail (chunk 2) from the CPU tier
    keys = rig.engine._plan(_prompt(0, 3)[0], None, None, "").keys
    assert [rig.tier.contains(k) for k in keys] == [True, True, False]
    assert rig.lookup(0, 3) == 3 * CS  # chunks 0-1 from host memory, chunk 2 from disk
    assert rig.load(0, 3, held=True) == (3 * CS, True)
    assert rig.metric("disk_hit_chunks") == 1


def test_disk_eviction_keeps_prefixes(disk_dir: Path) -> None:
    """A full disk evicts a prompt's tail before its head (a written run is marked used tail first)."""
    rig = Rig([_disk(disk_dir, chunks=3)])
    rig.store(0, 3)
    rig.store(1, 1)  # the quota holds 3 chunks: one of prompt 0's must go
    fresh = Rig([_disk(disk_dir, chunks=3)])  # restart: CPU tier empty
    assert fresh.lookup(0, 3) == 2 * CS  # chunks 0 and 1 remain: the tail was evicted
    assert fresh.load(0, 3) == (2 * CS, True)


def test_cpu_off_only_stages(disk_dir: Path) -> None:
    rig = Rig([_disk(disk_dir)], local_cpu=False)
    assert rig.store(0, 4) == 4 * CS
    assert len(rig.tier) == 0 and rig.tier.pool.used_bytes == 0
    assert rig.store(0, 4) == 0  # every lower tier holds them: nothing to stage again
    assert rig.load(0, 4, held=True) == (4 * CS, True)
    assert len(rig.tier) == 0 and rig.tier.pool.used_bytes == 0


def test_corrupt_disk_chunk_ends_the_hit(disk_dir: Path) -> None:
    Rig([_disk(disk_dir)]).store(0, 4)
    files = sorted(p for p in disk_dir.rglob("*.lmc") if p.is_file())
    assert len(files) == 4, files
    rig = Rig([_disk(disk_dir)])
    keys = rig.engine._plan(_prompt(0, 4)[0], None, None, "").keys
    third = next(p for p in files if keys[2].hex() in p.name)
    data = bytearray(third.read_bytes())
    data[-1] ^= 0x04
    third.write_bytes(bytes(data))
    assert rig.load(0, 4) == (2 * CS, True)  # chunks 0 and 1 only: never the flipped bits
    assert rig.metric("checksum_failures") == 1
    assert not third.exists()


def test_salts_are_isolated_in_lower_tiers(disk_dir: Path) -> None:
    Rig([_disk(disk_dir)], salt="tenant-a").store(0, 3)
    assert Rig([_disk(disk_dir)], salt="tenant-b").load(0, 3) == (0, True)
    assert Rig([_disk(disk_dir)]).load(0, 3) == (0, True)
    assert Rig([_disk(disk_dir)], salt="tenant-a").load(0, 3) == (3 * CS, True)


def test_clear_drops_only_this_models_lower_entries(disk_dir: Path) -> None:
    disk = _disk(disk_dir)
    a, b = Rig([disk], model="model/a"), Rig([disk], model="model/b")
    a.store(0, 2)
    b.store(0, 2)
    a.engine.clear()
    assert Rig([_disk(disk_dir)], model="model/a").lookup(0, 2) == 0
    assert Rig([_disk(disk_dir)], model="model/b").load(0, 2) == (2 * CS, True)


def test_other_models_entries_are_never_served(disk_dir: Path) -> None:
    disk = _disk(disk_dir)
    Rig([disk], model="model/a").store(0, 2)
    assert Rig([disk], model="model/b").load(0, 2) == (0, True)


def test_full_write_queue_drops_and_store_returns(disk_dir: Path) -> None:
    disk = DiskTier(str(disk_dir), 64 * (CHUNK_BYTES + 4096), write_queue_bytes=1)
    rig = Rig([disk])
    tokens, slots = _prompt(0, 6)
    assert rig.engine.store(tokens, None, TransferSpec(slots)) == 6 * CS  # the CPU tier has them
    assert disk.flush(30)
    dropped = rig.metric("dropped_writes")
    assert dropped >= 1 and dropped + rig.metric("disk_stored_chunks") == 6
    assert rig.load(0, 6) == (6 * CS, True)


# ------------------------------------------------------------------ Redis and the cascade


@needs_redis
def test_disk_then_redis_cascade(disk_dir: Path, redis_url: str) -> None:
    writer = Rig([_disk(disk_dir), RedisTier(redis_url)])
    writer.store(0, 4)
    assert writer.metric("remote_stored_chunks") == 4
    # Another machine: no disk folder of its own, the same Redis.
    other = Rig([_disk(disk_dir.parent / "other-disk"), RedisTier(redis_url)])
    assert other.lookup(0, 4) == 4 * CS
    assert other.load(0, 4, held=True) == (4 * CS, True)
    assert other.metric("remote_hit_chunks") == 4 and other.metric("disk_hit_chunks") == 0


@needs_redis
def test_redis_only_staging_and_salts(redis_url: str) -> None:
    Rig([RedisTier(redis_url)], local_cpu=False, salt="a").store(0, 3)
    assert Rig([RedisTier(redis_url)], local_cpu=False, salt="b").load(0, 3) == (0, True)
    rig = Rig([RedisTier(redis_url)], local_cpu=False, salt="a")
    assert rig.load(0, 3, held=True) == (3 * CS, True)
    assert len(rig.tier) == 0


def test_unreachable_redis_is_a_miss_not_an_error() -> None:
    rig = Rig([RedisTier("redis://127.0.0.1:1", timeout=0.2)])
    assert rig.store(0, 2) == 2 * CS  # the CPU tier still stores
    assert rig.load(0, 2) == (2 * CS, True)
    other = Rig([RedisTier("redis://127.0.0.1:1", timeout=0.2)])
    assert other.lookup(0, 2) == 0 and other.load(0, 2, held=True) == (0, True)
    assert other.metric("tier_errors") >= 1
