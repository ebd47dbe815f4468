# SPDX-License-Identifier: Apache-2.0
"""KV pages keyed by SGLang's page hashes, kept in lmcache's tiers (CPU, disk, remote).

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

Pages cascade over the tiers exactly like the cache engine's chunks
(:mod:`lmcache.tiers.cascade`): a lookup is the longest prefix present in the CPU tier, then the
local disk, then Redis (one batched query per lower tier); a load leases the pages, reading those
found only below the CPU tier into CPU-tier buffers, verified (and promoted into the CPU tier when
``local_cpu``) before the hook reports them; a store writes the CPU tier and queues the pages for
every lower tier in page order (write-through, asynchronous); with ``local_cpu: false`` host
memory only stages; :meth:`PageStore.clear` drops the model's pages from every tier. A tier that
fails is a miss.

Checksums in the CPU tier follow the cache engine's (``checksum``, resolved by
:meth:`~lmcache.config.LMCacheConfig.checksum_for` for the connector's device and whether it
:attr:`~lmcache.gpu_connector.interface.GPUConnectorInterface.verifies_checksums`).
With a connector that verifies on the device (SGLang's CUDA pool), a store keeps the sum the
device computed of each page with its bytes (``MemoryLease.checksum``), so the host hashes
nothing. Such a page is not verified when it is held: :meth:`PageStore.load` hands its sum to the
connector, which checks the staged bytes and writes only the pages that match, in one pass.
A page that fails is counted in ``checksum_failures``, dropped from the CPU tier and never
reported as loaded. Other connectors (a CPU pool) hash each page on the host at store (one batch
per store) and verify it when it is held (one batch per hit: :mod:`lmcache_sglang.held_pages`).
Pages read from disk or Redis are verified by their tier when read.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence

import torch
import xxhash

from lmcache.config import LMCacheConfig
from lmcache.engine.load_checks import mismatched_chunks
from lmcache.gpu_connector.interface import ChunkTransfer, GPUConnectorInterface, TransferSpec
from lmcache.gpu_ops import chunk_checksum
from lmcache.memory import MemoryLease
from lmcache.metadata import LMCacheMetadata
from lmcache.metrics import LMCacheMetrics
from lmcache.tiers import CPUTier, LowerTier, cascade, process_lower_tiers
from lmcache_sglang.held_pages import HeldPages, hit_run

__all__ = ["PAGE_KEY_FORMAT", "HeldPages", "PageStore"]

logger = logging.getLogger(__name__)

PAGE_KEY_FORMAT = b"lmcache-sglang-page-v1\0"
"""Domain tag of page keys."""


class PageStore:
    """Stores and loads SGLang pages by page hash on lmcache's tiers (CPU -> disk -> remote).

    Args:
        config: lmcache configuration (``cache_salt``, ``checksum`` (resolved for the
            connector's device and whether it verifies on the device,
            :meth:`~lmcache.config.LMCacheConfig.checksum_for`), ``local_cpu``; with
            ``lower_tiers=None`` also ``local_disk`` / ``remote_url``).
        metadata: Geometry; ``metadata.chunk_size`` must be SGLang's ``page_size``.
        connector: Moves pages between SGLang's pool and page buffers.
        tier: The CPU tier (usually :func:`lmcache.tiers.process_cpu_tier`).
        metrics: Where to count.
        namespace: Extra key material (pipeline stage, pool name).
        lower_tiers: The disk / remote tiers below the CPU one, in lookup order. ``None`` takes
            the process-wide ones ``config`` names (:func:`lmcache.tiers.process_lower_tiers`);
            ``()`` uses none.

    Raises:
        ValueError: the connector's geometry differs from ``metadata``.
        lmcache.config.ConfigError: a lower tier cannot be used (unwritable folder, malformed
            URL, a disk budget below one page).
    """

    def __init__(
        self,
        config: LMCacheConfig,
        metadata: LMCacheMetadata,
        connector: GPUConnectorInterface,
        tier: CPUTier,
        metrics: LMCacheMetrics,
        namespace: str = "",
        *,
        lower_tiers: Sequence[LowerTier] | None = None,
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
        self.lower_tiers: list[LowerTier] = list(
            process_lower_tiers(config) if lower_tiers is None else lower_tiers
        )
        self.tiers = cascade.TierStack(
            tier,
            tuple(self.lower_tiers),
            self.fingerprint,
            metrics,
            local_cpu=config.local_cpu,
            checksum=config.checksum_for(
                connector.engine.device, on_device=connector.verifies_checksums
            ),
        )
        page_bytes = metadata.num_layers * self.page_size * metadata.kv_width
        page_bytes *= metadata.kv_dtype.itemsize
        for lower in self.lower_tiers:
            lower.check_quota(page_bytes)
        if not config.local_cpu and not self.lower_tiers:
            logger.info("PageStore: local_cpu=False and no other tier: nothing is stored.")
        parts = (self.fingerprint, config.cache_salt.encode(), namespace.encode(), b"")
        self._seed = PAGE_KEY_FORMAT + b"\0".join(parts)

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

    def _touch(self, keys: Sequence[bytes]) -> None:
        """Mark a run of pages of one chain used in the CPU tier (earlier pages more recent)."""
        if not keys:
            return
        try:
            self.tier.touch_many(keys)
        except Exception as exc:
            self._tier_error("mark pages used", exc)

    # -- queries ------------------------------------------------------------------------------

    def contains(self, page_hash: str) -> bool:
        """Whether some tier holds the page (no verification; a failing tier is a miss)."""
        return cascade.stored_prefix(self.tiers, [self.key(page_hash)]) == 1

    def prefix_pages(self, page_hashes: Sequence[str]) -> int:
        """Number of leading pages of ``page_hashes`` that some tier holds (CPU, disk, remote;
        one batched query per lower tier; nothing is read or leased)."""
        found = cascade.stored_prefix(self.tiers, [self.key(h) for h in page_hashes])
        self.metrics.lookup_requests.inc()
        self.metrics.lookup_tokens.inc(len(page_hashes) * self.page_size)
        self.metrics.hit_tokens.inc(found * self.page_size)
        return found

    def hold(self, page_hashes: Sequence[str]) -> HeldPages:
        """Leases on the longest stored prefix of ``page_hashes``, in any tier.

        Pages in the CPU tier that carry a device sum are left for the connector to verify when
        :meth:`load` writes them (when it verifies on the device; otherwise they are hashed
        here). Other CPU-tier pages have their checksum verified now, the run's in one batch
        (:func:`lmcache_sglang.held_pages.hit_run`). Pages found only on disk
        or in Redis are read into CPU-tier buffers and verified (header, key, model
        fingerprint, geometry, checksum), and promoted into the CPU tier when ``local_cpu``.
        The first missing or corrupt page ends the run. The pages cannot be evicted until
        :meth:`HeldPages.release`.
        """
        keys = [self.key(h) for h in page_hashes]
        leases = hit_run(self.tiers, keys, self._shape(), self.metadata.kv_dtype)
        if not self.connector.verifies_checksums:  # no device here will check the sums
            bad = next(
                (
                    i
                    for i, lease in enumerate(leases)
                    if lease.checksum is not None and chunk_checksum(lease.tensor) != lease.checksum
                ),
                None,
            )
            if bad is not None:
                self._drop_bad(keys[bad])
                for lease in leases[bad:]:
                    lease.release()
                leases = leases[:bad]
        self._touch(keys[: len(leases)])
        return HeldPages(leases, keys[: len(leases)])

    def checks_at_load(self, held: HeldPages) -> bool:
        """Whether :meth:`load` verifies some of ``held`` on the device (pages that carry a
        device sum, not verified when held): only a load of all layers at once can refuse them
        before they reach the pool."""
        return self.connector.verifies_checksums and any(
            lease.checksum is not None for lease in held.leases
        )

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

    def load(self, held: HeldPages, slots: torch.Tensor) -> int:
        """Copy the held pages (all layers) into the pool's ``slots``, verified.

        Each page that carries a device sum goes to the connector with it, and the connector
        writes it only when its staged bytes match (one pass on the device). A page that fails
        is counted in ``checksum_failures`` and dropped from the CPU tier; its slots keep what
        they held. A connector that does not verify gets no such page (:meth:`hold` hashed
        them), and a sum it left unchecked is compared on the host after the copy.

        Returns:
            How many leading pages are in the pool, verified: ``len(held)`` unless a page
            failed (pages after the first failure may be written but are not counted).

        Raises:
            ValueError: ``slots`` does not cover the held pages. Connector errors are raised.
        """
        if not held.leases:
            return 0
        started = time.perf_counter()
        spec = self.slot_spec(slots, len(held))
        chunks = held.chunks(self.page_size)
        checks = self.connector.to_gpu(chunks, spec)
        self.connector.synchronize()
        failed = mismatched_chunks(
            [c.checksum for c in chunks],
            [c.buffer for c in chunks],
            [checks],
            self.connector.num_layers,
        )
        for pos in failed:
            self._drop_bad(held.keys[pos])
        loaded = failed[0] if failed else len(held)
        self.metrics.loaded_chunks.inc(loaded)
        self.metrics.loaded_bytes.inc(sum(lease.nbytes for lease in held.leases[:loaded]))
        self.metrics.retrieve_seconds.observe(time.perf_counter() - started)
        return loaded

    def store(self, page_hashes: Sequence[str], slots: torch.Tensor) -> int:
        """Save the pages ``page_hashes`` whose token slots are ``slots`` (stored ones skipped).

        The pages go into the CPU tier (when ``local_cpu``) and are queued for every lower tier
        in page order (write-through, asynchronous; see :meth:`flush`). With ``local_cpu``
        false host memory only stages them, and pages every lower tier holds are skipped.

        Returns:
            How many leading pages are stored now (all of them unless host memory ran out or
            the CPU tier failed; queued lower-tier writes count); 0 when no tier keeps pages.

        Raises:
            ValueError: bad hashes or slots. Connector errors are raised.
        """
        started = time.perf_counter()
        spec = self.slot_spec(slots, len(page_hashes))
        keys = [self.key(h) for h in page_hashes]
        if not self.tiers.stores_anything:
            return 0

        def fill(pending: list[tuple[int, MemoryLease]]) -> None:
            chunks = [
                ChunkTransfer(i * self.page_size, (i + 1) * self.page_size, lease.tensor)
                for i, lease in pending
            ]
            sums = self.connector.from_gpu(chunks, spec)
            if sums is not None and self.tiers.checksum:
                # the device's sums stay with the bytes: publish hashes nothing on the host,
                # and the connector verifies each page against its sum when it loads it
                for (_, lease), value in zip(pending, sums.values(), strict=True):
                    lease.checksum = value

        stored = self._write(keys, fill)
        self.metrics.store_seconds.observe(time.perf_counter() - started)
        return stored

    def put_page(self, page_hash: str, page: torch.Tensor) -> bool:
        """Store one page given as a canonical ``[num_layers, page_size, kv_width]`` tensor
        (CPU tier when ``local_cpu``, and written through to every lower tier)."""
        return self.put_pages([page_hash], [page]) == 1

    def put_pages(self, page_hashes: Sequence[str], pages: Sequence[torch.Tensor]) -> int:
        """Store pages (stored ones skipped), each ``[num_layers, page_size, ...]`` of the KV
        dtype with ``kv_width`` elements per token in the canonical order (e.g. a view of
        SGLang's flat page, any strides), one copy each; returns how many leading pages are
        stored now (as :meth:`store`).

        Raises:
            ValueError: a page of another shape or dtype, or not one page per hash.
        """
        L, ps, width = self._shape()
        dtype = self.metadata.kv_dtype
        for page in pages:
            if (
                page.shape[:2] != (L, ps)
                or math.prod(page.shape[2:]) != width
                or page.dtype != dtype
            ):
                raise ValueError(
                    f"PageStore.put_pages: expected [{L}, {ps}, ...] {dtype} pages of {width} "
                    f"elements per token, found {list(page.shape)} {page.dtype}"
                )
        if len(pages) != len(page_hashes):
            raise ValueError(f"PageStore.put_pages: {len(page_hashes)} hashes, {len(pages)} pages")
        keys = [self.key(h) for h in page_hashes]
        if not self.tiers.stores_anything:
            return 0

        def fill(pending: list[tuple[int, MemoryLease]]) -> None:
            for i, lease in pending:
                lease.tensor.view(pages[i].shape).copy_(pages[i])

        return self._write(keys, fill)

    def _write(
        self, keys: list[bytes], fill: Callable[[list[tuple[int, MemoryLease]]], None]
    ) -> int:
        """Buffers for the ``keys`` not stored yet (one allocation), ``fill`` them (``(position,
        lease)`` pairs), publish them and mark the run used; how many leading keys are stored."""
        todo = cascade.keys_to_store(self.tiers, keys)
        leases: list[MemoryLease] = []
        if todo:
            try:
                leases = self.tier.allocate_many(
                    self._shape(), self.metadata.kv_dtype, len(todo), metrics=self.metrics
                )
            except Exception as exc:
                self._tier_error("allocate pages", exc)
            if len(leases) < len(todo):  # a prefix is stored
                self.metrics.failed_allocations.inc()
        stored = todo[len(leases)] if len(leases) < len(todo) else len(keys)
        pending = list(zip(todo, leases, strict=False))
        try:
            if pending:
                fill(pending)
                done = cascade.publish(self.tiers, [(keys[i], lease) for i, lease in pending])
                if done < len(pending):
                    stored = min(stored, pending[done][0])
            self._touch(keys[:stored])
        finally:
            for lease in leases:
                if not lease.released:
                    lease.release()
        return stored

    # -- lifecycle ----------------------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the lower tiers' queued writes are done (each up to ``timeout`` s), so
        what was stored survives this process; ``False`` if one timed out."""
        return cascade.flush(self.tiers, timeout)

    def clear(self) -> None:
        """Drop this model's pages (owner: the metadata fingerprint) from every tier.

        Other models' pages stay. In the disk and remote tiers every entry of the fingerprint
        goes, including chunks and pages other processes of the same model stored in a shared
        folder or Redis namespace: after a weight update none of them is valid.
        """
        cascade.clear(self.tiers)

    def _drop_bad(self, key: bytes) -> None:
        """Count a page whose bytes failed their device sum, and drop it from the CPU tier."""
        self.metrics.checksum_failures.inc()
        logger.warning(
            "Checksum mismatch for page %s in the CPU tier: its bytes changed after they were "
            "stored. Treating it as a miss (never loaded) and dropping it.",
            key.hex(),
        )
        try:
            self.tier.remove(key)
        except Exception as exc:
            self._tier_error("drop a bad page", exc)

    def _tier_error(self, action: str, exc: Exception) -> None:
        self.metrics.tier_errors.inc()
        logger.warning("CPU tier failed to %s (%r); treating it as a miss.", action, exc)
