# SPDX-License-Identifier: Apache-2.0
"""SGLang's extra HiCache host pools (sliding-window KV, Mamba state) in lmcache's tiers.

Hybrid models give SGLang's ``HybridCacheController`` one host pool per kind of cache: the
full-attention KV pool (``PoolName.KV``, the anchor, moved through ``batch_*_v1`` as for a dense
model) and sidecars it moves through HiCache's v2 calls (``batch_exists_v2`` / ``batch_get_v2`` /
``batch_set_v2``, one ``PoolTransfer`` per pool). lmcache keeps two of them:

- ``PoolName.SWA``: the sliding-window layers' KV, an ``MHATokenToKVPoolHost`` (or MLA) of its
  own. A page is stored in lmcache's canonical chunk format, like a KV page, so it moves across
  host layouts. SGLang backs up the pages of a node's window and, for a hit, needs the pages of
  the window before the hit's end (``hit_policy=TRAILING_PAGES``, as many pages as
  ``len(transfer.keys)``).
- ``PoolName.MAMBA``: the recurrent state, a ``MambaPoolHost`` whose "page" is one state slot
  (``page_size`` 1). SGLang backs up the state at a node's end under the node's last page hash
  and, for a hit, needs the state at the hit's last page only (``TRAILING_PAGES``, one key).
  A page is the pool's own flat page (``get_data_page``: temporal, conv and side states as
  bytes, the same in both of its layouts), stored as ``[1, 1, bytes]`` ``uint8``.

Each pool has a :class:`~lmcache_sglang.page_store.PageStore` of its own over the same tiers,
keyed like KV pages (model fingerprint of the pool's geometry, ``cache_salt``, pipeline and
context-parallel stage, SGLang's page hash) plus the pool's name and, for Mamba, the state's
shapes and dtypes. Mamba state is sharded over tensor-parallel ranks, so its keys always carry
the rank (MLA SWA pages are shared by ranks, like MLA KV pages). Pages are checksummed when
stored and verified when held, as KV pages are: a page that fails is never copied into SGLang's
host pool, and reports ``False`` (SGLang then drops the window or the state, see below).

``batch_exists_v2`` is the restorable-prefix query: the KV prefix (``batch_exists``), then for
each pool the prefix lengths it can serve: ``ALL_PAGES``, every page before it; ``TRAILING_PAGES``
with ``n`` keys, the ``n`` pages before it. The hit is the longest length every pool serves, and
``restorable_prefix_pages`` lists them all (SGLang intersects them over ranks; SGLang 0.5.17's
result has no such field and gets the hit only). Presence is not verified there (as for KV): a
page found bad or missing when read fails that pool's ``batch_get_v2``, and SGLang drops the
pool's window or state for the hit (its radix cache then has KV without them, and computes).

Pools of other names (DeepSeek V4, indexers, draft pools) are refused when SGLang registers them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from lmcache.config import LMCacheConfig
from lmcache.gpu_connector import CreateGPUConnector
from lmcache.gpu_connector.interface import (
    ChunkTransfer,
    EngineInfo,
    GPUConnectorInterface,
    KVLayoutError,
    TransferSpec,
)
from lmcache.metadata import LMCacheMetadata
from lmcache.metrics import LMCacheMetrics
from lmcache.tiers import cascade, process_cpu_tier
from lmcache_sglang.hook_config import ModelFacts
from lmcache_sglang.kv_pools import build_metadata, host_pool_layers
from lmcache_sglang.page_store import PageStore

__all__ = [
    "KV_SHAPED",
    "STATE_POOLS",
    "MambaStateConnector",
    "PoolStores",
    "pool_name",
    "refuse_hybrid_linker",
]

logger = logging.getLogger(__name__)

KV_SHAPED = ("swa",)
"""Pools whose host pool is a KV host pool (stored in the canonical chunk format)."""

STATE_POOLS = ("mamba",)
"""Pools whose host pool is a ``MambaPoolHost`` (stored as its flat byte pages)."""


def pool_name(name: object) -> str:
    """SGLang's ``PoolName`` (a ``str`` enum) or a plain string, as ``"swa"``."""
    return str(getattr(name, "value", name))


