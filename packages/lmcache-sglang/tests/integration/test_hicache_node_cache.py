# SPDX-License-Identifier: Apache-2.0
"""lmcache's HiCache storage backend over the node cache (``node_cache: true``), driven with real
SGLang objects as in ``test_hicache_backend.py``.

A real node cache owner runs as a child process. One backend backs pages up through its node
tier; its process's tiers are then dropped (as if that engine process went away) and a fresh
backend, with an empty host pool, finds and loads every page from the node cache, bit-exact.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lmcache.testing.node_owner import NodeOwner
from lmcache.tiers import reset_process_cpu_tiers
from lmcache.tiers.node_tier import NodeTier

from .test_hicache_backend import (
    _assert_pages_equal,
    _backend,
    _device_pool,
    _host_pool,
    _indices,
    _keys,
    _random_fill,
)


@pytest.fixture
def owner(tmp_path: Path) -> Iterator[NodeOwner]:
    reset_process_cpu_tiers()
    with NodeOwner(tmp_path / "node", budget_bytes=64 << 20) as running:
        yield running
    reset_process_cpu_tiers()


def _node_config(owner: NodeOwner, **extra: Any) -> dict[str, Any]:
    return {
        "node_cache": True,
        "node_cache_dir": str(owner.folder),
        "node_cache_autostart": False,
        **extra,
    }


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_pages_backed_up_by_one_backend_are_hits_for_another(owner: NodeOwner, layout: str) -> None:
    device = _device_pool(False)
    src, dst = _host_pool(device, layout), _host_pool(device, layout)
    _random_fill(src)
    _random_fill(dst)  # poison
    keys = _keys(5, seed=17)
    first = _backend(src, mla=False, **_node_config(owner))
    assert isinstance(first.store.tier, NodeTier)
    assert first.batch_set_v1(keys, _indices([7, 2, 30, 11, 4])) == [True] * 5
    first.close()
    reset_process_cpu_tiers()  # this process's connection and leases go

    second = _backend(dst, mla=False, **_node_config(owner))
    assert isinstance(second.store.tier, NodeTier)
    assert second.batch_exists(keys) == 5
    assert second.batch_get_v1(keys, _indices([1, 9, 3, 20, 6])) == [True] * 5
    _assert_pages_equal(src, [7, 2, 30, 11, 4], dst, [1, 9, 3, 20, 6])


def test_another_salt_sees_nothing_and_a_stopped_owner_is_a_miss(owner: NodeOwner) -> None:
    device = _device_pool(False)
    src, dst = _host_pool(device, "page_first"), _host_pool(device, "page_first")
    _random_fill(src)
    keys = _keys(4, seed=19)
    first = _backend(src, mla=False, **_node_config(owner, cache_salt="tenant-a"))
    assert first.batch_set_v1(keys, _indices([3, 5, 8, 13])) == [True] * 4
    first.close()
    reset_process_cpu_tiers()

    other = _backend(dst, mla=False, **_node_config(owner, cache_salt="tenant-b"))
    assert other.batch_exists(keys) == 0
    other.close()
    reset_process_cpu_tiers()

    owner.kill()
    gone = _backend(dst, mla=False, **_node_config(owner, cache_salt="tenant-a"))
    assert gone.batch_exists(keys) == 0  # a miss, not an error
    assert gone.batch_get_v1(keys, _indices([1, 2, 4, 6])) == [False] * 4
