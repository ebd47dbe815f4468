# SPDX-License-Identifier: Apache-2.0
"""The cache engine: chunked ``lookup`` / ``store`` / ``retrieve`` of a request's KV.

A request's tokens are cut into chunks of ``chunk_size`` tokens (the last may be partial), each
keyed by :func:`lmcache.keys.chunk_keys` (a hash chained over every earlier chunk, seeded with the
model fingerprint and the cache salt). Chunks live in the :class:`~lmcache.tiers.CPUTier` as host
buffers ``[num_layers, chunk_tokens, kv_width]``.

Semantics (LMCache's):

- ``mask`` (bool ``[num_tokens]``) has ``False`` for a chunk-aligned prefix of tokens the caller
  skips (already stored, or already in the engine). Those chunks are hashed (the key chain needs
  them) but neither stored nor loaded.
- :meth:`LMCacheEngine.store` saves the chunks after the masked prefix that are not stored yet;
  the trailing partial chunk only with ``config.save_unfull_chunk``. When memory runs short it
  stores the leading chunks that fit and counts ``failed_allocations``; it never blocks.
- :meth:`LMCacheEngine.retrieve` loads the longest run of present chunks right after the masked
  prefix (a missing chunk ends it) and returns a mask that is ``True`` exactly for the tokens of
  the loaded chunks.
- Each store or retrieve is one batched connector call (``from_gpu`` / ``to_gpu``) for all of its
  chunks; the layerwise variants make one call per layer.
- A tier that fails is a miss (counted in ``tier_errors``). A connector that fails raises: the
  engine's KV memory is in an unknown state, and the caller must not trust it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lmcache.gpu_connector.interface import (
    ChunkTransfer,
    GPUConnectorInterface,
    TransferSpec,
    supports_layerwise,
)
from lmcache.keys import chunk_keys, chunk_ranges
from lmcache.layerwise import LayerwiseRetrieve, LayerwiseStore, Pending, release_all
from lmcache.memory import HostMemoryPool
from lmcache.metrics import LMCacheMetrics
from lmcache.tiers import CPUTier

if TYPE_CHECKING:
    from lmcache.config import LMCacheConfig
    from lmcache.metadata import LMCacheMetadata

__all__ = ["LMCacheEngine", "LayerwiseRetrieve", "LayerwiseStore", "Tokens"]

logger = logging.getLogger(__name__)

#: Token ids of one request: a sequence of ints or a 1-D integer tensor ``[num_tokens]``.
Tokens = Sequence[int] | torch.Tensor


@dataclass(frozen=True)
class _Plan:
    """A request cut into chunks: ``keys[i]`` is the key of tokens ``ranges[i]``."""

    num_tokens: int
    keys: list[bytes]
    ranges: list[tuple[int, int]]
    first_chunk: int  # first chunk after the masked prefix


class LMCacheEngine:
    """Stores and retrieves a serving engine's KV cache in chunks.

    Args:
        config: lmcache configuration (``chunk_size``, ``max_local_cpu_size``, ``checksum``,
            ``save_unfull_chunk``, ``cache_salt``, ...).
        metadata: Model geometry; its fingerprint seeds every key.
        gpu_connector: Moves KV between the engine and host buffers. Needed by store and
            retrieve (not by lookup); may be set later with :meth:`set_gpu_connector`.
        metrics: Where to count; a fresh :class:`~lmcache.metrics.LMCacheMetrics` when ``None``.
        tier: The CPU tier to use, e.g. :func:`lmcache.tiers.process_cpu_tier` to share one
            across the engines of a process. ``None`` builds a private pool and tier sized by
            ``config.max_local_cpu_size``. A shared tier is not emptied by :meth:`close`.

    Raises:
        ValueError: ``config.chunk_size`` differs from ``metadata.chunk_size``, or the connector's
            geometry differs from ``metadata``.
    """

    def __init__(
        self,
        config: LMCacheConfig,
        metadata: LMCacheMetadata,
        gpu_connector: GPUConnectorInterface | None = None,
        *,
        metrics: LMCacheMetrics | None = None,
        tier: CPUTier | None = None,
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
        self._owns_tier = tier is None
        if tier is None:
            tier = CPUTier(
                HostMemoryPool(config.max_local_cpu_bytes if config.local_cpu else 0), self.metrics
            )
        self.tier = tier
        self.pool = tier.pool
        self._fingerprint = metadata.fingerprint()
        self._closed = False
        self._close_lock = threading.Lock()
        self.gpu_connector: GPUConnectorInterface | None = None
        if gpu_connector is not None:
            self.set_gpu_connector(gpu_connector)
        if not config.local_cpu:
            logger.info("LMCacheEngine: local_cpu=False and no other tier: nothing is stored.")

    # ------------------------------------------------------------------ setup

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
        self, tokens: Tokens, mask: torch.Tensor | None, transfer: TransferSpec | None, salt: str
    ) -> _Plan:
        """Validate a request and compute its chunk keys."""
        if isinstance(tokens, torch.Tensor) and tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D [num_tokens], found shape {tuple(tokens.shape)}")
        num_tokens = len(tokens)
        cs = self.chunk_size
        masked = 0
        if mask is not None:
            if mask.dtype != torch.bool or mask.dim() != 1 or mask.shape[0] != num_tokens:
                raise ValueError(
                    f"mask must be a bool tensor [num_tokens={num_tokens}], found "
                    f"{mask.dtype} {tuple(mask.shape)}."
                )
            mask = mask.cpu()
            masked = int((~mask).sum())
            if bool((~mask[masked:]).any()):
                raise ValueError(
                    "mask's False entries must be a prefix (tokens to skip, then tokens to "
                    f"transfer), found {masked} False entries not all at the start. Mask only a "
                    "leading, chunk-aligned run of tokens."
                )
            if masked % cs != 0 and masked != num_tokens:
                raise ValueError(
                    f"mask's False prefix must be a multiple of chunk_size={cs}, found {masked} "
                    f"masked tokens. Round the skipped prefix down to a multiple of {cs}."
                )
        if transfer is not None:
            sm = transfer.slot_mapping
            if sm.dim() != 1 or sm.shape[0] != num_tokens:
                raise ValueError(
                    f"transfer.slot_mapping must be [num_tokens={num_tokens}] (one slot per token "
                    f"of the request), found shape {tuple(sm.shape)}."
                )
        keys = chunk_keys(tokens, self._fingerprint, cs, salt=self.config.cache_salt + "\0" + salt)
        ranges = chunk_ranges(num_tokens, cs)
        return _Plan(num_tokens, keys, ranges, -(-masked // cs))

    def _chunk_shape(self, num_tokens: int) -> tuple[int, int, int]:
        return (self.metadata.num_layers, num_tokens, self.metadata.kv_width)

    def _tier_error(self, action: str, exc: Exception) -> None:
        self.metrics.tier_errors.inc()
        logger.warning("CPU tier failed to %s (%r); treating it as a miss.", action, exc)

    def _present(self, key: bytes) -> bool:
        try:
            return self.tier.touch(key)
        except Exception as exc:
            self._tier_error("look up a chunk", exc)
            return False

    def _allocate_store(self, plan: _Plan) -> list[Pending]:
        """Lease buffers for the chunks a store saves (leading ones only when memory is short)."""
        pending: list[Pending] = []
        if not self.config.local_cpu:
            return pending
        todo = []
        for i in range(plan.first_chunk, len(plan.keys)):
            start, end = plan.ranges[i]
            if end - start < self.chunk_size and not self.config.save_unfull_chunk:
                continue  # trailing partial chunk
            if not self._present(plan.keys[i]):  # present ones are touched: kept from eviction
                todo.append(i)
        for i in todo:
            start, end = plan.ranges[i]
            try:
                lease = self.tier.allocate(self._chunk_shape(end - start), self.metadata.kv_dtype)
            except Exception as exc:
                self._tier_error("allocate", exc)
                lease = None
            if lease is None:
                self.metrics.failed_allocations.inc()
                logger.debug(
                    "Out of host memory: storing %d of %d chunks.", len(pending), len(todo)
                )
                break
            pending.append(Pending(plan.keys[i], ChunkTransfer(start, end, lease.tensor), lease))
        return pending

    def _commit_store(self, pending: Sequence[Pending], started: float) -> int:
        """Checksum the filled buffers and hand them to the tier; returns tokens stored."""
        stored_tokens = stored_bytes = 0
        checksums: list[int | None] = [None] * len(pending)
        if self.config.checksum:
            checksums = list(self.tier.checksums([p.lease.tensor for p in pending]))
        for p, checksum in zip(pending, checksums, strict=True):
            try:
                self.tier.put(p.key, p.lease, checksum)
            except Exception as exc:
                self._tier_error("store a chunk", exc)
                break
            stored_tokens += p.chunk.num_tokens
            stored_bytes += p.lease.nbytes
            self.metrics.stored_chunks.inc()
        self.metrics.stored_bytes.inc(stored_bytes)
        self.metrics.store_seconds.observe(time.perf_counter() - started)
        return stored_tokens

    def _acquire_hits(self, plan: _Plan) -> list[Pending]:
        """Leases on the longest run of present chunks after the masked prefix."""
        pending: list[Pending] = []
        for i in range(plan.first_chunk, len(plan.keys)):
            start, end = plan.ranges[i]
            try:
                lease = self.tier.get(plan.keys[i])
            except Exception as exc:
                self._tier_error("get a chunk", exc)
                lease = None
            if lease is None:
                break
            if lease.tensor.shape != self._chunk_shape(end - start):
                logger.warning(
                    "Chunk %s has shape %s, expected %s; treating it as a miss.",
                    plan.keys[i].hex(),
                    tuple(lease.tensor.shape),
                    self._chunk_shape(end - start),
                )
                lease.release()
                break
            pending.append(Pending(plan.keys[i], ChunkTransfer(start, end, lease.tensor), lease))
        return pending

    def _hit_mask(self, plan: _Plan, pending: Sequence[Pending]) -> torch.Tensor:
        mask = torch.zeros(plan.num_tokens, dtype=torch.bool)
        if pending:
            mask[pending[0].chunk.start : pending[-1].chunk.end] = True
        return mask

    def _count_loaded(self, pending: Sequence[Pending], started: float) -> None:
        self.metrics.loaded_chunks.inc(len(pending))
        self.metrics.loaded_bytes.inc(sum(p.lease.nbytes for p in pending))
        self.metrics.retrieve_seconds.observe(time.perf_counter() - started)

    # ------------------------------------------------------------------ public API

    def lookup(self, tokens: Tokens, *, salt: str = "") -> int:
        """Number of leading tokens whose chunks are stored (a stored partial last chunk counts).

        Found chunks are marked recently used, so a retrieve soon after is likely to find them.
        """
        if self._closed:
            raise RuntimeError("LMCacheEngine.lookup: the engine is closed.")
        plan = self._plan(tokens, None, None, salt)
        hit = 0
        for key, (_, end) in zip(plan.keys, plan.ranges, strict=True):
            if not self._present(key):
                break
            hit = end
        self.metrics.lookup_requests.inc()
        self.metrics.lookup_tokens.inc(plan.num_tokens)
        self.metrics.hit_tokens.inc(hit)
        return hit

    def store(
        self,
        tokens: Tokens,
        mask: torch.Tensor | None,
        transfer: TransferSpec,
        *,
        salt: str = "",
    ) -> int:
        """Save the KV of ``tokens`` from the engine (one ``from_gpu`` call for all chunks).

        Args:
            tokens: The request's token ids ``[num_tokens]``.
            mask: bool ``[num_tokens]``; ``False`` marks a chunk-aligned prefix not to store.
                ``None`` stores from the first token.
            transfer: Where the tokens' KV is in the engine (``slot_mapping`` ``[num_tokens]``).
            salt: Per-request cache salt (tenant isolation), combined with ``config.cache_salt``.

        Returns:
            Number of tokens newly stored.

        Raises:
            ValueError: a malformed mask or slot mapping.
            RuntimeError: no connector. Errors of the connector are raised as they are.
        """
        connector = self._connector("store")
        started = time.perf_counter()
        pending = self._allocate_store(self._plan(tokens, mask, transfer, salt))
        if not pending:
            return 0
        try:
            connector.from_gpu([p.chunk for p in pending], transfer)
            return self._commit_store(pending, started)
        finally:
            release_all(pending)

    def retrieve(
        self,
        tokens: Tokens,
        mask: torch.Tensor | None,
        transfer: TransferSpec,
        *,
        salt: str = "",
    ) -> torch.Tensor:
        """Load the longest stored prefix of ``tokens`` into the engine (one ``to_gpu`` call).

        The chunk buffers stay leased until the connector's copies have finished
        (:meth:`~lmcache.gpu_connector.GPUConnectorInterface.synchronize`), so they cannot be
        evicted and reused under an in-flight copy.

        Args:
            tokens: The request's token ids ``[num_tokens]``.
            mask: bool ``[num_tokens]``; ``False`` marks a chunk-aligned prefix not to load.
            transfer: The request's slots; ``transfer.skip_tokens`` leading slots are not written.
            salt: Per-request cache salt.

        Returns:
            bool ``[num_tokens]`` on the CPU, ``True`` exactly for the tokens of loaded chunks.

        Raises:
            ValueError: a malformed mask or slot mapping.
            RuntimeError: no connector. Errors of the connector are raised as they are.
        """
        connector = self._connector("retrieve")
        started = time.perf_counter()
        plan = self._plan(tokens, mask, transfer, salt)
        pending = self._acquire_hits(plan)
        if not pending:
            return self._hit_mask(plan, pending)
        try:
            try:
                connector.to_gpu([p.chunk for p in pending], transfer)
            finally:
                connector.synchronize()
        finally:
            release_all(pending)
        self._count_loaded(pending, started)
        return self._hit_mask(plan, pending)

    def store_layerwise(
        self,
        tokens: Tokens,
        mask: torch.Tensor | None,
        transfer: TransferSpec,
        *,
        salt: str = "",
    ) -> LayerwiseStore:
        """Like :meth:`store`, one layer at a time; see :class:`LayerwiseStore`.

        Chunks are chosen and their buffers leased now; nothing is visible to lookups until
        :meth:`LayerwiseStore.finish`.

        Raises:
            TypeError: the connector does not implement ``SupportsLayerwise``.
        """
        connector = self._layerwise_connector("store_layerwise")
        started = time.perf_counter()
        pending = self._allocate_store(self._plan(tokens, mask, transfer, salt))
        return LayerwiseStore(self, connector, pending, transfer, started)

    def retrieve_layerwise(
        self,
        tokens: Tokens,
        mask: torch.Tensor | None,
        transfer: TransferSpec,
        *,
        salt: str = "",
    ) -> LayerwiseRetrieve:
        """Like :meth:`retrieve`, one layer at a time; see :class:`LayerwiseRetrieve`.

        The hit chunks are found and leased now (``num_hit_tokens`` is known at once).

        Raises:
            TypeError: the connector does not implement ``SupportsLayerwise``.
        """
        connector = self._layerwise_connector("retrieve_layerwise")
        started = time.perf_counter()
        plan = self._plan(tokens, mask, transfer, salt)
        pending = self._acquire_hits(plan)
        return LayerwiseRetrieve(
            self, connector, pending, transfer, self._hit_mask(plan, pending), started
        )

    def clear(self) -> None:
        """Drop every stored chunk of this engine's tier.

        With a shared tier (:func:`lmcache.tiers.process_cpu_tier`) that is every chunk of the
        process, whichever engine stored it.
        """
        self.tier.clear()

    def close(self) -> None:
        """Drop every chunk of a private tier, close the connector; later calls raise."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if self._owns_tier:
            self.tier.clear()
        if self.gpu_connector is not None:
            self.gpu_connector.close()
