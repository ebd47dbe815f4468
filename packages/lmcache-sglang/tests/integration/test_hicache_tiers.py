# SPDX-License-Identifier: Apache-2.0
"""lmcache's HiCache storage backend over the disk tier, driven with real SGLang objects.

As in ``test_hicache_backend.py``: real ``MHATokenToKVPool(device="cpu")`` / ``MLATokenToKVPool``
device pools, real host pools (``pin_memory=False``), the backend built by SGLang's
``StorageBackendFactory.create_backend("dynamic", ...)``, SGLang's own page hashes; here with
``local_disk`` in the extra config. Between the two backends the process-wide tiers are reset
(the CPU tier emptied, the disk tier closed and reopened from its folder), as in a restart.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache.tiers import reset_process_cpu_tiers

from .test_hicache_backend import (
    PAGE,
    _assert_pages_equal,
    _backend,
    _canonical_page,
    _device_pool,
    _host_pool,
    _indices,
    _keys,
    _random_fill,
)


@pytest.fixture(autouse=True)
def _fresh_tiers() -> Iterator[None]:
    reset_process_cpu_tiers()
    yield
    reset_process_cpu_tiers()


def _disk_config(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {"local_disk": str(tmp_path / "disk"), "max_local_disk_size": 0.01, **extra}


def _restart() -> None:
    """Empty the process's CPU tier; close the disk tier (its queued writes land first)."""
    reset_process_cpu_tiers()


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_second_backend_with_empty_cpu_tier_hits_from_disk(
    layout: str, mla: bool, tmp_path: Path
) -> None:
    device = _device_pool(mla)
    src, dst = _host_pool(device, layout), _host_pool(device, layout)
    _random_fill(src)
    _random_fill(dst)  # poison
    keys = _keys(5, seed=11)
    first = _backend(src, mla=mla, **_disk_config(tmp_path))
    assert first.batch_set_v1(keys, _indices([7, 2, 30, 11, 4])) == [True] * 5
    first.close()
    _restart()

    second = _backend(dst, mla=mla, **_disk_config(tmp_path))
    store = second.store
    assert len(store.tier) == 0  # nothing in host memory: every hit comes from the folder
    assert second.batch_exists(keys) == 5
    assert second.exists(keys[4])
    dst_pages = [1, 9, 3, 20, 6]
    others = [p for p in range(dst.size // PAGE) if p not in dst_pages]
    before = [_canonical_page(dst, p).clone() for p in others]
    assert second.batch_get_v1(keys, _indices(dst_pages)) == [True] * 5
    _assert_pages_equal(src, [7, 2, 30, 11, 4], dst, dst_pages)
    assert store.metrics.value("disk_hit_chunks") == 5
    assert len(store.tier) == 5  # promoted into the CPU tier
    for p, old in zip(others, before, strict=True):  # no other host page was written
        assert torch.equal(_canonical_page(dst, p), old), f"host page {p} changed"


def test_flat_pages_come_back_from_disk(tmp_path: Path) -> None:
    """The generic ``batch_set`` / ``batch_get`` with flat pages, across a restart."""
    device = _device_pool(False)
    src, dst = _host_pool(device, "page_first"), _host_pool(device, "page_first")
    _random_fill(src)
    _random_fill(dst)
    keys = _keys(3, seed=12)
    pages = [src.get_data_page(p * PAGE) for p in (4, 9, 12)]
    first = _backend(src, mla=False, interface_v1=0, **_disk_config(tmp_path))
    assert first.batch_set(keys, pages)
    first.close()
    _restart()
    second = _backend(dst, mla=False, interface_v1=0, **_disk_config(tmp_path))
    got = second.batch_get(keys, [dst.get_dummy_flat_data_page() for _ in keys])
    for page, flat in zip(pages, got, strict=True):
        assert flat is not None and torch.equal(flat.view(torch.uint8), page.view(torch.uint8))
    assert second.store.metrics.value("disk_hit_chunks") == 3


def test_local_cpu_false_stages_through_host_memory(tmp_path: Path) -> None:
    device = _device_pool(False)
    src, dst = _host_pool(device, "page_first"), _host_pool(device, "page_first")
    _random_fill(src)
    _random_fill(dst)
    keys = _keys(4, seed=13)
    backend = _backend(src, mla=False, **_disk_config(tmp_path, local_cpu=False))
    assert backend.batch_set_v1(keys, _indices([1, 2, 3, 4])) == [True] * 4
    assert backend.store.flush(30)
    assert len(backend.store.tier) == 0 and backend.store.tier.pool.used_bytes == 0
    assert backend.batch_exists(keys) == 4
    loader = _backend(dst, mla=False, **_disk_config(tmp_path, local_cpu=False))
    assert loader.batch_get_v1(keys, _indices([5, 6, 7, 8])) == [True] * 4
    _assert_pages_equal(src, [1, 2, 3, 4], dst, [5, 6, 7, 8])
    assert len(loader.store.tier) == 0 and loader.store.tier.pool.used_bytes == 0


def test_clear_drops_the_pages_from_disk(tmp_path: Path) -> None:
    device = _device_pool(False)
    host = _host_pool(device, "layer_first")
    _random_fill(host)
    keys = _keys(3, seed=14)
    backend = _backend(host, mla=False, **_disk_config(tmp_path))
    assert backend.batch_set_v1(keys, _indices([1, 2, 3])) == [True] * 3
    backend.clear()
    assert backend.batch_exists(keys) == 0
    _restart()
    assert _backend(host, mla=False, **_disk_config(tmp_path)).batch_exists(keys) == 0


def test_a_corrupt_cpu_page_comes_back_from_disk_intact(tmp_path: Path) -> None:
    """The batched verification of a hit's CPU-tier pages stops at a corrupt page; the hit then
    goes on below, as before: the page comes from the disk tier, verified, and the pages after it
    from the CPU tier."""
    device = _device_pool(False)
    src, dst = _host_pool(device, "page_first"), _host_pool(device, "page_first")
    _random_fill(src)
    _random_fill(dst)
    keys = _keys(5, seed=15)
    backend = _backend(src, mla=False, **_disk_config(tmp_path))
    assert backend.batch_set_v1(keys, _indices([1, 2, 3, 4, 5])) == [True] * 5
    assert backend.store.flush(30)
    held = backend.store.hold([keys[2]])
    held.leases[0].tensor.view(torch.uint8)[0, 0, :8] ^= 0xFF
    held.release()
    loader = _backend(dst, mla=False, **_disk_config(tmp_path))
    assert loader.batch_get_v1(keys, _indices([6, 7, 8, 9, 10])) == [True] * 5
    _assert_pages_equal(src, [1, 2, 3, 4, 5], dst, [6, 7, 8, 9, 10])
    metrics = loader.store.metrics
    assert metrics.value("checksum_failures") == 1
    assert metrics.value("disk_hit_chunks") == 1
