# SPDX-License-Identifier: Apache-2.0
"""lmcache's HiCache storage backend driven with real SGLang objects on the CPU.

HiCache's device<->host copies are CUDA-only, so the engine cannot run it end to end here. These
tests build what SGLang builds: ``MHATokenToKVPool(device="cpu")`` / ``MLATokenToKVPool`` device
pools, ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` host pools (``pin_memory=False``) in
every host layout, the backend through ``StorageBackendFactory.create_backend("dynamic", ...)``,
and page keys from SGLang's own page hash. The oracle is SGLang's own ``get_data_page``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str

from lmcache.config import ConfigError
from lmcache.tiers import reset_process_cpu_tiers
from lmcache_sglang.testing import make_prompt

PAGE = 16
LAYERS = 3
LAYOUTS = ("layer_first", "page_first", "page_first_direct")
MODEL = "/models/tiny-llama"
BACKEND = {
    "backend_name": "lmcache",
    "module_path": "lmcache_sglang.hicache_backend",
    "class_name": "LMCacheHiCacheStorage",
    "interface_v1": 1,
    "max_local_cpu_size": 0.0625,
}


@pytest.fixture(autouse=True)
def _fresh_tier() -> Iterator[None]:
    reset_process_cpu_tiers()
    yield
    reset_process_cpu_tiers()


def _device_pool(mla: bool) -> Any:
    common = dict(
        size=512,
        page_size=PAGE,
        dtype=torch.bfloat16,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
        start_layer=0,
        end_layer=LAYERS,
    )
    if mla:
        return MLATokenToKVPool(kv_lora_rank=32, qk_rope_head_dim=16, **common)
    return MHATokenToKVPool(head_num=2, head_dim=64, **common)


def _host_pool(device: Any, layout: str) -> Any:
    capacity = device.size if device.host_capacity_tokens is None else device.host_capacity_tokens
    info = device.get_device_pool_infos()[0].buffer_info
    common = dict(
        device_capacity_tokens=capacity,
        start_layer=device.start_layer,
        end_layer=device.end_layer,
        page_size=PAGE,
        layout=layout,
        pin_memory=False,
    )
    if isinstance(device, MLATokenToKVPool):
        return MLATokenToKVPoolHost(
            info,
            target_layer_num=device.layer_num,
            override_kv_cache_dim=device.kv_cache_dim,
            host_to_device_ratio=2,
            host_size=0,
            **common,
        )
    return MHATokenToKVPoolHost(
        info, 2, 0, write_back_staging=device.hicache_write_back_staging, **common
    )


def _backend(
    host: Any,
    *,
    mla: bool,
    model: str = MODEL,
    tp_rank: int = 0,
    tp_size: int = 1,
    pools: Mapping[Any, Any] | None = None,
    **extra: Any,
) -> Any:
    """The backend SGLang attaches to the host KV pool ``host``.

    With ``pools`` (SGLang's ``PoolName`` to host pool) it is registered as a hybrid model's
    ``HybridCacheController.attach_storage_backend`` does: ``host`` as ``PoolName.KV``, then
    every pool of ``pools``.
    """
    config = HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=host.layout != "layer_first",
        model_name=model,
        extra_config={**BACKEND, **extra},
    )
    backend = StorageBackendFactory.create_backend("dynamic", config, host)
    backend.register_mem_pool_host(host)
    if pools is not None:  # HiCache v2's pool API, which dense callers need not have
        from sglang.srt.mem_cache.hicache_storage import PoolName

        backend.register_mem_host_pool_v2(host, PoolName.KV)
        for name, pool in pools.items():
            backend.register_mem_host_pool_v2(pool, name)
        backend.on_host_pools_registered()
    return backend


def _keys(num_pages: int, seed: int) -> list[str]:
    """SGLang's own page hashes of a random prompt (SHA-256 chained over pages)."""
    keys = get_hash_str(make_prompt(num_pages * PAGE, seed), None, page_size=PAGE)
    assert isinstance(keys, list) and len(keys) == num_pages
    return keys


def _random_fill(host: Any) -> None:
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape).to(host.kv_buffer.dtype))


