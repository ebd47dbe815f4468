# SPDX-License-Identifier: Apache-2.0
"""KV pages keyed by SGLang's page hashes, kept in lmcache's CPU tier.

SGLang's storage hooks (``UnifiedCacheLinker``, ``HiCacheStorage``) name each page of
``page_size`` tokens by a hash string: SHA-256 chained over the previous page's digest and the
page's tokens, seeded with the request's namespace (SGLang's ``extra_key``, which carries the
LoRA adapter, and ``cache_salt``). That string carries no model and no rank, so a
:class:`PageStore` keys every page as::

    key = xxh3_128(b"lmcache-sglang-page-v1\\0" + fingerprint + b"\\0" + config.cache_salt
                   + b"\\0" + namespace + b"\\0" + page_hash).digest()

where ``fingerprint`` is :meth:`lmcache.metadata.LMCacheMetadata.fingerprint` (model, revision,
quantization, KV dtype, geometry, tensor-parallel rank and size) and ``namespace`` names what else
shapes the bytes (pipeline stage, host pool). A page is one chunk of the canonical format
``[num_layers, page_size, kv_width]``, checksummed in the tier like every lmcache chunk; pages of
one request are moved with one connector call.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xxhash

from lmcache.config import LMCacheConfig
from lmcache.gpu_connector.interface import ChunkTransfer, GPUConnectorInterface, TransferSpec
from lmcache.memory import MemoryLease
from lmcache.metadata import LMCacheMetadata
from lmcache.metrics import LMCacheMetrics
from lmcache.tiers import CPUTier

__all__ = ["PAGE_KEY_FORMAT", "HeldPages", "PageStore"]

logger = logging.getLogger(__name__)

PAGE_KEY_FORMAT = b"lmcache-sglang-page-v1\0"
"""Domain tag of page keys."""


@dataclass
class HeldPages:
    """Verified leases on a run of stored pages, in page order; release when done."""

    leases: list[MemoryLease]

    def __len__(self) -> int:
        return len(self.leases)

    def release(self) -> None:
        """Release every lease not released yet (idempotent)."""
        for lease in self.leases:
            if not lease.released:
                lease.release()

    def chunks(self, page_size: int) -> list[ChunkTransfer]:
        """The pages as chunks of a request whose tokens are these pages in order."""
        return [
            ChunkTransfer(i * page_size, (i + 1) * page_size, lease.tensor)
            for i, lease in enumerate(self.leases)
        ]


class PageStore:
    """Stores and loads SGLang pages by page hash on a :class:`~lmcache.tiers.CPUTier`.

    Args:
        config: lmcache configuration (``cache_salt``, ``checksum``, ``local_cpu``).
        metadata: Geometry; ``metadata.chunk_size`` must be SGLang's ``page_size``.
        connector: Moves pages between SGLang's pool and page buffers.
        tier: The CPU tier (usually :func:`lmcache.tiers.process_cpu_tier`).
        metrics: Where to count.
        namespace: Extra key material (pipeline stage, pool name).

    Raises:
        ValueError: the connector's geometry differs from ``metadata``.
    """

    def __init__(
        self,
        config: LMCacheConfig,
        metadata: LMCacheMetadata,
        connector: GPUConnectorInterface,
        tier: CPUTier,
        metrics: LMCacheMetrics,
        namespace: str = "",
    ) -> None:
        found = (connector.num_layers, connector.kv_width, connector.dtype)
        expected = (metadata.num_layers, metadata.kv_width, metadata.kv_dtype)
        if found != expected:
            raise ValueError(
                f"PageStore: connector moves (num_layers, kv_width, dtype)={found} but the "
                f"metadata describes {expected}; build both from the same KV pool."
            )
        self.config = config
        self.metadata = metadata
        self.connector = connector
        self.tier = tier
        self.metrics = metrics
        self.page_size = metadata.chunk_size
        self.fingerprint = metadata.fingerprint()
        self._seed = (
            PAGE_KEY_FORMAT
            + self.fingerprint
            + b"\0"
            + config.cache_salt.encode()
            + b"\0"
            + namespace.encode()
            + b"\0"
        )

    # -- keys ---------------------------------------------------------------------------------

    def key(self, page_hash: str) -> bytes:
        """The tier key of SGLang page ``page_hash``."""
        if not isinstance(page_hash, str) or not page_hash:
            raise ValueError(
                f"PageStore: a page key must be SGLang's non-empty page hash string, found "
                f"{page_hash!r}"
            )
        return xxhash.xxh3_128(self._seed + page_hash.encode()).digest()

    def _shape(self) -> tuple[int, int, int]:
        return (self.metadata.num_layers, self.page_size, self.metadata.kv_width)

    # -- queries ------------------------------------------------------------------------------

    def contains(self, page_hash: str) -> bool:
        """Whether the page is stored (no checksum verification; a tier error is ``False``)."""
        try:
            return self.tier.contains(self.key(page_hash))
        except ValueError:
            raise
        except Exception as exc:
            self._tier_error("look up a page", exc)
            return False

    def prefix_pages(self, page_hashes: Sequence[str]) -> int:
        """Number of leading pages of ``page_hashes`` that are stored."""
        found = 0
        for page_hash in page_hashes:
            if not self.contains(page_hash):
                break
            found += 1
        self.metrics.lookup_requests.inc()
        self.metrics.lookup_tokens.inc(len(page_hashes) * self.page_size)
        self.metrics.hit_tokens.inc(found * self.page_size)
        return found

    def hold(self, page_hashes: Sequence[str]) -> HeldPages:
        """Verified leases on the longest stored prefix of ``page_hashes``.

        Each page's checksum is verified now; the first missing or corrupt page ends the run.
        The pages cannot be evicted until :meth:`HeldPages.release`.
        """
        leases: list[MemoryLease] = []
        shape = self._shape()
        for page_hash in page_hashes:
            key = self.key(page_hash)
            try:
                lease = self.tier.get(key, metrics=self.metrics)
            except Exception as exc:
                self._tier_error("get a page", exc)
                lease = None
            if lease is None:
                break
            if tuple(lease.tensor.shape) != shape or lease.tensor.dtype != self.metadata.kv_dtype:
                logger.warning(
                    "Page %s has shape %s %s, expected %s %s; treating it as a miss.",
                    page_hash,
                    tuple(lease.tensor.shape),
                    lease.tensor.dtype,
                    shape,
                    self.metadata.kv_dtype,
                )
                lease.release()
                break
            leases.append(lease)
        try:
            self.tier.touch_many([self.key(h) for h in page_hashes[: len(leases)]])
        except Exception as exc:
            self._tier_error("mark pages used", exc)
        return HeldPages(leases)

    # -- transfers ----------------------------------------------------------------------------

    def slot_spec(self, slots: torch.Tensor, num_pages: int) -> TransferSpec:
        """The transfer spec of ``num_pages`` pages whose token slots are ``slots``.

        Raises:
            ValueError: ``slots`` is not ``[num_pages * page_size]``.
        """
        expected = num_pages * self.page_size
        if slots.dim() != 1 or slots.numel() != expected:
            raise ValueError(
                f"PageStore: expected {expected} slots ({num_pages} pages x {self.page_size} "
                f"tokens), found a tensor of shape {list(slots.shape)}"
            )
        return TransferSpec(slots.to(torch.int64))

    def load(self, held: HeldPages, slots: torch.Tensor, layers: range | None = None) -> None:
        """Copy held pages (all layers, or ``layers``) into the pool's ``slots``.

        Raises:
            ValueError: ``slots`` does not cover the held pages. Connector errors are raised.
        """
        if not held.leases:
            return
        started = time.perf_counter()
        spec = self.slot_spec(slots, len(held))
        chunks = held.chunks(self.page_size)
        if layers is None or len(layers) == self.connector.num_layers:
            self.connector.to_gpu(chunks, spec)
        else:
            for layer in layers:
                self.connector.to_gpu_layer(layer, chunks, spec)  # type: ignore[attr-defined]
        self.connector.synchronize()
        if layers is None or layers.stop == self.connector.num_layers:
            self.metrics.loaded_chunks.inc(len(held))
            self.metrics.loaded_bytes.inc(sum(lease.nbytes for lease in held.leases))
            self.metrics.retrieve_seconds.observe(time.perf_counter() - started)

    def store(self, page_hashes: Sequence[str], slots: torch.Tensor) -> int:
        """Save the pages ``page_hashes`` whose token slots are ``slots`` (stored ones skipped).

        Returns:
            How many leading pages are stored now (all of them unless host memory ran out or
            the tier failed).

        Raises:
            ValueError: bad hashes or slots. Connector errors are raised.
        """
        started = time.perf_counter()
        spec = self.slot_spec(slots, len(page_hashes))
        keys = [self.key(h) for h in page_hashes]
        if not self.config.local_cpu:
            return 0
        todo: list[tuple[bytes, ChunkTransfer, MemoryLease]] = []
        stored = len(keys)
        try:
            for i, key in enumerate(keys):
                try:
                    if self.tier.contains(key):
                        continue
                    lease = self.tier.allocate(
                        self._shape(), self.metadata.kv_dtype, metrics=self.metrics
                    )
                except Exception as exc:
                    self._tier_error("allocate a page", exc)
                    lease = None
                if lease is None:
                    self.metrics.failed_allocations.inc()
                    stored = i
                    break
                chunk = ChunkTransfer(i * self.page_size, (i + 1) * self.page_size, lease.tensor)
                todo.append((key, chunk, lease))
            if todo:
                self.connector.from_gpu([c for _, c, _ in todo], spec)
                checksums: list[int | None] = [None] * len(todo)
                if self.config.checksum:
                    checksums = list(self.tier.checksums([lease.tensor for _, _, lease in todo]))
                for (key, _, lease), checksum in zip(todo, checksums, strict=True):
                    self.tier.put(key, lease, checksum, owner=self.fingerprint)
                    self.metrics.stored_chunks.inc()
                    self.metrics.stored_bytes.inc(lease.nbytes)
            self.tier.touch_many(keys[:stored])
        finally:
            for _, _, lease in todo:
                if not lease.released:
                    lease.release()
        self.metrics.store_seconds.observe(time.perf_counter() - started)
        return stored

    def put_page(self, page_hash: str, page: torch.Tensor) -> bool:
        """Store one page given as a canonical ``[num_layers, page_size, kv_width]`` tensor."""
        if tuple(page.shape) != self._shape() or page.dtype != self.metadata.kv_dtype:
            raise ValueError(
                f"PageStore.put_page: expected a {list(self._shape())} {self.metadata.kv_dtype} "
                f"page, found {list(page.shape)} {page.dtype}"
            )
        key = self.key(page_hash)
        if not self.config.local_cpu:
            return False
        if self.tier.contains(key):
            self.tier.touch(key)
            return True
        lease = self.tier.allocate(self._shape(), self.metadata.kv_dtype, metrics=self.metrics)
        if lease is None:
            self.metrics.failed_allocations.inc()
            return False
        try:
            lease.tensor.copy_(page)
            checksum = self.tier.checksums([lease.tensor])[0] if self.config.checksum else None
            self.tier.put(key, lease, checksum, owner=self.fingerprint)
            self.metrics.stored_chunks.inc()
            self.metrics.stored_bytes.inc(lease.nbytes)
        finally:
            lease.release()
        return True

    def _tier_error(self, action: str, exc: Exception) -> None:
        self.metrics.tier_errors.inc()
        logger.warning("CPU tier failed to %s (%r); treating it as a miss.", action, exc)
