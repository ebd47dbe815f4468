# SPDX-License-Identifier: Apache-2.0
"""How a cache engine is built, given its connector, and closed.

:class:`EngineSetup` is the base of :class:`~lmcache.cache_engine.LMCacheEngine`.
It checks the configuration against the model, builds the tier stack and the helpers that
acquire hits, allocate and commit stores, and check loads.
It attaches the GPU connector and validates requests into plans.
:meth:`~EngineSetup.clear` and :meth:`~EngineSetup.close` end the engine's chunks and its life.
The request API (lookup, store, retrieve) lives in :mod:`lmcache.cache_engine`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from lmcache.config import ConfigError
from lmcache.engine.hits import HitReader
from lmcache.engine.load_checks import LoadChecker
from lmcache.engine.request_plan import ExtraKeys, RequestPlan, Tokens, plan_request
from lmcache.engine.stores import StoreWriter
from lmcache.engine.tiers import EngineTiers
from lmcache.gpu_connector.interface import (
    GPUConnectorInterface,
    TransferSpec,
    supports_layerwise,
)
from lmcache.memory import HostMemoryPool, aligned_bytes
from lmcache.metrics import LMCacheMetrics
from lmcache.tiers import CPUTier, LowerTier, cascade, process_lower_tiers

if TYPE_CHECKING:
    from lmcache.config import LMCacheConfig
    from lmcache.metadata import LMCacheMetadata

__all__ = ["EngineSetup"]

logger = logging.getLogger(__name__)


class EngineSetup:
    """Construction, connector, request planning and shutdown of an
    :class:`~lmcache.cache_engine.LMCacheEngine`; its docstring describes the arguments.
    """

    def __init__(
        self,
        config: LMCacheConfig,
        metadata: LMCacheMetadata,
        gpu_connector: GPUConnectorInterface | None = None,
        *,
        metrics: LMCacheMetrics | None = None,
        tier: CPUTier | None = None,
        lower_tiers: Sequence[LowerTier] | None = None,
    ) -> None:
        if config.chunk_size != metadata.chunk_size:
            raise ValueError(
                f"LMCacheEngine: config.chunk_size={config.chunk_size} but "
                f"metadata.chunk_size={metadata.chunk_size}; chunk keys depend on both, so they "
                "must agree. Build LMCacheMetadata with chunk_size=config.chunk_size."
            )
        self.config = config
        self.metadata = metadata
        self.chunk_size = config.chunk_size
        self.metrics = metrics if metrics is not None else LMCacheMetrics()
        self.lower_tiers: list[LowerTier] = list(
            process_lower_tiers(config) if lower_tiers is None else lower_tiers
        )
        self._owns_tier = tier is None
        if tier is None:
            staging = config.local_cpu or bool(self.lower_tiers)
            tier = CPUTier(
                HostMemoryPool(config.max_local_cpu_bytes if staging else 0), self.metrics
            )
        self.tier = tier
        self.pool = tier.pool
        self._fingerprint = metadata.fingerprint()
        self._engine_tiers = EngineTiers(
            cascade.TierStack(
                tier,
                tuple(self.lower_tiers),
                self._fingerprint,
                self.metrics,
                local_cpu=config.local_cpu,
                checksum=config.checksum_for(
                    gpu_connector.engine.device if gpu_connector is not None else "cpu"
                ),
            ),
            metadata,
            self.chunk_size,
        )
        self._hits = HitReader(self._engine_tiers)
        self._stores = StoreWriter(self._engine_tiers, save_unfull_chunk=config.save_unfull_chunk)
        self._loads = LoadChecker(self._engine_tiers)
        self._closed = False
        self._close_lock = threading.Lock()
        chunk_bytes = self._engine_tiers.chunk_bytes()
        self._check_cpu_budget(chunk_bytes)
        for lower in self.lower_tiers:
            lower.check_quota(chunk_bytes)
        self.gpu_connector: GPUConnectorInterface | None = None
        if gpu_connector is not None:
            self.set_gpu_connector(gpu_connector)
        if not config.local_cpu and not self.lower_tiers:
            logger.info("LMCacheEngine: local_cpu=False and no other tier: nothing is stored.")

    # ------------------------------------------------------------------ setup

    @property
    def _tiers(self) -> cascade.TierStack:
        """The tiers this engine cascades over (replaced when the checksum choice changes)."""
        return self._engine_tiers.stack

    def _check_cpu_budget(self, chunk_bytes: int) -> None:
        """Refuse a host budget below one chunk: every store would be dropped without a word.

        Raises:
            ConfigError: naming ``max_local_cpu_size``, the chunk's size and the smallest budget.
        """
        if not (self.config.local_cpu or self.lower_tiers):
            return  # nothing is stored or staged: the budget is unused
        need = aligned_bytes(chunk_bytes)
        if self.pool.budget_bytes < need:
            raise ConfigError(
                f"lmcache config key 'max_local_cpu_size': the host memory budget is "
                f"{self.pool.budget_bytes} bytes, below one chunk of this model "
                f"({self.chunk_size} tokens = {chunk_bytes} bytes), so nothing could be stored. "
                f"Raise max_local_cpu_size to at least {need / 1024**3:.6f} GB "
                "(a few chunks or more to be useful), or lower chunk_size."
            )

    def set_gpu_connector(self, gpu_connector: GPUConnectorInterface) -> None:
        """Attach the connector (e.g. once the engine has allocated its KV caches).

        Raises:
            ValueError: the connector's ``num_layers``, ``kv_width`` or ``dtype`` differ from
                ``metadata`` (the stored bytes would not match the keys' fingerprint).
        """
        md = self.metadata
        found = (gpu_connector.num_layers, gpu_connector.kv_width, gpu_connector.dtype)
        expected = (md.num_layers, md.kv_width, md.kv_dtype)
        if found != expected:
            raise ValueError(
                f"GPU connector {type(gpu_connector).__name__} moves (num_layers, kv_width, dtype)"
                f"={found}, but LMCacheMetadata describes {expected}. Build the metadata from the "
                "same KV caches the connector was given."
            )
        self.gpu_connector = gpu_connector
        checksum = self.config.checksum_for(
            gpu_connector.engine.device, gpu_connector.verifies_checksums
        )
        if checksum != self._tiers.checksum:
            self._engine_tiers.stack = dataclasses.replace(self._tiers, checksum=checksum)

    def _connector(self, action: str) -> GPUConnectorInterface:
        if self._closed:
            raise RuntimeError(f"LMCacheEngine.{action}: the engine is closed.")
        if self.gpu_connector is None:
            raise RuntimeError(
                f"LMCacheEngine.{action} needs a GPU connector, but this engine has none "
                "(gpu_connector=None). Pass one to LMCacheEngine(...) or call "
                "engine.set_gpu_connector(lmcache.gpu_connector.CreateGPUConnector(...))."
            )
        return self.gpu_connector

    def _layerwise_connector(self, action: str) -> GPUConnectorInterface:
        connector = self._connector(action)
        if not supports_layerwise(connector):
            raise TypeError(
                f"LMCacheEngine.{action} needs a connector implementing SupportsLayerwise; "
                f"{type(connector).__name__} does not. Use {action.removesuffix('_layerwise')}() "
                "or a layerwise connector (use_layerwise=True)."
            )
        return connector

    # ------------------------------------------------------------------ planning

    def _plan(
        self,
        tokens: Tokens,
        mask: torch.Tensor | None,
        transfer: TransferSpec | None,
        salt: str,
        extra_keys: ExtraKeys | None = None,
        *,
        lazy: bool = False,
        known_keys: Sequence[bytes] = (),
    ) -> RequestPlan:
        """Validate a request and compute its chunk keys (``lazy``: as far as they are read,
        for lookups; ``known_keys``: the leading ones, computed before)."""
        return plan_request(
            tokens,
            mask,
            transfer,
            chunk_size=self.chunk_size,
            fingerprint=self._fingerprint,
            salt=self.config.cache_salt + "\0" + salt,
            extra_keys=extra_keys,
            lazy=lazy,
            known_keys=known_keys,
        )

    def clear(self) -> None:
        """Drop the chunks this engine's model stored (owner: its metadata fingerprint).

        On a shared tier (:func:`lmcache.tiers.process_cpu_tier`) the chunks of engines with
        other fingerprints (other models, geometry or ranks) stay. Engines with the same
        fingerprint share their chunks (same keys), so those go too. Leases held on the bytes
        (a :class:`~lmcache.engine.held_hit.HeldHit`, a retrieve in flight) stay valid.

        The lower tiers drop this fingerprint's entries too (after their queued writes land),
        including those other processes of the same model stored on a shared disk folder or
        Redis namespace: after a weight update, none of them is valid any more.
        """
        cascade.clear(self._tiers)

    def close(self) -> None:
        """Drop every chunk of a private CPU tier, wait (up to 10 s) for queued disk/remote
        writes, close the connector; later calls raise. Lower tiers stay open (process-wide)."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if self._owns_tier:
            self.tier.clear()
        cascade.flush(self._tiers, 10.0)  # so what this engine stored survives a restart
        if self.gpu_connector is not None:
            self.gpu_connector.close()
