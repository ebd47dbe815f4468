# SPDX-License-Identifier: Apache-2.0
"""lmcache's HiCache backend with a hybrid model's extra host pools (HiCache v2), driven with
real SGLang objects on the CPU.

HiCache's device<->host copies are CUDA-only, so no engine runs here. These tests build what
SGLang's ``build_hybrid_swa_group`` / Mamba stack build: the full-attention
``MHATokenToKVPoolHost`` (the anchor, ``PoolName.KV``), a second ``MHATokenToKVPoolHost`` over
the sliding-window layers' ``MHATokenToKVPool(device="cpu")`` (``PoolName.SWA``) and a
``MambaPoolHost`` over CPU state tensors (``PoolName.MAMBA``, one state slot per page), the
backend through ``StorageBackendFactory.create_backend("dynamic", ...)``, registered as
``HybridCacheController.attach_storage_backend`` does (``register_mem_pool_host`` with the
anchor, then ``register_mem_host_pool_v2`` for every pool). They then call the backend as the
controller does: a backup writes KV with ``batch_set_v1`` and the node's SWA window pages and
Mamba state (keyed by the node's trailing page hashes) with ``batch_set_v2``; a prefetch asks
``batch_exists_v2`` with placeholder keys (their count is the window), loads KV with
``batch_get_v1``, re-aligns the trailing keys to the hit's end and loads the pools with
``batch_get_v2``. The oracle is SGLang's own ``get_data_page``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from sglang.srt.mem_cache import hicache_storage
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.utils import get_hash_str

from lmcache.gpu_connector.interface import KVLayoutError
from lmcache.tiers import reset_process_cpu_tiers
from lmcache_sglang.testing import make_prompt

from .test_hicache_backend import _backend

PAGE = 4
WINDOW = 2  # SWA pages a hit needs before its end
MODEL = "/models/tiny-hybrid"
TRAILING = PoolHitPolicy.TRAILING_PAGES


@pytest.fixture(autouse=True)
def _fresh_tier() -> Iterator[None]:
    reset_process_cpu_tiers()
    yield
    reset_process_cpu_tiers()


def _kv_host(layers: int, heads: int, layout: str) -> Any:
    device = MHATokenToKVPool(
        size=256,
        page_size=PAGE,
        dtype=torch.bfloat16,
        head_num=heads,
        head_dim=32,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
        start_layer=0,
        end_layer=layers,
    )
    host = MHATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info,
        2,
        0,
        write_back_staging=device.hicache_write_back_staging,
        device_capacity_tokens=device.size,
        start_layer=0,
        end_layer=layers,
        page_size=PAGE,
        layout=layout,
        pin_memory=False,
    )
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape).to(host.kv_buffer.dtype))
    return host


def _mamba_host(layout: str) -> Any:
    slots = 16
    info = MambaStateBufferInfo(
        temporal=torch.zeros(3, slots, 2, 8, 4, dtype=torch.float32),
        conv=(torch.zeros(3, slots, 3, 40, dtype=torch.bfloat16),),
    )
    host = MambaPoolHost(
        info, 2, 0, device_capacity=slots, pin_memory=False, device="cpu", layout=layout
    )
    for buf in (host.temporal_buffer, *host.conv_buffer):
        buf.copy_(torch.randn(buf.shape).to(buf.dtype))
    return host


class Hybrid:
    """One scheduler's host pools and the lmcache backend SGLang attaches to them."""

    def __init__(
        self,
        layout: str = "page_first",
        *,
        swa: bool = True,
        mamba: bool = True,
        model: str = MODEL,
        tp_rank: int = 0,
        tp_size: int = 1,
        **extra: Any,
    ) -> None:
        self.kv = _kv_host(2, 2, layout)
        self.pools: dict[str, Any] = {}
        if swa:
            self.pools["swa"] = _kv_host(3, 1, layout)
        if mamba:
            self.pools["mamba"] = _mamba_host("page_first" if layout == "layer_first" else layout)
        self.backend = _backend(
            self.kv,
            mla=False,
            model=model,
            tp_rank=tp_rank,
            tp_size=tp_size,
            pools={PoolName(name): host for name, host in self.pools.items()},
            **extra,
        )

    def page(self, name: str, slot: int) -> torch.Tensor:
        host = self.kv if name == "kv" else self.pools[name]
        return host.get_data_page(slot * host.page_size, flat=True).view(torch.uint8).clone()

    # -- the controller's calls -----------------------------------------------------------

    def backup(self, hashes: list[str], end: int, kv_pages: list[int], windows: dict) -> Any:
        """A node ending at page ``end``: KV pages ``kv_pages`` (host pages), the SWA window's
        host pages ``windows["swa"]`` and the Mamba state slot ``windows["mamba"]``."""
        n = len(kv_pages)
        assert self.backend.batch_set_v1(hashes[end - n : end], _slots(kv_pages)) == [True] * n
        transfers = []
        if "swa" in windows:
            w = len(windows["swa"])
            transfers.append(
                PoolTransfer(
                    name=PoolName.SWA,
                    host_indices=_slots(windows["swa"]),
                    keys=hashes[end - w : end],
                    hit_policy=TRAILING,
                )
            )
        if "mamba" in windows:
            transfers.append(
                PoolTransfer(
                    name=PoolName.MAMBA,
                    host_indices=torch.tensor([windows["mamba"]]),
                    keys=[hashes[end - 1]],
                    hit_policy=TRAILING,
                )
            )
        return self.backend.batch_set_v2(transfers)

    def query(self, hashes: list[str]) -> Any:
        transfers = []
        if "swa" in self.pools:
            transfers.append(
                PoolTransfer(
                    name=PoolName.SWA, keys=["__placeholder__"] * WINDOW, hit_policy=TRAILING
                )
            )
        if "mamba" in self.pools:
            transfers.append(
                PoolTransfer(name=PoolName.MAMBA, keys=["__placeholder__"], hit_policy=TRAILING)
            )
        return self.backend.batch_exists_v2(hashes, transfers)

    def fetch(self, hashes: list[str], hit: int, swa_pages: list[int], mamba_slot: int) -> dict:
        """Load a hit of ``hit`` pages: the trailing keys re-aligned to its end."""
        transfers = []
        if "swa" in self.pools:
            keys = hashes[max(0, hit - WINDOW) : hit]
            transfers.append(
                PoolTransfer(
                    name=PoolName.SWA,
                    host_indices=_slots(swa_pages[: len(keys)]),
                    keys=keys,
                    hit_policy=TRAILING,
                )
            )
        if "mamba" in self.pools:
            transfers.append(
                PoolTransfer(
                    name=PoolName.MAMBA,
                    host_indices=torch.tensor([mamba_slot]),
                    keys=[hashes[hit - 1]],
                    hit_policy=TRAILING,
                )
            )
        return dict(self.backend.batch_get_v2(transfers))


