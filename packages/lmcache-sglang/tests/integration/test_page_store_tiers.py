# SPDX-License-Identifier: Apache-2.0
"""``PageStore`` over lmcache's lower tiers: a real ``DiskTier`` and a real ``RedisTier``.

The pages are moved from and into real SGLang device pools (``MHATokenToKVPool(device="cpu")``)
with the connector the linker builds, keyed by SGLang's own page hashes. A "restart" is a fresh
CPU tier plus new disk / Redis tier objects (the disk tier rebuilds its index from the folder):
pages then come back from below the CPU tier, bit-exact. Redis tests start a real
``redis-server`` on a free port (skipped, with the reason, where none is installed).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.utils import get_hash_str

from lmcache.config import LMCacheConfig
from lmcache.gpu_connector import CreateGPUConnector
from lmcache.memory import HostMemoryPool
from lmcache.metrics import LMCacheMetrics
from lmcache.testing.redis_server import RedisServer, redis_server_path
from lmcache.tiers import CPUTier, LowerTier
from lmcache.tiers.disk.tier import DiskTier
from lmcache.tiers.redis.tier import RedisTier
from lmcache_sglang.kv_pools import build_metadata, device_pool_layers
from lmcache_sglang.page_store import PageStore
from lmcache_sglang.testing import make_prompt

PAGE = 16
LAYERS, HEADS, HEAD_DIM = 3, 2, 64
DTYPE = torch.bfloat16
PAGE_BYTES = LAYERS * PAGE * HEADS * HEAD_DIM * 2 * DTYPE.itemsize
MODEL = "/models/tiny-llama"

LowerFactory = Callable[[], list[LowerTier]]


def _pool(seed: int | None) -> Any:
    """A real SGLang device pool on the CPU, random (``seed``) or NaN-poisoned (``None``)."""
    pool = MHATokenToKVPool(
        size=512,
        page_size=PAGE,
        dtype=DTYPE,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
        start_layer=0,
        end_layer=LAYERS,
    )
    gen = torch.Generator().manual_seed(seed or 0)
    for buf in (*pool.k_buffer, *pool.v_buffer):
        if seed is None:
            buf.fill_(float("nan"))
        else:
            buf.copy_(torch.randn(buf.shape, generator=gen).to(DTYPE))
    return pool


def _slots(pages: Sequence[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages] or [torch.arange(0)])


def _hashes(num_pages: int, seed: int) -> list[str]:
    """SGLang's own page hashes of a random prompt (SHA-256 chained over pages)."""
    hashes = get_hash_str(make_prompt(num_pages * PAGE, seed), None, page_size=PAGE)
    assert isinstance(hashes, list) and len(hashes) == num_pages
    return hashes


class Rig:
    """One "process": a fresh CPU tier, the given lower tiers and a page store over ``pool``."""

    def __init__(
        self,
        pool: Any,
        lower: Sequence[LowerTier],
        *,
        local_cpu: bool = True,
        salt: str = "",
        namespace: str = "pp0of1",
        model: str = MODEL,
        cpu_pages: int = 32,
    ) -> None:
        self.pool = pool
        self.metrics = LMCacheMetrics()
        budget = cpu_pages * PAGE_BYTES
        self.cpu = CPUTier(HostMemoryPool(budget, pin=False, slab_bytes=budget), self.metrics)
        config = LMCacheConfig(
            chunk_size=PAGE, local_cpu=local_cpu, max_local_cpu_size=0.01, cache_salt=salt
        )
        layers = device_pool_layers(pool, PAGE)
        metadata = build_metadata(layers, model_name=model, page_size=PAGE, world_size=1, rank=0)
        connector = CreateGPUConnector(
            config, metadata, layers.engine_info(PAGE), layers.layout_hints
        )
        self.store = PageStore(
            config, metadata, connector, self.cpu, self.metrics, namespace, lower_tiers=lower
        )

    def save(self, hashes: Sequence[str], pages: Sequence[int]) -> int:
        stored = self.store.store(hashes, _slots(pages))
        assert self.store.flush(30)
        return stored

    def load(self, hashes: Sequence[str], pages: Sequence[int]) -> int:
        """Hold and load the longest stored prefix into ``pages``; returns pages loaded."""
        held = self.store.hold(hashes)
        try:
            self.store.load(held, _slots(pages[: len(held)]))
            return len(held)
        finally:
            held.release()

    def metric(self, name: str) -> float:
        return self.metrics.value(name)


