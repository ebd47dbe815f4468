# SPDX-License-Identifier: Apache-2.0
"""``PageStore`` and the linker over a connector that verifies pages on the device.

SGLang's CUDA connector sums each page on the GPU when it stores it and verifies the sum on
the GPU when it loads it, writing only the pages that match. Here that connector is simulated
without a GPU: ``EngineInfo.device`` says ``"cuda"`` (what ``checksum_for`` reads), the pools are
CPU tensors, and the kernel path is attached by hand, its ops running as the pure-torch reference
(as in ``test_device_checksums.py``). The checks: verification is on by default, the host hashes
nothing, and a byte flipped in a CPU-tier page is caught at load, never written into the pool,
dropped from the tier, and reported as a shorter load (the linker refuses it, so SGLang
recomputes).
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import time
import types
from collections.abc import Iterator
from concurrent.futures import Future
from enum import Enum
from typing import Any

import pytest
import torch

from lmcache.config import LMCacheConfig
from lmcache.gpu_connector import EngineInfo
from lmcache.gpu_ops import chunk_checksum
from lmcache.memory import HostMemoryPool
from lmcache.metadata import LMCacheMetadata
from lmcache.metrics import LMCacheMetrics
from lmcache.tiers import CPUTier
from lmcache_sglang import page_store
from lmcache_sglang.gpu_connector import SGLangKVConnector
from lmcache_sglang.page_store import PageStore

PAGE, LAYERS, HEADS, HEAD = 4, 3, 2, 8
SLOTS = 16 * PAGE
DTYPE = torch.bfloat16
PAGE_BYTES = LAYERS * PAGE * 2 * HEADS * HEAD * DTYPE.itemsize
HASHES = [f"page-hash-{i}" for i in range(4)]


def _md() -> LMCacheMetadata:
    return LMCacheMetadata(
        model_name="m",
        world_size=1,
        worker_id=0,
        local_worker_id=0,
        local_world_size=1,
        kv_dtype=DTYPE,
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_size_k=HEAD,
        head_size_v=HEAD,
        use_mla=False,
        chunk_size=PAGE,
    )


def _pool(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's MHA device pool (per layer ``[slots, heads, head]``), random."""
    g = torch.Generator().manual_seed(seed)
    shape = (LAYERS, SLOTS, HEADS, HEAD)
    return torch.randn(shape, generator=g).to(DTYPE), torch.randn(shape, generator=g).to(DTYPE)


def _connector(
    pool: tuple[torch.Tensor, torch.Tensor], *, device: str = "cuda", kernels: bool = True
) -> SGLangKVConnector:
    """The connector over ``pool``; ``kernels``: with the device path (sums and verification)."""
    k, v = pool
    caches = [(k[i], v[i]) for i in range(LAYERS)]
    engine = EngineInfo("sglang", device, caches, {"page_size": PAGE})
    conn = SGLangKVConnector(LMCacheConfig(chunk_size=PAGE), _md(), engine, {"kv_layout": "token"})
    if kernels:
        conn.kernels = conn.kernel_transfer()
    assert conn.verifies_checksums == kernels
    return conn


def _tier() -> CPUTier:
    budget = 32 * PAGE_BYTES
    return CPUTier(HostMemoryPool(budget, pin=False, slab_bytes=budget), LMCacheMetrics())


def _store(
    conn: SGLangKVConnector, *, checksum: bool | None = None, tier: CPUTier | None = None
) -> PageStore:
    config = LMCacheConfig(chunk_size=PAGE, max_local_cpu_size=0.01, checksum=checksum)
    tier = tier if tier is not None else _tier()
    return PageStore(config, _md(), conn, tier, LMCacheMetrics(), lower_tiers=())