def _slots(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


def _hashes(num_pages: int, seed: int) -> list[str]:
    keys = get_hash_str(make_prompt(num_pages * PAGE, seed), None, page_size=PAGE)
    assert isinstance(keys, list) and len(keys) == num_pages
    return keys


def _store_two_nodes(h: Hybrid, hashes: list[str], *, mamba_at_8: bool = True) -> None:
    """Nodes [0, 4) and [4, 8): KV of every page, each node's SWA window and end state."""
    ok = h.backup(hashes, 4, [1, 2, 3, 4], {"swa": [5, 6], "mamba": 1})
    assert ok == {"swa": [True, True], "mamba": [True]}
    windows: dict[str, Any] = {"swa": [7, 8]}
    if mamba_at_8:
        windows["mamba"] = 2
    assert h.backup(hashes, 8, [9, 10, 11, 12], windows)["swa"] == [True, True]


# -- round trips ------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_hybrid_round_trip_is_bit_exact(layout: str) -> None:
    hashes = _hashes(8, seed=1)
    writer = Hybrid(layout)
    _store_two_nodes(writer, hashes)
    reader = Hybrid(layout)  # a fresh radix cache over new host pools, same tiers
    result = reader.query(hashes)
    assert result.kv_hit_pages == 8
    assert result.restorable_prefix_pages == [4, 8]
    assert result.extra_pool_hit_pages == {"kv": 8, "swa": 8, "mamba": 8}
    assert (
        reader.backend.batch_get_v1(hashes, _slots([20, 21, 22, 23, 24, 25, 26, 27])) == [True] * 8
    )
    got = reader.fetch(hashes, 8, [30, 31], mamba_slot=9)
    assert got == {"swa": [True, True], "mamba": [True]}
    for src, dst in zip([1, 2, 3, 4, 9, 10, 11, 12], range(20, 28), strict=True):
        assert torch.equal(writer.page("kv", src), reader.page("kv", dst))
    for src, dst in zip([7, 8], [30, 31], strict=True):
        assert torch.equal(writer.page("swa", src), reader.page("swa", dst))
    assert torch.equal(writer.page("mamba", 2), reader.page("mamba", 9))
    # the earlier stop point loads its own window and state
    assert reader.fetch(hashes, 4, [32, 33], mamba_slot=10) == {
        "swa": [True, True],
        "mamba": [True],
    }
    assert torch.equal(writer.page("swa", 5), reader.page("swa", 32))
    assert torch.equal(writer.page("mamba", 1), reader.page("mamba", 10))


def test_mamba_pages_move_across_its_layouts() -> None:
    hashes = _hashes(4, seed=2)
    writer = Hybrid("page_first", swa=False)
    assert writer.backup(hashes, 4, [1, 2, 3, 4], {"mamba": 3}) == {"mamba": [True]}
    reader = Hybrid("page_first_direct", swa=False)
    assert reader.query(hashes).restorable_prefix_pages == [4]
    assert reader.fetch(hashes, 4, [], mamba_slot=5) == {"mamba": [True]}
    assert torch.equal(writer.page("mamba", 3), reader.page("mamba", 5))


def _canonical(h: Hybrid, page: int) -> torch.Tensor:
    """An SWA host page as ``[2, layers, page_size, heads, dim]`` whatever the layout."""
    host = h.pools["swa"]
    data = host.get_data_page(page * PAGE, flat=False)
    if host.layout == "page_first":  # [2, ps, L, H, D]
        return data.transpose(1, 2)
    return data[:, 0] if host.layout == "page_first_direct" else data


@pytest.mark.parametrize(
    ("src", "dst"), [("page_first", "layer_first"), ("layer_first", "page_first_direct")]
)
def test_swa_pages_move_across_host_layouts(src: str, dst: str) -> None:
    hashes = _hashes(8, seed=14)
    writer = Hybrid(src)
    _store_two_nodes(writer, hashes)
    reader = Hybrid(dst)
    assert reader.query(hashes).restorable_prefix_pages == [4, 8]
    assert reader.fetch(hashes, 8, [30, 31], mamba_slot=9)["swa"] == [True, True]
    for s, d in zip([7, 8], [30, 31], strict=True):
        assert torch.equal(_canonical(writer, s), _canonical(reader, d))


# -- trailing-page semantics --------------------------------------------------------------


def test_missing_trailing_state_shortens_the_restorable_prefix() -> None:
    hashes = _hashes(8, seed=3)
    h = Hybrid()
    _store_two_nodes(h, hashes, mamba_at_8=False)
    result = h.query(hashes)
    assert result.restorable_prefix_pages == [4]  # no state at page 8's end
    assert result.kv_hit_pages == 4
    assert result.extra_pool_hit_pages["mamba"] == 4
    assert result.extra_pool_hit_pages["swa"] == 8


def test_missing_window_page_or_kv_page_shortens_the_restorable_prefix() -> None:
    hashes = _hashes(8, seed=4)
    h = Hybrid()
    _store_two_nodes(h, hashes)
    store = h.backend._extra_pools.stores["swa"]
    assert store.tier.remove(store.key(hashes[6]))  # the window's first page of length 8
    result = h.query(hashes)
    assert result.restorable_prefix_pages == [4]
    assert result.kv_hit_pages == 4
    # a KV miss at page 6 caps every pool at 5 pages: only 4 keeps its window and state
    h2 = Hybrid()
    _store_two_nodes(h2, _hashes(8, seed=5))
    kv = h2.backend.store
    hashes2 = _hashes(8, seed=5)
    assert kv.tier.remove(kv.key(hashes2[5]))
    result = h2.query(hashes2)
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (4, [4])
    assert result.extra_pool_hit_pages["kv"] == 5


def test_sliding_window_only_and_a_short_prefix() -> None:
    """A hit shorter than the window needs every page from the start."""
    hashes = _hashes(3, seed=6)
    h = Hybrid(mamba=False)
    assert h.backup(hashes, 3, [1, 2, 3], {"swa": [4, 5]}) == {"swa": [True, True]}
    assert h.query(hashes).restorable_prefix_pages == [3]  # 1 and 2 need page 0's SWA page
    swa = PoolTransfer(name=PoolName.SWA, host_indices=_slots([6]), keys=hashes[:1])
    assert h.backend.batch_set_v2([swa]) == {"swa": [True]}
    assert h.query(hashes).restorable_prefix_pages == [1, 2, 3]


def test_without_restorable_field_the_hit_is_the_longest_common_length(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SGLang 0.5.17's ``PoolTransferResult`` has no ``restorable_prefix_pages``."""
    from dataclasses import dataclass

    @dataclass
    class Old:  # 0.5.17's fields
        kv_hit_pages: int
        extra_pool_hit_pages: dict[str, int]

    monkeypatch.setattr(hicache_storage, "PoolTransferResult", Old)
    hashes = _hashes(8, seed=7)
    h = Hybrid()
    _store_two_nodes(h, hashes, mamba_at_8=False)
    result = h.query(hashes)
    assert isinstance(result, Old) and result.kv_hit_pages == 4


# -- checksums ----------------------------------------------------------------------------


@pytest.mark.parametrize("pool", ["swa", "mamba"])
def test_a_corrupt_extra_pool_page_is_never_loaded(pool: str) -> None:
    hashes = _hashes(8, seed=8)
    writer = Hybrid()
    _store_two_nodes(writer, hashes)
    store = writer.backend._extra_pools.stores[pool]
    held = store.hold([hashes[7]])  # SWA: the window's last page; Mamba: the state at 8
    held.leases[0].tensor.view(torch.uint8).view(-1)[-8:] ^= 0x5A
    held.release()
    reader = Hybrid()
    before = {name: reader.page(name, slot).clone() for name, slot in (("swa", 31), ("mamba", 9))}
    got = reader.fetch(hashes, 8, [30, 31], mamba_slot=9)
    expected = {"swa": [True, True], "mamba": [True]}
    expected[pool] = [True, False] if pool == "swa" else [False]
    assert got == expected
    assert torch.equal(reader.page(pool, 31 if pool == "swa" else 9), before[pool])
    assert reader.backend._extra_pools.stores[pool].metrics.value("checksum_failures") == 1
    # dropped: the length it ended is no longer restorable, the earlier one still is
    assert reader.query(hashes).restorable_prefix_pages == [4]


# -- isolation ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "other",
    [{"model": "/models/other"}, {"cache_salt": "tenant-b"}, {"tp_rank": 1, "tp_size": 2}],
    ids=["model", "salt", "rank"],
)
def test_other_model_salt_or_rank_never_sees_the_pools(other: dict[str, Any]) -> None:
    hashes = _hashes(8, seed=9)
    _store_two_nodes(Hybrid(), hashes)
    reader = Hybrid(**other)
    result = reader.query(hashes)
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (0, [])
    assert reader.fetch(hashes, 8, [30, 31], mamba_slot=9) == {
        "swa": [False, False],
        "mamba": [False],
    }


def test_pages_of_another_pool_are_never_returned() -> None:
    """Every pool keys its pages apart: KV pages are no SWA pages, SWA pages no Mamba state."""
    hashes = _hashes(4, seed=10)
    h = Hybrid()
    assert h.backup(hashes, 4, [1, 2, 3, 4], {}) is not None  # KV only
    assert h.query(hashes).restorable_prefix_pages == []
    assert h.backend.batch_set_v2(
        [PoolTransfer(name=PoolName.SWA, host_indices=_slots([5]), keys=[hashes[3]])]
    ) == {"swa": [True]}
    result = h.query(hashes)
    assert result.restorable_prefix_pages == [] and "mamba" not in result.extra_pool_hit_pages
    assert h.fetch(hashes, 4, [6, 7], mamba_slot=3)["mamba"] == [False]


def test_other_pools_are_refused_at_registration() -> None:
    h = Hybrid(swa=False, mamba=False)
    with pytest.raises(KVLayoutError, match="indexer"):
        h.backend.register_mem_host_pool_v2(_kv_host(1, 1, "page_first"), PoolName.INDEXER)
    h.backend.register_mem_host_pool_v2(h.kv, PoolName.KV)  # the anchor again: nothing to do
    assert set(h.backend._extra_pools.stores) == set()


def test_clear_drops_every_pool() -> None:
    hashes = _hashes(8, seed=11)
    h = Hybrid()
    _store_two_nodes(h, hashes)
    h.backend.clear()
    assert h.query(hashes).restorable_prefix_pages == []
    for store in h.backend._extra_pools.stores.values():
        assert not any(store.tier.contains(store.key(k)) for k in hashes)


def test_pools_come_back_from_disk_after_a_restart(tmp_path: Any) -> None:
    """With ``local_disk``, a second backend whose CPU tier is empty restores every pool from
    the folder (read, verified, promoted), bit-exact."""
    disk = {"local_disk": str(tmp_path / "disk"), "max_local_disk_size": 0.01}
    hashes = _hashes(8, seed=12)
    writer = Hybrid(**disk)
    _store_two_nodes(writer, hashes)
    writer.backend.close()  # the queued disk writes land
    reset_process_cpu_tiers()
    reader = Hybrid(**disk)
    assert len(reader.backend.store.tier) == 0
    assert reader.query(hashes).restorable_prefix_pages == [4, 8]
    assert reader.fetch(hashes, 8, [30, 31], mamba_slot=9) == {
        "swa": [True, True],
        "mamba": [True],
    }
    for src, dst in zip([7, 8], [30, 31], strict=True):
        assert torch.equal(writer.page("swa", src), reader.page("swa", dst))
    assert torch.equal(writer.page("mamba", 2), reader.page("mamba", 9))
    for pool in ("swa", "mamba"):
        assert reader.backend._extra_pools.stores[pool].metrics.value("disk_hit_chunks") >= 1


# -- the other hooks: the linker refuses hybrid models, --enable-lmcache stays off -------------


def test_linker_refuses_hybrid_components_at_start_up() -> None:
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    from lmcache_sglang.linker import LMCacheLinker

    for extra in (ComponentType.SWA, ComponentType.MAMBA):
        with pytest.raises(KVLayoutError, match=f"{extra.name} components.*HiCache backend"):
            LMCacheLinker(None, None, components={ComponentType.FULL, extra})  # type: ignore[arg-type]


def test_enable_lmcache_is_off_for_hybrid_models_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    from lmcache_sglang.mp_connector import UnifiedLMCacheMPConnector

    with caplog.at_level("WARNING", logger="lmcache_sglang.mp_connector"):
        connector = UnifiedLMCacheMPConnector(
            config_file=None,
            model_config=None,
            tp_size=1,
            tp_rank=0,
            page_size=PAGE,
            token_to_kv_pool_allocator=None,  # type: ignore[arg-type]
            tree_components=(ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA),
            mamba_component=object(),
            sliding_window_size=64,
        )
    assert connector.engine is None
    message = caplog.text
    assert (
        "MAMBA, SWA (window 64) beside full attention" in message
        and "every lookup misses" in message
    )
    lookup = connector.submit_lookup("r", list(range(3 * PAGE)))
    assert connector.poll_lookup(lookup) == 0
    assert connector.submit_store("r", list(range(PAGE)), torch.arange(PAGE)) is None


# -- SGLang's own HybridCacheController code calling the backend ------------------------------


def _controller(h: Hybrid) -> Any:
    """SGLang's ``HybridCacheController`` without its threads, device pools or process groups
    (CUDA-only): the storage methods below are SGLang's own code, run on this backend."""
    import contextlib
    from queue import Queue
    from types import SimpleNamespace

    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    ctrl = object.__new__(HybridCacheController)
    ctrl.storage_backend = h.backend
    ctrl.storage_backend_type = "dynamic"
    ctrl.page_size = PAGE
    ctrl.storage_config = h.backend.storage_config  # a writer: backup_skip is False
    ctrl.page_set_func = ctrl._page_set_zero_copy
    ctrl.page_get_func = ctrl._page_get_zero_copy
    entries = {PoolName(n): SimpleNamespace(host_pool=p) for n, p in h.pools.items()}
    ctrl.mem_pool_host = SimpleNamespace(entry_map=entries, layout_lease=contextlib.nullcontext)
    ctrl.prefetch_sync_queue = Queue()
    ctrl.prefetch_hits_sync_groups = None
    ctrl._all_reduce = lambda tensor, op, group: None  # one rank
    return ctrl


@pytest.mark.parametrize("mamba_at_8", [True, False], ids=["hit_8", "hit_4"])
def test_sglang_controller_backup_and_prefetch(mamba_at_8: bool) -> None:
    from types import SimpleNamespace

    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
        PrefetchOperation,
        StorageOperation,
    )
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    tokens = make_prompt(8 * PAGE, 13)
    hashes = get_storage_hash_str(tokens, None, page_size=PAGE)
    writer = Hybrid()
    ctrl = _controller(writer)
    nodes = [(0, [1, 2, 3, 4], [5, 6], 1), (4, [9, 10, 11, 12], [7, 8], 2)]
    for start, kv, swa, state in nodes:  # the radix cache's BACKUP_STORAGE transfers
        end = start + 4
        transfers = [
            PoolTransfer(PoolName.SWA, _slots(swa), keys=hashes[end - 2 : end], hit_policy=TRAILING)
        ]
        if mamba_at_8 or end == 4:
            transfers.append(
                PoolTransfer(PoolName.MAMBA, torch.tensor([state]), keys=[hashes[end - 1]])
            )
            transfers[-1].hit_policy = TRAILING
        op = StorageOperation(
            _slots(kv), tokens[start * PAGE : end * PAGE], hash_value=hashes[start:end]
        )
        op.pool_transfers = transfers
        ctrl._page_backup(op)
        assert op.completed_tokens == 4 * PAGE
        assert op.pool_storage_result.extra_pool_hit_pages["swa"] == 2

    reader = Hybrid()
    ctrl = _controller(reader)
    op = PrefetchOperation(  # the radix cache's PREFETCH transfers: placeholders
        SimpleNamespace(rid="r"),
        tokens,
        pool_transfers=[
            PoolTransfer(PoolName.SWA, keys=["__placeholder__"] * 2, hit_policy=TRAILING),
            PoolTransfer(PoolName.MAMBA, keys=["__placeholder__"], hit_policy=TRAILING),
        ],
    )
    hit_hashes, hit = ctrl._storage_hit_query(op)
    hit = ctrl._sync_prefetch_hit_query(op, hit)
    pages = 8 if mamba_at_8 else 4
    assert hit == pages * PAGE
    assert op.pool_storage_result.restorable_prefix_pages == ([4, 8] if mamba_at_8 else [4])
    op.hash_value, op.storage_hit_count = hit_hashes[:pages], hit
    op.host_indices = _slots(list(range(20, 20 + pages)))  # staging the tree allocates
    op.pool_transfers[0].host_indices = _slots([30, 31])
    op.pool_transfers[1].host_indices = torch.tensor([9])
    ctrl._page_transfer(op)  # KV (batch_get_v1), then the keys re-aligned, then batch_get_v2
    acks = [ctrl.prefetch_sync_queue.get_nowait() for _ in range(ctrl.prefetch_sync_queue.qsize())]
    assert acks[0].completed_tokens == hit and acks[-1].pool_hits == {"swa": 2, "mamba": 1}
    kv_src = [1, 2, 3, 4, 9, 10, 11, 12][:pages]
    for src, dst in zip(kv_src, range(20, 20 + pages), strict=True):
        assert torch.equal(writer.page("kv", src), reader.page("kv", dst))
    swa_src, state_src = ([7, 8], 2) if mamba_at_8 else ([5, 6], 1)
    for src, dst in zip(swa_src, [30, 31], strict=True):
        assert torch.equal(writer.page("swa", src), reader.page("swa", dst))
    assert torch.equal(writer.page("mamba", state_src), reader.page("mamba", 9))