def _same(src: Any, src_pages: Sequence[int], dst: Any, dst_pages: Sequence[int]) -> bool:
    """Bit-exact equality of the K and V of ``src_pages`` and ``dst_pages``, every layer."""
    a, b = _slots(src_pages), _slots(dst_pages)
    return all(
        torch.equal(s[a].view(torch.int16), d[b].view(torch.int16))
        for s, d in zip((*src.k_buffer, *src.v_buffer), (*dst.k_buffer, *dst.v_buffer), strict=True)
    )


def _untouched(dst: Any, pages: Sequence[int]) -> bool:
    if not pages:
        return True
    rows = _slots(pages)
    return all(bool(t[rows].isnan().all()) for t in (*dst.k_buffer, *dst.v_buffer))


# ------------------------------------------------------------------ fixtures


@pytest.fixture
def disk_dir(tmp_path: Path) -> Path:
    return tmp_path / "disk"


def _disk(folder: Path, pages: int = 64) -> DiskTier:
    return DiskTier(str(folder), pages * (PAGE_BYTES + 4096), fsync=False)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    if redis_server_path() is None:
        pytest.skip("no redis-server or valkey-server on PATH (apt-get install redis-server)")
    with RedisServer() as server:
        yield server


def _closing(tiers: list[LowerTier], opened: list[LowerTier]) -> list[LowerTier]:
    opened.extend(tiers)
    return tiers


@pytest.fixture
def opened() -> Iterator[list[LowerTier]]:
    """Lower tiers a test opened, closed at its end."""
    tiers: list[LowerTier] = []
    yield tiers
    for tier in tiers:
        tier.close()


# ------------------------------------------------------------------ restarts


@pytest.mark.parametrize("kind", ["disk", "redis"])
def test_pages_survive_a_restart_bit_exact(
    kind: str, disk_dir: Path, request: pytest.FixtureRequest, opened: list[LowerTier]
) -> None:
    if kind == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")

        def lower() -> list[LowerTier]:
            return _closing([RedisTier(server.url, timeout=5.0)], opened)

    else:

        def lower() -> list[LowerTier]:
            return _closing([_disk(disk_dir)], opened)

    hit_metric = "disk_hit_chunks" if kind == "disk" else "remote_hit_chunks"
    src = _pool(seed=1)
    hashes = _hashes(5, seed=1)
    first = Rig(src, lower())
    assert first.save(hashes, [3, 7, 1, 12, 5]) == 5
    assert first.metric(f"{'disk' if kind == 'disk' else 'remote'}_stored_chunks") == 5

    dst = _pool(seed=None)
    second = Rig(dst, lower())  # restart: empty CPU tier, new tier objects
    assert len(second.cpu) == 0
    assert second.store.prefix_pages(hashes) == 5
    assert second.store.contains(hashes[4])
    assert second.load(hashes, [20, 21, 22, 23, 24]) == 5
    assert _same(src, [3, 7, 1, 12, 5], dst, [20, 21, 22, 23, 24])
    assert second.metric(hit_metric) == 5
    assert len(second.cpu) == 5  # promoted: the next hold is served from host memory
    assert second.load(hashes, [25, 26, 27, 28, 29]) == 5
    assert second.metric(hit_metric) == 5
    assert _same(src, [3, 7, 1, 12, 5], dst, [25, 26, 27, 28, 29])


def test_longest_prefix_spans_cpu_disk_and_redis(
    disk_dir: Path, redis_server: RedisServer, opened: list[LowerTier]
) -> None:
    """Page 0 in the CPU tier, page 1 on disk only, pages 2-3 in Redis only: one 4-page hit."""

    def lower() -> list[LowerTier]:
        return _closing([_disk(disk_dir), RedisTier(redis_server.url, timeout=5.0)], opened)

    src = _pool(seed=2)
    hashes = _hashes(4, seed=2)
    first = Rig(src, lower())
    assert first.save(hashes, [1, 2, 3, 4]) == 4
    for h in hashes[2:]:  # the disk loses the tail; Redis still has it
        (disk_dir / first.store.tiers.fp_digest.hex() / f"{first.store.key(h).hex()}.lmc").unlink()

    dst = _pool(seed=None)
    second = Rig(dst, lower())
    assert second.load(hashes[:1], [10]) == 1  # page 0 read from disk, promoted to the CPU tier
    assert second.cpu.contains(second.store.key(hashes[0]))
    assert second.store.prefix_pages(hashes) == 4
    assert second.load(hashes, [10, 11, 12, 13]) == 4
    assert _same(src, [1, 2, 3, 4], dst, [10, 11, 12, 13])
    assert second.metric("disk_hit_chunks") == 2  # page 0 (first hold), page 1
    assert second.metric("remote_hit_chunks") == 2  # pages 2 and 3