def refuse_hybrid_linker(components: object) -> None:
    """Stop the ``UnifiedCacheLinker``'s start-up for a model whose cache has components
    other than full attention (SGLang's ``ComponentType``: ``SWA``, ``MAMBA``, ...).

    Raises:
        KVLayoutError: such a component, named.
    """
    items = components if isinstance(components, Iterable) else ()
    names = sorted({str(getattr(c, "name", c)).upper() for c in items} - {"FULL"})
    if names:
        raise KVLayoutError(
            "lmcache's UnifiedCacheLinker caches full-attention KV only, and this model's cache "
            f"also has {', '.join(names)} components. SGLang hands a linker one PoolTransfer "
            "per pool (a sliding window's trailing pages, the Mamba state at a hit's end), "
            "which lmcache's linker does not store. For this model use lmcache's HiCache "
            "backend (--hicache-storage-backend dynamic with LMCacheHiCacheStorage: it stores "
            "the SWA and Mamba pools too), or run without the linker."
        )


class MambaStateConnector(GPUConnectorInterface):
    """Moves Mamba state slots between SGLang's ``MambaPoolHost`` and ``[1, 1, bytes]`` page
    buffers, through the pool's own ``get_data_page`` / ``set_from_flat_data_page``."""

    def __init__(self, config: LMCacheConfig, metadata: LMCacheMetadata, host_pool: Any) -> None:
        super().__init__(config, metadata, EngineInfo(name="sglang", device="cpu", kv_caches=[]))
        self.host_pool = host_pool

    @property
    def num_layers(self) -> int:
        return 1

    @property
    def dtype(self) -> torch.dtype:
        return torch.uint8

    def _slots(self, chunk: ChunkTransfer, transfer: TransferSpec) -> list[int]:
        return [int(s) for s in transfer.slot_mapping[chunk.start : chunk.end].tolist()]

    def from_gpu(self, chunks: Sequence[ChunkTransfer], transfer: TransferSpec) -> None:
        self.check_chunks(chunks, transfer)
        for chunk in chunks:
            for i, slot in enumerate(self._slots(chunk, transfer)):
                page = self.host_pool.get_data_page(slot, flat=True)
                chunk.buffer[0, i].copy_(page.view(torch.uint8).reshape(-1))

    def to_gpu(self, chunks: Sequence[ChunkTransfer], transfer: TransferSpec) -> None:
        self.check_chunks(chunks, transfer)
        for chunk in chunks:
            for i, slot in enumerate(self._slots(chunk, transfer)):
                if chunk.start + i >= transfer.skip_tokens:
                    self.host_pool.set_from_flat_data_page(slot, chunk.buffer[0, i])


def _state_geometry(host_pool: Any) -> str:
    """What decides a Mamba page's bytes besides the model: layers, state shapes, dtypes."""
    shapes = [tuple(host_pool.temporal_state_shape), *map(tuple, host_pool.conv_state_shapes)]
    side = [tuple(b.shape[1:]) for b in getattr(host_pool, "slot_state_buffers", ())]
    return (
        f"layers={int(host_pool.num_mamba_layers)}/shapes={shapes}/side={side}"
        f"/dtypes={host_pool.temporal_dtype},{host_pool.conv_dtype}"
    )