def _indices(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


def _canonical_page(host: Any, page: int) -> torch.Tensor:
    """SGLang's ``get_data_page`` of a host page as ``[(2,) layers, page_size, heads, dim]``."""
    data = host.get_data_page(page * PAGE, flat=False)
    mla = isinstance(host, MLATokenToKVPoolHost)
    lead = () if mla else (slice(None),)
    if host.layout == "page_first":  # [(2,) ps, L, H, D]
        return data.transpose(len(lead), len(lead) + 1)
    if host.layout == "page_first_direct":  # [(2,) 1, L, ps, H, D]
        return data[(*lead, 0)]
    return data  # layer_first: [(2,) L, ps, H, D]


def _assert_pages_equal(src: Any, src_pages: list[int], dst: Any, dst_pages: list[int]) -> None:
    for s, d in zip(src_pages, dst_pages, strict=True):
        a, b = _canonical_page(src, s), _canonical_page(dst, d)
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), (
            f"host page {s} ({src.layout}) -> page {d} ({dst.layout}) differs"
        )


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_zero_copy_round_trip_bit_exact(layout: str, mla: bool) -> None:
    device = _device_pool(mla)
    src, dst = _host_pool(device, layout), _host_pool(device, layout)
    _random_fill(src)
    _random_fill(dst)  # poison
    store_backend = _backend(src, mla=mla)
    load_backend = _backend(dst, mla=mla)
    keys = _keys(5, seed=1)
    src_pages, dst_pages = [7, 2, 30, 11, 4], [1, 9, 3, 20, 6]
    assert store_backend.batch_set_v1(keys, _indices(src_pages)) == [True] * 5
    others = [p for p in range(dst.size // PAGE) if p not in dst_pages]
    before = [_canonical_page(dst, p).clone() for p in others]
    assert load_backend.batch_get_v1(keys, _indices(dst_pages)) == [True] * 5
    _assert_pages_equal(src, src_pages, dst, dst_pages)
    for p, old in zip(others, before, strict=True):  # no other host page was written
        assert torch.equal(_canonical_page(dst, p), old), f"host page {p} changed"


def test_corrupted_stored_bytes_are_never_loaded() -> None:
    """Every page is checksummed in lmcache's tier: bytes changed after the store are a miss."""
    device = _device_pool(False)
    src, dst = _host_pool(device, "page_first"), _host_pool(device, "page_first")
    _random_fill(src)
    _random_fill(dst)
    backend = _backend(src, mla=False)
    keys = _keys(3, seed=7)
    assert backend.batch_set_v1(keys, _indices([1, 2, 3])) == [True] * 3
    held = backend.store.hold([keys[1]])  # a lease on the stored bytes of page 1
    held.leases[0].tensor.view(torch.uint8)[0, 0, :8] ^= 0xFF
    held.release()
    before = dst.kv_buffer.clone()
    assert _backend(dst, mla=False).batch_get_v1(keys, _indices([4, 5, 6])) == [True, False, False]
    _assert_pages_equal(src, [1], dst, [4])
    rest = slice(5 * PAGE, 7 * PAGE)  # page_first: [2, slots, layers, H, D]
    assert torch.equal(dst.kv_buffer[:, rest], before[:, rest])
    assert backend.batch_exists(keys) == 1  # the corrupt page was dropped


@pytest.mark.parametrize("flat", [False, True], ids=["zero_copy", "flat"])
def test_a_corrupt_page_in_a_batch_ends_the_hit_there(flat: bool) -> None:
    """A batch's pages are verified in one batch of checksums: the pages before a corrupt one
    load, it and every page after it are not reported (nor written), it alone is dropped."""
    device = _device_pool(False)
    src, dst = _host_pool(device, "page_first"), _host_pool(device, "page_first")
    _random_fill(src)
    _random_fill(dst)
    writer = _backend(src, mla=False)
    keys = _keys(6, seed=9)
    assert writer.batch_set_v1(keys, _indices([1, 2, 3, 4, 5, 6])) == [True] * 6
    held = writer.store.hold([keys[3]])
    held.leases[0].tensor.view(torch.uint8)[-1, -1, -8:] ^= 0x5A  # the page's last bytes
    held.release()
    before = dst.kv_buffer.clone()
    reader = _backend(dst, mla=False, interface_v1=0 if flat else 1)
    if flat:
        targets = [dst.get_dummy_flat_data_page() for _ in keys]
        pages = reader.batch_get(keys, targets)
        assert [p is not None for p in pages] == [True] * 3 + [False] * 3
        for i, page in enumerate(pages[:3]):
            dst.set_from_flat_data_page((10 + i) * PAGE, page)
        _assert_pages_equal(src, [1, 2, 3], dst, [10, 11, 12])
    else:
        assert (
            reader.batch_get_v1(keys, _indices([10, 11, 12, 13, 14, 15]))
            == [True] * 3 + [False] * 3
        )
        _assert_pages_equal(src, [1, 2, 3], dst, [10, 11, 12])
        rest = slice(13 * PAGE, 16 * PAGE)  # page_first: [2, slots, layers, H, D]
        assert torch.equal(dst.kv_buffer[:, rest], before[:, rest])
    store = reader.store
    assert store.metrics.value("checksum_failures") == 1
    assert store.metrics.value("loaded_chunks") == 3
    assert reader.batch_exists(keys) == 3  # the corrupt page was dropped ...
    assert reader.batch_exists(keys[4:]) == 2  # ... and only it
    for key in keys[4:]:  # the batch's shares on the pages after it were released
        with store.tier.get(store.key(key)) as lease:  # type: ignore[union-attr]
            assert lease.ref_count == 2  # the tier's and this one
    assert reader.batch_get_v1(keys[4:], _indices([14, 15])) == [True, True]
    _assert_pages_equal(src, [5, 6], dst, [14, 15])


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize(
    ("src_layout", "dst_layout"),
    [
        ("layer_first", "page_first_direct"),
        ("page_first_direct", "page_first"),
        ("page_first", "layer_first"),
    ],
)
def test_pages_move_across_host_layouts(src_layout: str, dst_layout: str, mla: bool) -> None:
    device = _device_pool(mla)
    src, dst = _host_pool(device, src_layout), _host_pool(device, dst_layout)
    _random_fill(src)
    _random_fill(dst)
    keys = _keys(3, seed=2)
    assert _backend(src, mla=mla).batch_set_v1(keys, _indices([5, 6, 1])) == [True] * 3
    assert _backend(dst, mla=mla).batch_get_v1(keys, _indices([2, 8, 3])) == [True] * 3
    _assert_pages_equal(src, [5, 6, 1], dst, [2, 8, 3])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_flat_page_interface_round_trip(layout: str) -> None:
    """The generic ``set``/``batch_get`` with SGLang's flat pages, and across to zero-copy."""
    device = _device_pool(False)
    src, dst = _host_pool(device, layout), _host_pool(device, layout)
    _random_fill(src)
    _random_fill(dst)
    backend = _backend(src, mla=False, interface_v1=0)
    keys = _keys(3, seed=3)
    pages = [src.get_data_page(p * PAGE) for p in (4, 9, 12)]
    assert backend.batch_set(keys, pages)
    got = backend.batch_get(keys, [dst.get_dummy_flat_data_page() for _ in keys])
    for page, flat in zip(pages, got, strict=True):
        assert flat is not None and torch.equal(flat.view(torch.uint8), page.view(torch.uint8))
    # Stored through flat pages, loaded zero-copy into the host pool.
    assert _backend(dst, mla=False).batch_get_v1(keys, _indices([1, 2, 3])) == [True] * 3
    _assert_pages_equal(src, [4, 9, 12], dst, [1, 2, 3])
    assert backend.get("not-a-stored-page", dst.get_dummy_flat_data_page()) is None


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_flat_pages_batched_prefix(layout: str, mla: bool) -> None:
    """``batch_set`` stores every flat page in one pass; ``batch_get`` leases the stored prefix
    at once and fills the given pages (a new one where ``None``), ``None`` from the first page
    not stored on."""
    device = _device_pool(mla)
    src, dst = _host_pool(device, layout), _host_pool(device, layout)
    _random_fill(src)
    backend = _backend(src, mla=mla, interface_v1=0)
    keys = _keys(4, seed=11)
    pages = [src.get_data_page(p * PAGE) for p in (3, 7, 2, 5)]
    assert backend.batch_set([keys[0], keys[1], keys[3]], [pages[0], pages[1], pages[3]])
    targets = [dst.get_dummy_flat_data_page(), None, dst.get_dummy_flat_data_page(), None]
    got = backend.batch_get(keys, targets)
    assert got[2] is None and got[3] is None
    for page, flat in zip(pages[:2], got[:2], strict=True):
        assert flat is not None and torch.equal(flat.view(torch.uint8), page.view(torch.uint8))
    assert got[0] is targets[0]
    assert backend.get(keys[3]) is not None


def test_batch_exists_is_a_prefix() -> None:
    device = _device_pool(False)
    host = _host_pool(device, "page_first")
    _random_fill(host)
    backend = _backend(host, mla=False)
    keys = _keys(6, seed=4)
    assert backend.batch_exists(keys) == 0
    assert backend.batch_set_v1(keys[:4], _indices([0, 1, 2, 3])) == [True] * 4
    assert backend.batch_exists(keys) == 4
    assert backend.batch_exists(keys[:2]) == 2
    assert backend.exists(keys[3]) and not backend.exists(keys[4])
    # A gap ends the prefix even when later pages are stored.
    assert backend.batch_set_v1([keys[5]], _indices([5])) == [True]
    assert backend.batch_exists(keys) == 4
    # batch_get_v1 loads only the prefix.
    assert backend.batch_get_v1(keys, _indices(list(range(10, 16)))) == [True] * 4 + [False] * 2


@pytest.mark.parametrize(
    ("other", "visible"),
    [
        ({"model": "/models/another-model"}, False),
        ({"tp_rank": 1, "tp_size": 2}, False),
        ({"tp_size": 2}, False),
    ],
    ids=["other-model", "other-rank", "other-tp-size"],
)
def test_other_model_or_rank_never_sees_the_pages(other: dict[str, Any], visible: bool) -> None:
    device = _device_pool(False)
    src, dst = _host_pool(device, "layer_first"), _host_pool(device, "layer_first")
    _random_fill(src)
    _random_fill(dst)
    keys = _keys(4, seed=5)
    assert _backend(src, mla=False).batch_set_v1(keys, _indices([0, 1, 2, 3])) == [True] * 4
    foreign = _backend(dst, mla=False, **other)
    before = dst.kv_buffer.clone()
    assert foreign.batch_exists(keys) == 0
    assert foreign.batch_get_v1(keys, _indices([4, 5, 6, 7])) == [False] * 4
    assert foreign.get(keys[0], dst.get_dummy_flat_data_page()) is None
    assert torch.equal(dst.kv_buffer, before)


def test_mla_pages_are_shared_across_ranks() -> None:
    """MLA KV is the same on every tensor-parallel rank: the key omits the rank."""
    device = _device_pool(True)
    src, dst = _host_pool(device, "page_first"), _host_pool(device, "page_first")
    _random_fill(src)
    _random_fill(dst)
    keys = _keys(2, seed=6)
    assert _backend(src, mla=True, tp_rank=0, tp_size=2).batch_set_v1(keys, _indices([1, 2]))
    peer = _backend(dst, mla=True, tp_rank=1, tp_size=2)
    assert peer.batch_get_v1(keys, _indices([3, 4])) == [True, True]
    _assert_pages_equal(src, [1, 2], dst, [3, 4])
    assert _backend(dst, mla=True, model="/models/another-model").batch_exists(keys) == 0


def test_bad_lmcache_key_in_extra_config_is_one_clear_error() -> None:
    host = _host_pool(_device_pool(False), "layer_first")
    with pytest.raises(ConfigError) as excinfo:
        _backend(host, mla=False, chunk_sise=256)
    assert "chunk_sise" in str(excinfo.value) and "chunk_size" in str(excinfo.value)