# ------------------------------------------------------------------ integrity


def test_corrupt_disk_page_is_a_miss(disk_dir: Path, opened: list[LowerTier]) -> None:
    src = _pool(seed=3)
    hashes = _hashes(4, seed=3)
    first = Rig(src, _closing([_disk(disk_dir)], opened))
    assert first.save(hashes, [1, 2, 3, 4]) == 4
    path = disk_dir / first.store.tiers.fp_digest.hex() / f"{first.store.key(hashes[2]).hex()}.lmc"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10  # one bit of the payload
    path.write_bytes(bytes(data))

    dst = _pool(seed=None)
    second = Rig(dst, _closing([_disk(disk_dir)], opened))
    assert second.store.prefix_pages(hashes) == 4  # a lookup does not read the bytes
    assert second.load(hashes, [10, 11, 12, 13]) == 2  # pages 0 and 1 only
    assert _same(src, [1, 2], dst, [10, 11])
    assert _untouched(dst, [12, 13])  # never the flipped bits
    assert second.metric("checksum_failures") == 1
    assert not path.exists()  # the bad entry is deleted
    assert second.store.prefix_pages(hashes) == 2


def test_swapped_redis_values_are_a_miss(
    redis_server: RedisServer, opened: list[LowerTier]
) -> None:
    import redis

    src = _pool(seed=4)
    hashes = _hashes(3, seed=4)
    tier = _closing([RedisTier(redis_server.url, timeout=5.0)], opened)[0]
    first = Rig(src, [tier])
    assert first.save(hashes, [1, 2, 3]) == 3
    digest = first.store.tiers.fp_digest
    a, b = (tier._name(digest, first.store.key(h)) for h in hashes[1:])  # type: ignore[attr-defined]
    client = redis.Redis.from_url(redis_server.url)
    va, vb = client.get(a), client.get(b)
    client.set(a, vb)
    client.set(b, va)
    client.close()

    dst = _pool(seed=None)
    second = Rig(dst, _closing([RedisTier(redis_server.url, timeout=5.0)], opened))
    assert second.load(hashes, [10, 11, 12]) == 1
    assert _same(src, [1], dst, [10]) and _untouched(dst, [11, 12])
    assert second.metric("checksum_failures") == 1


# ------------------------------------------------------------------ isolation


def test_salts_and_namespaces_are_isolated_on_disk(disk_dir: Path, opened: list[LowerTier]) -> None:
    src = _pool(seed=5)
    hashes = _hashes(3, seed=5)
    owner = Rig(src, _closing([_disk(disk_dir)], opened), salt="tenant-1")
    assert owner.save(hashes, [1, 2, 3]) == 3
    for other in (
        {"salt": "tenant-2"},
        {"salt": "tenant-1", "namespace": "pp1of2"},
        {"salt": "tenant-1", "model": "/models/another-model"},
    ):
        dst = _pool(seed=None)
        rig = Rig(dst, _closing([_disk(disk_dir)], opened), **other)  # type: ignore[arg-type]
        assert rig.store.prefix_pages(hashes) == 0, other
        assert rig.load(hashes, [10, 11, 12]) == 0, other
        assert _untouched(dst, [10, 11, 12])
    dst = _pool(seed=None)
    same = Rig(dst, _closing([_disk(disk_dir)], opened), salt="tenant-1")
    assert same.load(hashes, [10, 11, 12]) == 3
    assert _same(src, [1, 2, 3], dst, [10, 11, 12])


def test_redis_namespaces_and_salts_are_isolated(
    redis_server: RedisServer, opened: list[LowerTier]
) -> None:
    src = _pool(seed=6)
    hashes = _hashes(2, seed=6)

    def tier(namespace: str) -> list[LowerTier]:
        return _closing([RedisTier(redis_server.url, namespace=namespace, timeout=5.0)], opened)

    assert Rig(src, tier("team-a"), salt="s").save(hashes, [1, 2]) == 2
    assert Rig(_pool(None), tier("team-b"), salt="s").store.prefix_pages(hashes) == 0
    assert Rig(_pool(None), tier("team-a"), salt="t").store.prefix_pages(hashes) == 0
    dst = _pool(seed=None)
    assert Rig(dst, tier("team-a"), salt="s").load(hashes, [5, 6]) == 2
    assert _same(src, [1, 2], dst, [5, 6])