class PoolStores:
    """lmcache's stores of the extra host pools one HiCache backend serves (see the module
    docstring).

    Args:
        config: lmcache configuration of the backend.
        facts: The model facts of the backend's keys.
        storage_config: SGLang's ``HiCacheStorageConfig`` (ranks, MLA).
        namespace: The backend's key namespace (stages); the pool's name is added to it.
    """

    def __init__(
        self, config: LMCacheConfig, facts: ModelFacts, storage_config: object, namespace: str
    ) -> None:
        self.config = config
        self.facts = facts
        self.storage_config = storage_config
        self.namespace = namespace
        self.stores: dict[str, PageStore] = {}
        self.host_pools: dict[str, Any] = {}

    # -- registration ---------------------------------------------------------------------

    def register(self, host_pool: Any, name: object, anchor: object) -> None:
        """Build the store of the extra pool ``name`` (``kv``: the KV pool the backend already
        serves, ``anchor``, needs nothing).

        Raises:
            KVLayoutError: a pool lmcache does not store, or one it cannot read.
        """
        key = pool_name(name)
        if key == "kv":  # KV moves through batch_*_v1 with the pool registered first
            if host_pool is not anchor:
                logger.warning(
                    "lmcache HiCache backend: SGLang registered a KV host pool (%s) other than "
                    "its anchor; lmcache keeps moving KV with the anchor's.",
                    type(host_pool).__name__,
                )
            return
        rank = int(getattr(self.storage_config, "tp_rank", 0))
        size = int(getattr(self.storage_config, "tp_size", 1))
        labels = {"engine": "sglang", "hook": "hicache", "rank": str(rank), "pool": key}
        metrics = LMCacheMetrics(labels=labels)
        if key in KV_SHAPED:
            layers = host_pool_layers(host_pool)
            page_size = int(host_pool.page_size)
            metadata = build_metadata(
                layers,
                model_name=self.facts.model_name,
                page_size=page_size,
                world_size=size,
                rank=rank,
                model_revision=self.facts.model_revision,
                quantization=self.facts.quantization,
                kv_cache_dtype=self.facts.kv_cache_dtype,
                model_digest=self.facts.model_digest,
            )
            connector: GPUConnectorInterface = CreateGPUConnector(
                self.config, metadata, layers.engine_info(page_size), layers.layout_hints
            )
            namespace = f"{self.namespace}/pool={key}"
        elif key in STATE_POOLS:
            page_bytes = int(host_pool.get_dummy_flat_data_page().numel())
            if int(host_pool.page_size) != 1 or page_bytes <= 0:
                raise KVLayoutError(
                    f"LMCacheHiCacheStorage: the {key} host pool {type(host_pool).__name__} "
                    f"has page_size={host_pool.page_size} and {page_bytes}-byte pages; lmcache "
                    "stores Mamba state pools of one state slot per page."
                )
            metadata = LMCacheMetadata(
                model_name=self.facts.model_name,
                world_size=size,
                worker_id=rank,
                local_worker_id=0,
                local_world_size=1,
                kv_dtype=torch.uint8,
                num_layers=1,
                num_kv_heads=1,
                head_size_k=page_bytes,
                head_size_v=0,
                use_mla=True,  # one opaque vector per slot; the rank stays in the key
                chunk_size=1,
                model_revision=self.facts.model_revision,
                quantization=self.facts.quantization,
                kv_cache_dtype=self.facts.kv_cache_dtype,
                model_digest=self.facts.model_digest,
            )
            connector = MambaStateConnector(self.config, metadata, host_pool)
            namespace = f"{self.namespace}/pool={key}/{_state_geometry(host_pool)}"
        else:
            raise KVLayoutError(
                f"LMCacheHiCacheStorage: SGLang registered the host pool {key!r} "
                f"({type(host_pool).__name__}); lmcache stores the KV pool and the "
                f"{', '.join(KV_SHAPED + STATE_POOLS)} pools of hybrid models only. Run this "
                "model with another --hicache-storage-backend (e.g. file) or without one."
            )
        if key in self.stores:
            self.stores[key].connector.close()
        self.stores[key] = PageStore(
            self.config,
            metadata,
            connector,
            process_cpu_tier(self.config, metrics),
            metrics,
            namespace,
        )
        self.host_pools[key] = host_pool
        logger.info(
            "lmcache HiCache backend: pool %s (%s) stored too: page=%d tokens, %d bytes",
            key,
            type(host_pool).__name__,
            metadata.chunk_size,
            metadata.chunk_bytes,
        )

    def _store(self, name: object) -> PageStore:
        key = pool_name(name)
        store = self.stores.get(key)
        if store is None:
            raise KeyError(f"no host pool {key!r} registered (register_mem_host_pool_v2)")
        return store

    # -- queries --------------------------------------------------------------------------

    @staticmethod
    def presence(store: PageStore, page_hashes: Sequence[str]) -> list[bool]:
        """Whether some tier holds each page (CPU tier first, then one batched query per lower
        tier for the rest; nothing read or verified; a failing tier holds nothing)."""
        keys = [store.key(h) for h in page_hashes]
        try:
            missing = store.tier.missing(keys)
        except Exception as exc:
            store.metrics.tier_errors.inc()
            logger.warning("CPU tier failed to look up pages (%r); treating it as a miss.", exc)
            missing = list(range(len(keys)))
        found = [True] * len(keys)
        for i in missing:
            found[i] = False
        if missing and store.lower_tiers:
            below = cascade.lower_presence(store.tiers, [keys[i] for i in missing])
            for j, i in enumerate(missing):
                found[i] = any(p[j] for p in below)
        return found

    def restorable(
        self, kv_pages: int, keys: Sequence[str], transfers: Sequence[Any]
    ) -> tuple[list[int], dict[str, int]]:
        """The prefix lengths (pages) every pool of ``transfers`` can serve, of the
        ``kv_pages`` leading KV pages of ``keys``, and each pool's longest one (its verdict).

        A pool that is not registered, or a hit policy lmcache does not know, serves none."""
        lengths = set(range(1, kv_pages + 1))
        hits: dict[str, int] = {"kv": kv_pages} if kv_pages else {}
        for transfer in transfers:
            if not lengths:
                break
            name = pool_name(transfer.name)
            policy = pool_name(getattr(transfer, "hit_policy", "all_pages"))
            store = self.stores.get(name)
            if store is None or policy not in ("all_pages", "trailing_pages"):
                logger.warning(
                    "lmcache HiCache backend: pool %s (hit policy %s) is not stored; no prefix "
                    "is restorable.",
                    name,
                    policy,
                )
                return [], hits
            present = self.presence(store, keys[:kv_pages])
            if policy == "all_pages":
                boundary = present.index(False) if False in present else kv_pages
                served = set(range(1, boundary + 1))
            else:  # the window of ``len(keys)`` pages before each length
                window = max(1, len(transfer.keys or ()))
                served = {n for n in range(1, kv_pages + 1) if all(present[max(0, n - window) : n])}
            if served:
                hits[name] = max(served)
            lengths &= served
        return sorted(lengths), hits

    def exists(self, kv: PageStore, keys: Sequence[str], transfers: Sequence[Any]) -> Any:
        """SGLang's ``PoolTransferResult`` for ``batch_exists_v2`` (see the module
        docstring)."""
        from sglang.srt.mem_cache.hicache_storage import PoolTransferResult

        kv_pages = kv.prefix_pages(list(keys))
        lengths, hits = self.restorable(kv_pages, keys, transfers)
        final = lengths[-1] if lengths else 0
        fields = {f.name for f in dataclasses.fields(PoolTransferResult)}
        if "restorable_prefix_pages" in fields:  # SGLang 0.5.23
            return PoolTransferResult(final, hits, lengths)
        return PoolTransferResult(final, hits)  # 0.5.17: the hit only

    # -- transfers ------------------------------------------------------------------------

    def _slots(self, transfer: Any, store: PageStore) -> tuple[list[str], torch.Tensor]:
        keys = [str(k) for k in transfer.keys or ()]
        indices = transfer.host_indices
        if indices is None:
            raise ValueError(f"pool {pool_name(transfer.name)}: no host_indices")
        slots = indices.to("cpu", torch.int64).reshape(-1)
        store.slot_spec(slots, len(keys))  # one page of slots per key
        return keys, slots

    def _each_pool(
        self,
        transfers: Sequence[Any],
        operation: Callable[[PageStore, list[str], torch.Tensor], int],
        failure: str,
    ) -> dict[str, list[bool]]:
        """Run ``operation`` on each transfer's store, keys and host slots; per key whether it
        is among the leading pages the operation reports done.

        A pool that is not registered, has bad slots or whose operation raises is logged with
        ``failure`` (formatted with the pool's name and the error) and has no key done.
        """
        out: dict[str, list[bool]] = {}
        for transfer in transfers:
            name = pool_name(transfer.name)
            n = len(transfer.keys or ())
            done = 0
            try:
                store = self._store(name)
                keys, slots = self._slots(transfer, store)
                done = operation(store, keys, slots)
            except Exception as exc:
                logger.warning(failure, name, exc)
            out[name] = [i < done for i in range(n)]
        return out

    @staticmethod
    def _load(store: PageStore, keys: list[str], slots: torch.Tensor) -> int:
        """The longest stored run of ``keys``, leased and verified, copied into ``slots``."""
        held = store.hold(keys)
        try:
            return store.load(held, slots[: len(held) * store.page_size])
        finally:
            held.release()

    def get(self, transfers: Sequence[Any]) -> dict[str, list[bool]]:
        """``batch_get_v2``: each pool's longest stored run of ``transfer.keys`` (leased and
        verified) copied into its host slots; per key whether it is there."""
        return self._each_pool(
            transfers,
            self._load,
            "lmcache HiCache backend: batch_get_v2 of pool %s failed (%r); a miss.",
        )

    def set(self, transfers: Sequence[Any]) -> dict[str, list[bool]]:
        """``batch_set_v2``: each pool's host pages stored under ``transfer.keys``; per key
        whether it is stored."""
        return self._each_pool(
            transfers,
            lambda store, keys, slots: store.store(keys, slots),
            "lmcache HiCache backend: batch_set_v2 of pool %s failed (%r).",
        )

    # -- lifecycle ------------------------------------------------------------------------

    def clear(self) -> None:
        """Drop every extra pool's pages of this model from every tier."""
        for store in self.stores.values():
            store.clear()

    def close(self, timeout: float = 10.0) -> None:
        """Wait for queued disk / remote writes, then close the connectors."""
        for store in self.stores.values():
            store.flush(timeout)
            store.connector.close()
