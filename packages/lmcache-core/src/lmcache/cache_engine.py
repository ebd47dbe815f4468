# SPDX-License-Identifier: Apache-2.0
"""The cache engine: chunked ``lookup`` / ``store`` / ``retrieve`` of a request's KV.

A request's tokens are cut into chunks of ``chunk_size`` tokens (the last may be partial), each
keyed by :func:`lmcache.keys.chunk_keys` (a hash chained over every earlier chunk, seeded with the
model fingerprint and the cache salt; ``extra_keys`` mixes per-chunk material such as multimodal
item hashes into the chain). Chunks live in the :class:`~lmcache.tiers.CPUTier` as host buffers
``[num_layers, chunk_tokens, kv_width]``, recorded with this engine's fingerprint as their owner,
and, when configured, in the tiers below it (``local_disk``, ``remote_url``:
:class:`~lmcache.tiers.LowerTier`).

Tiers cascade CPU -> disk -> remote:

- A lookup returns the longest prefix of chunks present in any tier. ``lookup_and_lease`` and
  ``retrieve`` read the chunks found only below the CPU tier into host buffers (one batched read
  per tier and run of chunks), verify them (header, key, model fingerprint, geometry, checksum),
  promote them into the CPU tier and lease them: a hit is promised only once its bytes are in
  host memory. A chunk that fails to read or verify ends the hit there.
- A store writes the CPU tier, then queues the chunks for every lower tier (write-through,
  asynchronous; a full queue drops the write and counts ``dropped_writes``).
- With ``local_cpu`` false the host pool only stages these transfers: nothing is kept in it.

Semantics (LMCache's):

- ``mask`` (bool ``[num_tokens]``) has ``False`` for a chunk-aligned prefix of tokens the caller
  skips (already stored, or already in the engine). Those chunks are hashed (the key chain needs
  them) but neither stored nor loaded.
- :meth:`LMCacheEngine.store` saves the chunks after the masked prefix that are not stored yet;
  the trailing partial chunk only with ``config.save_unfull_chunk``. When memory runs short it
  stores the leading chunks that fit and counts ``failed_allocations``; it never blocks. It
  never evicts the prefix it extends to make room (that would leave chunks no lookup can reach:
  a prompt larger than the tier, repeated, then hit a different length on every run).
- :meth:`LMCacheEngine.retrieve` loads the longest run of present chunks right after the masked
  prefix (a missing chunk ends it) and returns a mask that is ``True`` exactly for the tokens of
  the loaded chunks.
- :meth:`LMCacheEngine.lookup_and_lease` is a lookup that also verifies and leases the hit
  chunks (a :class:`HeldHit`): they cannot be evicted until it is released,
  and a retrieve given ``held=`` loads them without hashing them again.
- Every store, lookup or retrieve marks its run of chunks used in chain order (earlier chunks
  more recent), and a store records each chunk's parent (the previous chunk's key), so eviction
  takes orphans (chunks whose parent is gone) first, then a prompt's tail before its head
  (:mod:`lmcache.tiers.cpu_tier`).
- Each store or retrieve is one batched connector call (``from_gpu`` / ``to_gpu``) for all of its
  chunks; the layerwise variants make one call per layer.
- A tier that fails is a miss (counted in ``tier_errors``). A connector that fails raises: the
  engine's KV memory is in an unknown state, and the caller must not trust it.

Where the parts live:

- This module holds the request API.
- :mod:`lmcache.engine.setup` builds the engine, attaches its connector and closes it.
- :mod:`lmcache.engine.hits` finds and leases hit chunks.
- :mod:`lmcache.engine.stores` leases and publishes the chunks of a store.
- :mod:`lmcache.engine.load_checks` checks loaded chunks against their checksums.
- :mod:`lmcache.engine.request_plan` validates a request and cuts it into chunks.
- :mod:`lmcache.engine.held_hit` holds a leased lookup hit.
- :mod:`lmcache.engine.store_plan` and :mod:`lmcache.engine.layerwise` hold the objects a store or
  retrieve returns. They reach the engine only through the protocols of :mod:`lmcache.engine.chunk_moves`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from lmcache.engine.chunk_moves import release_all, unmark
from lmcache.engine.held_hit import HeldHit
from lmcache.engine.hits import check_held, hit_mask
from lmcache.engine.layerwise import LayerwiseRetrieve, LayerwiseStore
from lmcache.engine.request_plan import ExtraKeys, Tokens
from lmcache.engine.setup import EngineSetup
from lmcache.engine.store_plan import PlannedStore, StagedStore, StoreBatch
from lmcache.gpu_connector.interface import TransferSpec
from lmcache.tiers import cascade

__all__ = [
    "ExtraKeys",
    "HeldHit",
    "LMCacheEngine",
    "LayerwiseRetrieve",
    "LayerwiseStore",
    "PlannedStore",
    "StagedStore",
    "StoreBatch",
    "Tokens",
]


class LMCacheEngine(EngineSetup):
    """Stores and retrieves a serving engine's KV cache in chunks.

    Args:
        config: lmcache configuration (``chunk_size``, ``max_local_cpu_size``, ``checksum``,
            ``save_unfull_chunk``, ``cache_salt``, ...).
        metadata: Model geometry; its fingerprint seeds every key.
        gpu_connector: Moves KV between the engine and host buffers. Needed by store and
            retrieve (not by lookup); may be set later with :meth:`set_gpu_connector`.
        metrics: Where to count; a fresh :class:`~lmcache.metrics.LMCacheMetrics` when ``None``.
            The tier's evictions and checksum failures caused by this engine's calls count here
            too, also on a shared tier.
        tier: The CPU tier to use, e.g. :func:`lmcache.tiers.process_cpu_tier` to share one
            across the engines of a process. ``None`` builds a private pool and tier sized by
            ``config.max_local_cpu_size``. A shared tier is not emptied by :meth:`close`, and
            :meth:`clear` drops only this engine's chunks from it.
        lower_tiers: The disk / remote tiers below the CPU one, in lookup order. ``None`` takes
            the process-wide ones ``config`` names (``local_disk``, ``remote_url``:
            :func:`lmcache.tiers.process_lower_tiers`); ``()`` uses none.

    Raises:
        ValueError: ``config.chunk_size`` differs from ``metadata.chunk_size``, or the connector's
            geometry differs from ``metadata``.
        lmcache.config.ConfigError: the host budget (``max_local_cpu_size``) is below one chunk,
            or a lower tier cannot be used (unwritable folder, malformed
            URL, a disk budget below one chunk).
    """

    # ------------------------------------------------------------------ public API

    def lookup(self, tokens: Tokens, *, salt: str = "", extra_keys: ExtraKeys | None = None) -> int:
        """Number of leading tokens whose chunks are stored (a stored partial last chunk counts).

        Found chunks are marked recently used (earlier ones more recent), so a retrieve soon
        after is likely to find them; nothing is leased, see :meth:`lookup_and_lease`.

        Args:
            tokens: The request's token ids ``[num_tokens]``.
            salt: Per-request cache salt (tenant isolation), combined with ``config.cache_salt``.
            extra_keys: Extra key material per chunk index (e.g. multimodal item hashes); see
                :func:`lmcache.keys.chunk_keys`.

        Raises:
            ValueError, TypeError: malformed tokens or ``extra_keys`` (token ids are read, and
                checked, only as far as the stored prefix goes: up to the first missing chunk).
        """
        if self._closed:
            raise RuntimeError("LMCacheEngine.lookup: the engine is closed.")
        plan = self._plan(tokens, None, None, salt, extra_keys, lazy=True)
        found = cascade.stored_prefix(self._tiers, plan.keys)
        self._engine_tiers.touch(plan.keys[:found])
        return self._hits.count_lookup(plan, found)

    def lookup_and_lease(
        self, tokens: Tokens, *, salt: str = "", extra_keys: ExtraKeys | None = None
    ) -> HeldHit:
        """Like :meth:`lookup`, but verifies and leases the hit chunks until the hit is released.

        Each chunk of the longest stored prefix is taken from the tier with its checksum
        verified; the first missing or mismatching chunk ends the hit. While the returned
        :class:`HeldHit` is held its chunks are not evicted, and
        :meth:`retrieve` / :meth:`retrieve_layerwise` given ``held=`` load them without
        verifying them again. Counts the same metrics as :meth:`lookup`.

        Args:
            tokens: The request's token ids ``[num_tokens]``.
            salt: Per-request cache salt, combined with ``config.cache_salt``.
            extra_keys: Extra key material per chunk index; see :func:`lmcache.keys.chunk_keys`.

        Returns:
            The held hit; ``num_tokens`` is what :meth:`lookup` would return (unless a chunk
            failed its checksum). Release it (or use it as a context manager) when done.

        Raises:
            ValueError, TypeError: malformed tokens or ``extra_keys`` (token ids are read, and
                checked, only as far as the stored prefix goes: up to the first missing chunk).
        """
        if self._closed:
            raise RuntimeError("LMCacheEngine.lookup_and_lease: the engine is closed.")
        plan = self._plan(tokens, None, None, salt, extra_keys, lazy=True)
        chunks = self._hits.hit_run(plan, 0)
        self._engine_tiers.touch(plan.keys[: len(chunks)])
        return HeldHit(chunks, self._hits.count_lookup(plan, len(chunks)))

    def cut_held_hit(self, hit: HeldHit, ok: Sequence[bool]) -> None:
        """Shorten ``hit`` to the chunks before the first one whose bytes failed their checksum
        (``ok[i]`` is ``False``); each failed chunk is counted and dropped from the CPU tier.

        For a caller that verified the held chunks itself, e.g. on the device right after the
        lookup, so that a bad chunk is a miss before anything was promised to the engine.
        """
        self._hits.cut_held_hit(hit, ok)

    def store(
        self,
        tokens: Tokens,
        mask: torch.Tensor | None,
        transfer: TransferSpec,
        *,
        salt: str = "",
        extra_keys: ExtraKeys | None = None,
    ) -> int:
        """Save the KV of ``tokens`` from the engine (one ``from_gpu`` call for all chunks).

        Args:
            tokens: The request's token ids ``[num_tokens]``.
            mask: bool ``[num_tokens]``; ``False`` marks a chunk-aligned prefix not to store.
                ``None`` stores from the first token.
            transfer: Where the tokens' KV is in the engine (``slot_mapping`` ``[num_tokens]``).
            salt: Per-request cache salt (tenant isolation), combined with ``config.cache_salt``.
            extra_keys: Extra key material per chunk index (e.g. multimodal item hashes); see
                :func:`lmcache.keys.chunk_keys`.

        Returns:
            Number of tokens newly stored.

        Raises:
            ValueError: a malformed mask, slot mapping or ``extra_keys``.
            RuntimeError: no connector. Errors of the connector are raised as they are.
        """
        return self.copy_out(tokens, mask, transfer, salt=salt, extra_keys=extra_keys).commit()

    def copy_out(
        self,
        tokens: Tokens,
        mask: torch.Tensor | None,
        transfer: TransferSpec,
        *,
        salt: str = "",
        extra_keys: ExtraKeys | None = None,
    ) -> StagedStore:
        """The first half of :meth:`store`: lease buffers and copy the KV out of the engine.

        When this returns, the engine's pages are no longer read and may be reused;
        ``.commit()`` on the result checksums and publishes the chunks (``store`` is
        ``copy_out(...).commit()``). Arguments and errors as for :meth:`store`.
        """
        planned = self.plan_store(tokens, mask, transfer, salt=salt, extra_keys=extra_keys)
        return planned.copy_out(transfer)

    def plan_store(
        self,
        tokens: Tokens,
        mask: torch.Tensor | None,
        transfer: TransferSpec,
        *,
        salt: str = "",
        extra_keys: ExtraKeys | None = None,
        prepare: bool = True,
    ) -> PlannedStore:
        """The host-side part of :meth:`copy_out`, before anything is read from the engine:
        choose the chunks to store, lease their buffers and let the connector plan the copy
        (:meth:`~lmcache.gpu_connector.GPUConnectorInterface.prepare_store`; not with
        ``prepare=False``, for a store that :meth:`batch_stores` will copy with others).

        Call it while the engine computes the KV (it does not read the engine's memory), then
        ``.copy_out()`` once the KV is written; ``.abort()`` if it will not be. Arguments and
        errors as for :meth:`store`.
        """
        connector = self._connector("store")
        started = time.perf_counter()
        plan = self._plan(tokens, mask, transfer, salt, extra_keys)
        pending = self._stores.allocate(plan)
        try:
            return PlannedStore(
                self._stores, connector, pending, plan.keys, transfer, started, prepare=prepare
            )
        except BaseException:
            release_all(pending)
            raise

    def batch_stores(
        self, stores: Sequence[PlannedStore], transfer: TransferSpec | None = None
    ) -> StoreBatch:
        """Several stores planned with ``plan_store(..., prepare=False)``, to copy in one
        connector call (:class:`~lmcache.engine.store_plan.StoreBatch`): one gather and one set of
        DMAs for all of a step's requests instead of one per request.

        Args:
            stores: The planned stores (the batch owns them from now on).
            transfer: The stream and ``deferred`` flag the copy will use (for the connector's
                planning; the slot mapping is ignored).

        Raises:
            ValueError: a store was prepared, copied or aborted already, or is another
                engine's. Connector errors of the planning are raised (the stores stay
                planned: abort them).
        """
        spec = transfer if transfer is not None else TransferSpec(torch.empty(0, dtype=torch.long))
        return StoreBatch(self._connector("store"), stores, spec)

    def retrieve(
        self,
        tokens: Tokens,
        mask: torch.Tensor | None,
        transfer: TransferSpec,
        *,
        salt: str = "",
        extra_keys: ExtraKeys | None = None,
        held: HeldHit | None = None,
        known_keys: Sequence[bytes] = (),
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
            extra_keys: Extra key material per chunk index (e.g. multimodal item hashes); see
                :func:`lmcache.keys.chunk_keys`.
            held: A hit from :meth:`lookup_and_lease` for these tokens: its chunks are loaded
                from its leases without verifying their checksums again (even if the tier dropped
                or replaced them meanwhile); other chunks come from the tier, verified. Not
                released here: the caller releases it.
            known_keys: The keys of the leading chunks of exactly these tokens, salt and extra
                keys, computed before (e.g. ``held.keys``, once the caller has checked that
                ``held`` was looked up with these tokens, salt and extra keys): they are not
                hashed again, and not checked (other keys load other tokens' KV).

        Returns:
            bool ``[num_tokens]`` on the CPU, ``True`` exactly for the tokens of loaded chunks.

        Raises:
            ValueError: a malformed mask, slot mapping or ``extra_keys``.
            RuntimeError: no connector. Errors of the connector are raised as they are.
            LeaseError: ``held`` was released already.
        """
        connector = self._connector("retrieve")
        check_held(held, "retrieve")
        started = time.perf_counter()
        plan = self._plan(tokens, mask, transfer, salt, extra_keys, known_keys=known_keys)
        pending = self._hits.acquire(plan, held)
        if not pending:
            return hit_mask(plan, pending)
        try:
            try:
                checks = connector.to_gpu([p.chunk for p in pending], transfer)
            finally:
                connector.synchronize()
            failed = self._loads.load_failures(pending, [checks], transfer.skip_tokens)
        finally:
            release_all(pending)
        self._loads.count_loaded(pending, started)
        mask = hit_mask(plan, pending)
        unmark(mask, pending, failed)
        return mask

    def store_layerwise(
        self,
        tokens: Tokens,
        mask: torch.Tensor | None,
        transfer: TransferSpec,
        *,
        salt: str = "",
        extra_keys: ExtraKeys | None = None,
    ) -> LayerwiseStore:
        """Like :meth:`store`, one layer at a time; see :class:`LayerwiseStore`.

        Chunks are chosen and their buffers leased now; nothing is visible to lookups until
        :meth:`LayerwiseStore.finish`.

        Raises:
            TypeError: the connector does not implement ``SupportsLayerwise``.
        """
        connector = self._layerwise_connector("store_layerwise")
        started = time.perf_counter()
        plan = self._plan(tokens, mask, transfer, salt, extra_keys)
        pending = self._stores.allocate(plan)
        return LayerwiseStore(
            self._stores,
            connector,
            pending,
            transfer,
            started,
            num_layers=self.metadata.num_layers,
            chain=plan.keys,
        )

    def retrieve_layerwise(
        self,
        tokens: Tokens,
        mask: torch.Tensor | None,
        transfer: TransferSpec,
        *,
        salt: str = "",
        extra_keys: ExtraKeys | None = None,
        held: HeldHit | None = None,
        known_keys: Sequence[bytes] = (),
    ) -> LayerwiseRetrieve:
        """Like :meth:`retrieve`, one layer at a time; see :class:`LayerwiseRetrieve`.

        The hit chunks are found and leased now (``num_hit_tokens`` is known at once); chunks
        in ``held`` use a share of its leases, unverified, as in :meth:`retrieve`. ``held`` may
        be released once this returns (the retrieve keeps its own shares until it finishes).
        ``known_keys`` as for :meth:`retrieve`.

        Raises:
            TypeError: the connector does not implement ``SupportsLayerwise``.
            LeaseError: ``held`` was released already.
        """
        connector = self._layerwise_connector("retrieve_layerwise")
        check_held(held, "retrieve_layerwise")
        started = time.perf_counter()
        plan = self._plan(tokens, mask, transfer, salt, extra_keys, known_keys=known_keys)
        pending = self._hits.acquire(plan, held)
        return LayerwiseRetrieve(
            self._loads,
            connector,
            pending,
            transfer,
            hit_mask(plan, pending),
            started,
            num_layers=self.metadata.num_layers,
        )