# ------------------------------------------------------------------ local_cpu: false


def test_local_cpu_false_only_stages(disk_dir: Path, opened: list[LowerTier]) -> None:
    src = _pool(seed=7)
    hashes = _hashes(4, seed=7)
    rig = Rig(src, _closing([_disk(disk_dir)], opened), local_cpu=False)
    assert rig.save(hashes, [1, 2, 3, 4]) == 4
    assert rig.metric("disk_stored_chunks") == 4
    assert len(rig.cpu) == 0 and rig.cpu.pool.used_bytes == 0
    assert rig.save(hashes, [1, 2, 3, 4]) == 4  # every page is on disk: nothing staged again
    assert rig.metric("stored_chunks") == 4 and rig.metric("disk_stored_chunks") == 4
    # One flat page through put_page: staged and written through as well.
    extra = _hashes(5, seed=7)[4]
    page = torch.randn(LAYERS, PAGE, 2 * HEADS * HEAD_DIM).to(DTYPE)
    assert rig.store.put_page(extra, page)
    assert rig.store.flush(30)
    assert rig.store.prefix_pages([*hashes, extra]) == 5

    dst = _pool(seed=None)
    fresh = Rig(dst, _closing([_disk(disk_dir)], opened), local_cpu=False)
    assert fresh.load(hashes, [10, 11, 12, 13]) == 4
    assert _same(src, [1, 2, 3, 4], dst, [10, 11, 12, 13])
    assert len(fresh.cpu) == 0 and fresh.cpu.pool.used_bytes == 0  # nothing kept, all released
    held = fresh.store.hold([extra])
    try:
        assert len(held) == 1 and torch.equal(held.leases[0].tensor, page)
    finally:
        held.release()


def test_local_cpu_false_without_lower_tiers_stores_nothing() -> None:
    rig = Rig(_pool(seed=8), [], local_cpu=False)
    hashes = _hashes(2, seed=8)
    assert rig.store.store(hashes, _slots([1, 2])) == 0
    assert rig.store.prefix_pages(hashes) == 0 and rig.metric("stored_chunks") == 0


# ------------------------------------------------------------------ clear, failures


def test_clear_drops_this_model_from_every_tier(disk_dir: Path, opened: list[LowerTier]) -> None:
    hashes = _hashes(3, seed=9)
    mine = Rig(_pool(seed=9), _closing([_disk(disk_dir)], opened))
    theirs = Rig(_pool(seed=10), mine.store.lower_tiers, model="/models/another-model", cpu_pages=8)
    assert mine.save(hashes, [1, 2, 3]) == 3
    assert theirs.save(hashes, [1, 2, 3]) == 3
    mine.store.clear()
    assert mine.store.prefix_pages(hashes) == 0 and len(mine.cpu) == 0
    fresh = Rig(_pool(seed=None), _closing([_disk(disk_dir)], opened))
    assert fresh.store.prefix_pages(hashes) == 0
    other = Rig(_pool(seed=None), fresh.store.lower_tiers, model="/models/another-model")
    assert other.store.prefix_pages(hashes) == 3  # another model's pages stay


def test_a_stopped_redis_server_is_a_miss(
    redis_server: RedisServer, opened: list[LowerTier]
) -> None:
    src = _pool(seed=11)
    hashes = _hashes(3, seed=11)
    tier = _closing([RedisTier(redis_server.url, timeout=0.5, breaker_cooldown=60.0)], opened)
    rig = Rig(src, tier)
    redis_server.stop()
    assert rig.save(hashes, [1, 2, 3]) == 3  # the CPU tier keeps them
    dst = _pool(seed=None)
    assert rig.store.prefix_pages(hashes) == 3
    rig_load = Rig(dst, tier)  # an empty CPU tier: only the (dead) server could have them
    assert rig_load.store.prefix_pages(hashes) == 0
    assert rig_load.load(hashes, [10, 11, 12]) == 0
    assert _untouched(dst, [10, 11, 12])
    assert rig.metric("tier_errors") + rig_load.metric("tier_errors") > 0