def _slots(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


def _rows(pool: tuple[torch.Tensor, torch.Tensor], pages: list[int]) -> torch.Tensor:
    """The canonical bytes of ``pages`` of ``pool`` (``[layers, tokens, kv_width]``, as uint8)."""
    k, v = pool
    s = _slots(pages)
    rows = torch.cat([k[:, s].reshape(LAYERS, len(s), -1), v[:, s].reshape(LAYERS, len(s), -1)], 2)
    return rows.contiguous().view(torch.uint8)


def _flip(store: PageStore, page_hash: str) -> None:
    """Flip one bit of a page's bytes in the CPU tier (its sum stays as stored)."""
    entry = store.tier._entries[store.key(page_hash)]
    entry.lease.tensor.reshape(-1).view(torch.uint8)[5] ^= 0x04


def _no_host_hashing(monkeypatch: pytest.MonkeyPatch, store: PageStore) -> None:
    def forbidden(*_: Any) -> Any:
        raise AssertionError("a page whose sum the device verifies was hashed on the host")

    monkeypatch.setattr(store.tier, "checksums", forbidden)
    monkeypatch.setattr(page_store, "chunk_checksum", forbidden)


@pytest.mark.parametrize(
    ("device", "kernels", "checksum", "expected"),
    [
        ("cuda", True, None, True),  # SGLang's CUDA pool: on by default
        ("cuda", True, False, False),  # `checksum: false` turns it off
        ("cuda", False, None, False),  # no device sums: hashing on the host would cost too much
        ("cpu", False, None, True),  # HiCache's host pool, a CPU engine
    ],
)
def test_checksums_resolve_like_the_cache_engine(
    device: str, kernels: bool, checksum: bool | None, expected: bool
) -> None:
    store = _store(_connector(_pool(0), device=device, kernels=kernels), checksum=checksum)
    assert store.tiers.checksum is expected
    assert LMCacheConfig(checksum=checksum).checksum_for(device, kernels) is expected


def test_a_store_keeps_the_device_sums(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = _pool(1)
    store = _store(_connector(pool))
    _no_host_hashing(monkeypatch, store)
    assert store.store(HASHES, _slots([1, 2, 3, 4])) == 4
    entries = [store.tier._entries[store.key(h)] for h in HASHES]
    for page, entry in zip([1, 2, 3, 4], entries, strict=True):
        assert entry.checksum is None  # nothing hashed on the host
        assert entry.lease.checksum == chunk_checksum(entry.lease.tensor)
        assert torch.equal(entry.lease.tensor.contiguous().view(torch.uint8), _rows(pool, [page]))


def test_a_flipped_byte_is_caught_at_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Held unverified, caught by the device at load: never written, dropped, load shorter."""
    pool = _pool(2)
    store = _store(_connector(pool))
    assert store.store(HASHES, _slots([1, 2, 3, 4])) == 4
    _flip(store, HASHES[2])
    _no_host_hashing(monkeypatch, store)
    held = store.hold(HASHES)
    assert len(held) == 4  # the device verifies them at load
    assert store.checks_at_load(held)
    poison = _rows(pool, [8, 9, 10, 11]).clone()
    try:
        assert store.load(held, _slots([8, 9, 10, 11])) == 2
    finally:
        held.release()
    assert torch.equal(_rows(pool, [8, 9]), _rows(pool, [1, 2]))
    bad = slice(2 * PAGE, 3 * PAGE)
    assert torch.equal(_rows(pool, [10]), poison[:, bad])  # never written
    assert store.metrics.value("checksum_failures") == 1
    assert store.metrics.value("loaded_chunks") == 2
    assert not store.tier.contains(store.key(HASHES[2]))  # dropped
    assert store.prefix_pages(HASHES) == 2


def test_checksum_false_stores_no_sums() -> None:
    """``checksum: false``: no sum is kept, so nothing is verified (the documented opt-out)."""
    pool = _pool(3)
    store = _store(_connector(pool), checksum=False)
    assert store.store(HASHES, _slots([1, 2, 3, 4])) == 4
    _flip(store, HASHES[1])
    held = store.hold(HASHES)
    assert not store.checks_at_load(held)
    try:
        assert store.load(held, _slots([8, 9, 10, 11])) == 4
    finally:
        held.release()
    assert store.metrics.value("checksum_failures") == 0


def test_a_connector_that_does_not_verify_hashes_device_sums_at_hold() -> None:
    """Pages carrying device sums, held through a connector without the device path: hashed on
    the host when held, so a bad one ends the run there and is dropped."""
    pool = _pool(4)
    tier = _tier()
    writer = _store(_connector(pool), tier=tier)
    assert writer.store(HASHES, _slots([1, 2, 3, 4])) == 4
    _flip(writer, HASHES[3])
    reader = _store(_connector(pool, kernels=False), checksum=True, tier=tier)
    held = reader.hold(HASHES)
    try:
        assert len(held) == 3 and not reader.checks_at_load(held)
        assert reader.load(held, _slots([8, 9, 10])) == 3
    finally:
        held.release()
    assert torch.equal(_rows(pool, [8, 9, 10]), _rows(pool, [1, 2, 3]))
    assert reader.metrics.value("checksum_failures") == 1
    assert not tier.contains(reader.key(HASHES[3]))


# -- the linker (SGLang's UnifiedCacheLinker) -------------------------------------------------


class _LayerWiseLoadCounter:
    """SGLang's ``LayerWiseLoadCounter`` (0.5.23), for machines without SGLang."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.producer_index = -1
        self.futures: dict[int, list[Future[None]]] = {}

    def update_producer(self) -> int:
        self.producer_index += 1
        self.futures[self.producer_index] = [Future() for _ in range(self.num_layers)]
        return self.producer_index

    def complete(self, index: int, layer: int) -> None:
        self.futures[index][layer].set_result(None)

    def fail(self, index: int, error: BaseException) -> None:
        for future in self.futures.get(index, ()):
            if not future.done():
                future.set_exception(error)

    def finish(self, index: int) -> bool:
        futures = self.futures.get(index, [])
        landed = all(f.exception(timeout=30) is None for f in futures)
        self.futures.pop(index, None)  # after the wait: the load thread completes them
        return landed

    def reset(self) -> None:
        self.futures.clear()


def _sglang_stand_ins() -> dict[str, types.ModuleType]:
    """The SGLang modules ``lmcache_sglang.linker`` imports, with the names it uses."""
    storage = types.ModuleType("sglang.srt.mem_cache.hicache_storage")
    storage.PoolName = Enum("PoolName", {"KV": "kv"}, type=str)  # type: ignore[attr-defined]

    @dataclasses.dataclass
    class PoolTransfer:
        name: Any
        host_indices: torch.Tensor | None = None
        device_indices: torch.Tensor | None = None
        keys: list[str] | None = None

    storage.PoolTransfer = PoolTransfer  # type: ignore[attr-defined]
    linker = types.ModuleType("sglang.srt.mem_cache.unified_cache.unified_cache_linker")
    linker.UnifiedCacheLinker = type("UnifiedCacheLinker", (), {})  # type: ignore[attr-defined]
    linker.LayerWiseLoadCounter = _LayerWiseLoadCounter  # type: ignore[attr-defined]
    modules = {
        name: types.ModuleType(name)
        for name in (
            "sglang",
            "sglang.srt",
            "sglang.srt.mem_cache",
            "sglang.srt.mem_cache.unified_cache",
        )
    }
    modules[storage.__name__] = storage
    modules[linker.__name__] = linker
    return modules


@pytest.fixture
def linker_module() -> Iterator[types.ModuleType]:
    """``lmcache_sglang.linker`` over SGLang when it is installed, else over stand-ins (the
    modules are put back afterwards)."""
    try:
        importlib.import_module("sglang.srt.mem_cache.unified_cache.unified_cache_linker")
    except ImportError:
        pass
    else:
        yield importlib.import_module("lmcache_sglang.linker")
        return
    stand_ins = _sglang_stand_ins()
    names = [*stand_ins, "lmcache_sglang.linker"]
    saved = {name: sys.modules.get(name) for name in names}
    sys.modules.update(stand_ins)
    sys.modules.pop("lmcache_sglang.linker", None)
    try:
        yield importlib.import_module("lmcache_sglang.linker")
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        package = sys.modules["lmcache_sglang"]
        if saved["lmcache_sglang.linker"] is None and hasattr(package, "linker"):
            delattr(package, "linker")


def _linker(module: types.ModuleType, store: PageStore, monkeypatch: pytest.MonkeyPatch) -> Any:
    """An ``LMCacheLinker`` over ``store`` (its pool's backend: the CPU, no streams)."""
    monkeypatch.setattr(module, "build_page_store", lambda *_, **__: store)
    allocator = types.SimpleNamespace(get_kvcache=lambda: types.SimpleNamespace(device="cpu"))
    params = types.SimpleNamespace(page_size=PAGE, token_to_kv_pool_allocator=allocator)
    return module.LMCacheLinker(types.SimpleNamespace(), params, extra_config={})


def _transfer(module: types.ModuleType, hashes: list[str], pages: list[int] | None) -> Any:
    slots = _slots(pages) if pages is not None else None
    return [module.PoolTransfer(name=module.PoolName.KV, device_indices=slots, keys=hashes)]


def _offload(module: types.ModuleType, linker: Any, hashes: list[str], pages: list[int]) -> None:
    assert linker.offload(_transfer(module, hashes, pages))
    deadline = time.monotonic() + 30
    while linker.num_completed_offloads() < 1:
        assert time.monotonic() < deadline, "the offload never completed"
        time.sleep(0.01)
    assert linker.pop_completed_offload() is True


def test_the_linker_refuses_a_load_whose_page_fails_on_the_device(
    linker_module: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = _pool(5)
    store = _store(_connector(pool))
    linker = _linker(linker_module, store, monkeypatch)
    try:
        _offload(linker_module, linker, HASHES, [1, 2, 3, 4])
        _flip(store, HASHES[2])
        _no_host_hashing(monkeypatch, store)
        assert linker.lookup("r1", _transfer(linker_module, HASHES, None)) == [1, 2, 3, 4]
        poison = _rows(pool, [8, 9, 10, 11]).clone()
        assert linker.load("r1", _transfer(linker_module, HASHES, [8, 9, 10, 11])) is False
        assert linker.stats["refused_loads"] == 1
        bad = slice(2 * PAGE, 3 * PAGE)
        assert torch.equal(_rows(pool, [10]), poison[:, bad])  # never written
        assert store.metrics.value("checksum_failures") == 1
        assert linker.start_layer_wise_loading() == -1  # nothing was queued
        # the bad page left the tier: SGLang's next lookup finds the two pages before it
        assert linker.lookup("r2", _transfer(linker_module, HASHES, None)) == [1, 2]
        assert linker.load("r2", _transfer(linker_module, HASHES[:2], [12, 13])) is True
        assert torch.equal(_rows(pool, [12, 13]), _rows(pool, [1, 2]))  # copied at load
        index = linker.start_layer_wise_loading()
        assert index >= 0 and linker.finish_layer_wise_loading(index) is True
    finally:
        linker.close()


def test_the_linker_batches_verified_and_layerwise_loads(
    linker_module: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pages with device sums are copied at ``load``; pages without (stored with ``put_page``:
    hashed and verified on the host) are copied by the load thread, in the same batch."""
    pool = _pool(6)
    store = _store(_connector(pool))
    linker = _linker(linker_module, store, monkeypatch)
    try:
        _offload(linker_module, linker, HASHES[:2], [1, 2])
        other = ["other-0", "other-1"]
        for h, page in zip(other, [3, 4], strict=True):
            assert store.put_page(h, _rows(pool, [page]).view(DTYPE).clone())
        assert linker.load("a", _transfer(linker_module, HASHES[:2], [8, 9]))
        assert linker.load("b", _transfer(linker_module, other, [10, 11]))
        assert torch.equal(_rows(pool, [8, 9]), _rows(pool, [1, 2]))
        index = linker.start_layer_wise_loading()
        assert linker.finish_layer_wise_loading(index) is True
        assert torch.equal(_rows(pool, [10, 11]), _rows(pool, [3, 4]))
        assert linker.stats["loaded_pages"] == 4
    finally:
        linker.close()
