# SPDX-License-Identifier: Apache-2.0
"""lmcache as a SGLang HiCache storage backend (L3 below SGLang's host cache, SGLang 0.5.17+).

Load it with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "lmcache",
        "module_path": "lmcache_sglang.hicache_backend", "class_name": "LMCacheHiCacheStorage",
        "interface_v1": 1, "max_local_cpu_size": 8}'

Keys of the extra config that SGLang reads (``backend_name``, ``module_path``, ``class_name``,
``interface_v1``, ``prefetch_*``, ``hicache_storage_pass_prefix_keys``) are left to SGLang; the
others are lmcache config keys (and ``config_file``), merged with ``LMCACHE_*`` as everywhere.

SGLang moves pages between its device cache and its host pool itself, and asks the backend to
store or fetch host pages by page hash: with ``interface_v1: 1`` through the zero-copy
``batch_set_v1`` / ``batch_get_v1`` (host indices into the registered host pool), otherwise
through ``batch_set`` / ``batch_get`` with flat page tensors. Both work in the ``layer_first``,
``page_first`` and ``page_first_direct`` host layouts: pages are stored in lmcache's canonical
chunk format ``[num_layers, page_size, kv_width]``, so a page stored from one layout loads into
another. SGLang's page hashes carry no model or rank; lmcache adds the model fingerprint (model,
revision, quantization, KV dtype, geometry), the tensor-parallel rank and size (not for MLA,
whose pages are the same on every rank), the pipeline stage and the context-parallel rank
(:mod:`lmcache_sglang.page_store`). Prefetch and backup run on SGLang's own threads, so this
backend is asynchronous to the forward pass; it is not layerwise (SGLang loads host pages into
the device layer by layer itself).

A batch costs one allocation, one publish and one lease of its pages. Its bytes move with one
strided copy of all layers per run of consecutive host pages (zero-copy: the connector's
one-copy path) or per flat page, never with per-layer indexing: SGLang's storage threads call
in while its scheduler thread runs Python, so every extra torch call may wait for the GIL.

Pages live in every tier lmcache is configured with: ``batch_exists`` spans CPU -> disk ->
remote, a get reads pages found only below the CPU tier into host memory, verified, before
copying them into SGLang's host pool, and a set writes the CPU tier and queues the pages for the
disk / remote tiers (write-through, asynchronous; ``close`` waits for the queue).
The connector moves pages between lmcache and SGLang's host pool, which is CPU memory, so
``checksum_for("cpu")`` is on by default: every page is hashed on the host when stored and
verified there before it is copied into the host pool (``checksum: false`` turns it off).

Every failure is a miss (``False`` / ``None`` / a shorter prefix), logged, never an exception
into SGLang's storage threads; bad configuration raises at construction.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch

from lmcache.gpu_connector import CreateGPUConnector
from lmcache.metrics import LMCacheMetrics
from lmcache.tiers import process_cpu_tier
from lmcache_sglang.hicache_pools import PoolStores
from lmcache_sglang.hook_config import ModelFacts, hook_config, log_start_line, model_facts
from lmcache_sglang.kv_pools import build_metadata, host_pool_layers
from lmcache_sglang.page_store import PageStore
from lmcache_sglang.sglang_types import HostKVPool

try:  # SGLang's interface; this module is only imported by SGLang's backend factory.
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
except ImportError as exc:  # pragma: no cover - depends on the installed engine
    raise ImportError(
        f"lmcache_sglang.hicache_backend needs SGLang 0.5.17 or newer (HiCacheStorage): {exc}"
    ) from exc

__all__ = ["SGLANG_EXTRA_KEYS", "LMCacheHiCacheStorage"]

logger = logging.getLogger(__name__)

_NOT_REGISTERED = (
    "LMCacheHiCacheStorage: no host pool registered yet (SGLang calls "
    "register_mem_pool_host before any transfer)"
)

SGLANG_EXTRA_KEYS = (
    "backend_name",
    "module_path",
    "class_name",
    "interface_v1",
    "prefetch_threshold",
    "prefetch_timeout_base",
    "prefetch_timeout_per_ki_token",
    "hicache_storage_pass_prefix_keys",
)
"""Keys of ``--hicache-storage-backend-extra-config`` that belong to SGLang."""


def _server_model_facts(fallback: str | None) -> ModelFacts:
    """Model facts from SGLang's runtime context when it is set (the scheduler), else the
    model name HiCache passes."""
    try:
        from sglang.srt.runtime_context import get_server_args

        return model_facts(get_server_args())
    except Exception:
        return ModelFacts(model_name=str(fallback or ""))


class LMCacheHiCacheStorage(HiCacheStorage):  # type: ignore[misc]  # SGLang is untyped here
    """SGLang ``HiCacheStorage`` over lmcache's tiers (see the module docstring).

    Args:
        storage_config: SGLang's ``HiCacheStorageConfig`` (ranks, MLA, model name, extra config).
        kwargs: Extra arguments of SGLang's dynamic backend factory (unused).

    Raises:
        ConfigError: bad lmcache configuration.
    """

    def __init__(self, storage_config: object, kwargs: Any = None) -> None:
        self.storage_config = storage_config
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        self.config = hook_config(
            extra, hook="--hicache-storage-backend-extra-config", ignore=SGLANG_EXTRA_KEYS
        )
        self.facts = _server_model_facts(getattr(storage_config, "model_name", None))
        if not self.facts.model_name:
            raise ValueError(
                "LMCacheHiCacheStorage: SGLang passed no model name (HiCacheStorageConfig."
                "model_name); lmcache keys every page with the model and cannot run without one."
            )
        self.is_mla = bool(getattr(storage_config, "is_mla_model", False))
        self.store: PageStore | None = None
        self.mem_pool_host: HostKVPool | None = None

    # -- setup ----------------------------------------------------------------------------

    def _namespace(self) -> str:
        c = self.storage_config
        parts = [
            f"pp{getattr(c, 'pp_rank', 0)}of{getattr(c, 'pp_size', 1)}",
            f"cp{getattr(c, 'attn_cp_rank', 0)}of{getattr(c, 'attn_cp_size', 1)}",
            f"dcp{getattr(c, 'dcp_rank', 0)}of{getattr(c, 'dcp_size', 1)}",
        ]
        if getattr(c, "should_split_heads", False):
            parts.append(f"split{getattr(c, 'tp_lcm_size', None)}")
        return "hicache/" + "/".join(parts)

    def register_mem_pool_host(self, mem_pool_host: HostKVPool) -> None:
        """Attach SGLang's host pool: read its geometry and build the page store over it.

        Raises:
            KVLayoutError: a host pool or layout lmcache does not handle.
        """
        super().register_mem_pool_host(mem_pool_host)
        layers = host_pool_layers(mem_pool_host)
        page_size = int(mem_pool_host.page_size)
        c = self.storage_config
        metadata = build_metadata(
            layers,
            model_name=self.facts.model_name,
            page_size=page_size,
            world_size=int(getattr(c, "tp_size", 1)),
            rank=int(getattr(c, "tp_rank", 0)),
            model_revision=self.facts.model_revision,
            quantization=self.facts.quantization,
            kv_cache_dtype=self.facts.kv_cache_dtype,
            model_digest=self.facts.model_digest,
        )
        if self.is_mla != metadata.use_mla:
            raise ValueError(
                f"LMCacheHiCacheStorage: SGLang says is_mla_model={self.is_mla} but the host "
                f"pool {type(mem_pool_host).__name__} is {'MLA' if metadata.use_mla else 'MHA'}"
            )
        connector = CreateGPUConnector(
            self.config, metadata, layers.engine_info(page_size), layers.layout_hints
        )
        metrics = LMCacheMetrics(
            labels={"engine": "sglang", "hook": "hicache", "rank": str(metadata.worker_id)}
        )
        self.store = PageStore(
            self.config,
            metadata,
            connector,
            process_cpu_tier(self.config, metrics),
            metrics,
            self._namespace(),
        )
        self.layout = str(mem_pool_host.layout)
        # the KV this backend copies lives in SGLang's host pool: no device kernels run here
        log_start_line("HiCache storage backend", layers.device)
        logger.info(
            "lmcache HiCache backend ready: model=%s rank=%d/%d mla=%s layout=%s page=%d",
            metadata.model_name,
            metadata.worker_id,
            metadata.world_size,
            metadata.use_mla,
            self.layout,
            page_size,
        )

    def _store(self) -> PageStore:
        if self.store is None:
            raise RuntimeError(_NOT_REGISTERED)
        return self.store

    def _host(self) -> HostKVPool:
        if self.mem_pool_host is None:
            raise RuntimeError(_NOT_REGISTERED)
        return self.mem_pool_host

    def _miss(self, what: str, exc: BaseException) -> None:
        logger.warning("lmcache HiCache backend: %s failed (%r); treating it as a miss.", what, exc)

    # -- zero-copy (interface_v1) ---------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Number of leading pages of ``keys`` that are stored."""
        try:
            return self._store().prefix_pages(list(keys))
        except Exception as exc:
            self._miss("batch_exists", exc)
            return 0

    def exists(self, key: str) -> bool:
        try:
            return self._store().contains(key)
        except Exception as exc:
            self._miss("exists", exc)
            return False

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Store the host pages at ``host_indices`` (``[len(keys) * page_size]``) under ``keys``."""
        try:
            stored = self._store().store(list(keys), host_indices.to("cpu", torch.int64))
        except Exception as exc:
            self._miss("batch_set_v1", exc)
            stored = 0
        return [i < stored for i in range(len(keys))]

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Load the longest stored prefix of ``keys`` into the host pages at ``host_indices``."""
        loaded = 0
        try:
            store = self._store()
            slots = host_indices.to("cpu", torch.int64)
            store.slot_spec(slots, len(keys))  # validates the slot count
            held = store.hold(list(keys))
            try:
                loaded = store.load(held, slots[: len(held) * store.page_size])
            finally:
                held.release()
        except Exception as exc:
            self._miss("batch_get_v1", exc)
        return [i < loaded for i in range(len(keys))]

    # -- flat pages (the generic interface) -----------------------------------------------

    def _page_dims(self, meta: Any) -> tuple[int, ...]:
        """Dims of one flat page as SGLang's ``get_data_page`` lays it out."""
        L, ps = meta.num_layers, meta.chunk_size
        tail: tuple[int, ...] = (
            (1, meta.head_size_k)
            if meta.use_mla
            else (
                meta.num_kv_heads,
                meta.head_size_k,
            )
        )
        dims = {
            "layer_first": (L, ps, *tail),
            "page_first": (ps, L, *tail),
            "page_first_direct": (1, L, ps, *tail),
        }[self.layout]
        return dims if meta.use_mla else (2, *dims)

    def _page_view(self, page: Any) -> torch.Tensor:
        """One flat page (``get_data_page`` of the host pool) as ``[num_layers, page_size,
        parts, heads, head_dim]`` (MLA: ``[num_layers, page_size, 1, latent]``), a view: the
        canonical page's order, whatever the host layout.

        Raises:
            ValueError: not a flat page of this pool.
        """
        md = self._store().metadata
        dims = self._page_dims(md)
        if not isinstance(page, torch.Tensor) or page.numel() != math.prod(dims):
            raise ValueError(
                f"expected a flat page of {math.prod(dims)} {md.kv_dtype} elements ({list(dims)} "
                f"in the {self.layout} layout), found {getattr(page, 'shape', type(page).__name__)}"
            )
        view = page.view(md.kv_dtype).view(dims)
        if not md.use_mla:
            view = view.movedim(0, -3)  # K and V next to the heads, as in a canonical row
        if self.layout == "page_first":
            return view.transpose(0, 1)
        return view[0] if self.layout == "page_first_direct" else view

    def set(
        self,
        key: str,
        value: Any = None,
        target_location: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store one flat page (``get_data_page(...)`` of the host pool) under ``key``."""
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store flat pages under ``keys``: one strided copy per page into its buffer, one
        allocation and one publish for them all; ``True`` when every page is stored."""
        try:
            if values is None or len(values) != len(keys):
                raise ValueError("one flat page per key expected")
            pages = [self._page_view(v) for v in values]
            return self._store().put_pages(list(keys), pages) == len(keys)
        except Exception as exc:
            self._miss("batch_set", exc)
            return False

    def get(
        self,
        key: str,
        target_location: Any = None,
        target_sizes: Any = None,
    ) -> torch.Tensor | None:
        """Fill ``target_location`` (a flat page; a new one when ``None``) with page ``key``."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> list[torch.Tensor | None]:
        """Fill the flat pages ``target_locations`` (new ones where ``None``) with the longest
        stored prefix of ``keys`` (leased and verified at once), one strided copy per page;
        ``None`` from the first page not stored on."""
        targets: list[Any] = list(target_locations or [])
        targets += [None] * (len(keys) - len(targets))
        out: list[torch.Tensor | None] = [None] * len(keys)
        try:
            store = self._store()
            started = time.perf_counter()
            held = store.hold(list(keys))
            try:
                for i, lease in enumerate(held.leases):
                    target = targets[i]
                    if target is None:
                        target = self._host().get_dummy_flat_data_page()
                    view = self._page_view(target)
                    view.copy_(lease.tensor.view(view.shape))
                    out[i] = target
            finally:
                held.release()
            loaded = sum(page is not None for page in out)
            store.metrics.loaded_chunks.inc(loaded)
            store.metrics.loaded_bytes.inc(sum(lease.nbytes for lease in held.leases[:loaded]))
            store.metrics.retrieve_seconds.observe(time.perf_counter() - started)
        except Exception as exc:
            self._miss("batch_get", exc)
        n = next((i for i, page in enumerate(out) if page is None), len(out))
        return out[:n] + [None] * (len(keys) - n)  # a prefix: SGLang stops at the first miss

    # -- hybrid models: extra host pools (HiCache v2, lmcache_sglang.hicache_pools) --------

    _extra_pools: PoolStores | None = None

    def _pools(self) -> PoolStores:
        if self._extra_pools is None:
            self._extra_pools = PoolStores(
                self.config, self.facts, self.storage_config, self._namespace()
            )
        return self._extra_pools

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Store SGLang's extra host pool ``host_pool_name`` too: sliding-window KV and Mamba
        state (:mod:`lmcache_sglang.hicache_pools`); the KV pool is the one already registered.

        Raises:
            KVLayoutError: a pool lmcache does not store (named in the error).
        """
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._pools().register(host_pool, host_pool_name, self.mem_pool_host)

    def batch_exists_v2(
        self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None
    ) -> Any:
        """The prefixes of ``keys`` whose KV and every pool of ``pool_transfers`` are stored
        (SGLang's ``PoolTransferResult``, ``restorable_prefix_pages`` on 0.5.23)."""
        try:
            return self._pools().exists(self._store(), list(keys), list(pool_transfers or ()))
        except Exception as exc:
            self._miss("batch_exists_v2", exc)
            from sglang.srt.mem_cache.hicache_storage import PoolTransferResult

            return PoolTransferResult.empty()

    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> dict[str, list[bool]]:
        """Load each pool's stored, verified pages into its host slots; per key, loaded."""
        return self._pools().get(list(transfers or ()))

    def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> dict[str, list[bool]]:
        """Store each pool's host pages under its keys; per key, stored."""
        return self._pools().set(list(transfers or ()))

    # -- lifecycle ------------------------------------------------------------------------

    def clear(self) -> None:
        """Drop the pages this model and rank stored from every tier (other models' pages
        stay)."""
        if self.store is not None:
            self.store.clear()
        self._pools().clear()

    def close(self) -> None:
        """Wait (up to 10 s) for queued disk / remote writes, then close the connector."""
        if self.store is not None:
            self.store.flush(10.0)
            self.store.connector.close()
        self._pools().close()
