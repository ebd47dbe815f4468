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
  chunks (a :class:`~lmcache.held_hit.HeldHit`): they cannot be evicted until it is released,
  and a retrieve given ``held=`` loads them without hashing them again.
- Every store, lookup or retrieve marks its run of chunks used in chain order (earlier chunks
  more recent), and a store records each chunk's parent (the previous chunk's key), so eviction
  takes orphans (chunks whose parent is gone) first, then a prompt's tail before its head
  (:mod:`lmcache.tiers.cpu_tier`).
- Each store or retrieve is one batched connector call (``from_gpu`` / ``to_gpu``) for all of its
  chunks; the layerwise variants make one call per layer.
- A tier that fails is a miss (counted in ``tier_errors``). A connector that fails raises: the
  engine's KV memory is in an unknown state, and the caller must not trust it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from lmcache.config import ConfigError
from lmcache.gpu_connector.checksums import LoadChecks
from lmcache.gpu_connector.interface import (
    ChunkTransfer,
    GPUConnectorInterface,
    TransferSpec,
    supports_layerwise,
)
from lmcache.gpu_ops._ref import chunk_checksum
from lmcache.held_hit import HeldHit
from lmcache.layerwise import (
    LayerwiseRetrieve,
    LayerwiseStore,
    Pending,
    PlannedStore,
    StagedStore,
    StoreBatch,
    release_all,
)
from lmcache.memory import HostMemoryPool, LeaseError, MemoryLease, aligned_bytes
from lmcache.metrics import LMCacheMetrics
from lmcache.request_plan import ExtraKeys, RequestPlan, Tokens, plan_request
from lmcache.tiers import CPUTier, LowerTier, cascade, process_lower_tiers

if TYPE_CHECKING:
    from lmcache.config import LMCacheConfig
    from lmcache.metadata import LMCacheMetadata

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

logger = logging.getLogger(__name__)


class LMCacheEngine:
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
        self._tiers = cascade.TierStack(
            tier,
            tuple(self.lower_tiers),
            self._fingerprint,
            self.metrics,
            local_cpu=config.local_cpu,
            checksum=config.checksum_for(
                gpu_connector.engine.device if gpu_connector is not None else "cpu"
            ),
        )
        self._closed = False
        self._close_lock = threading.Lock()
        layers, tokens, width = self._chunk_shape(self.chunk_size)
        chunk_bytes = layers * tokens * width * metadata.kv_dtype.itemsize
        self._check_cpu_budget(chunk_bytes)
        for lower in self.lower_tiers:
            lower.check_quota(chunk_bytes)
        self.gpu_connector: GPUConnectorInterface | None = None
        if gpu_connector is not None:
            self.set_gpu_connector(gpu_connector)
        if not config.local_cpu and not self.lower_tiers:
            logger.info("LMCacheEngine: local_cpu=False and no other tier: nothing is stored.")

    # ------------------------------------------------------------------ setup

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
            self._tiers = dataclasses.replace(self._tiers, checksum=checksum)

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

    def _chunk_shape(self, num_tokens: int) -> tuple[int, int, int]:
        return (self.metadata.num_layers, num_tokens, self.metadata.kv_width)

    def _tier_error(self, action: str, exc: Exception) -> None:
        self.metrics.tier_errors.inc()
        logger.warning("CPU tier failed to %s (%r); treating it as a miss.", action, exc)

    def _present(self, key: bytes) -> bool:
        """Whether the CPU tier holds ``key`` (errors count as absent)."""
        return cascade.cpu_contains(self._tiers, key)

    def _hit_run(
        self, plan: RequestPlan, first: int, held: HeldHit | None = None
    ) -> list[tuple[bytes, MemoryLease]]:
        """Leases on the longest run of stored chunks from chunk ``first`` on, in any tier
        (:func:`lmcache.tiers.cascade.hit_run`); chunks in ``held`` get a share of its lease.
        The caller releases the leases."""
        keys = plan.keys[first:] if first else plan.keys  # a lazy chain stays lazy
        ranges = plan.ranges[first:]
        shapes = [self._chunk_shape(self.chunk_size)] * len(ranges)
        if ranges and ranges[-1][1] - ranges[-1][0] != self.chunk_size:
            shapes[-1] = self._chunk_shape(ranges[-1][1] - ranges[-1][0])

        def cpu_lease(i: int) -> MemoryLease | None:
            start, end = ranges[i]
            lease = held.share(keys[i]) if held is not None else None
            if lease is not None:
                return self._check_shape(keys[i], lease, end - start)
            return self._get(keys[i], start, end)

        leases = cascade.hit_run(
            self._tiers,
            keys,
            shapes,
            self.metadata.kv_dtype,
            cpu_lease=cpu_lease,
            parent=plan.keys[first - 1] if first else None,
        )
        return list(zip(keys, leases, strict=False))

    def _touch(self, chain: Sequence[bytes]) -> None:
        """Mark a run of one key chain used, earlier chunks more recent (kept longer)."""
        if not chain:
            return
        try:
            self.tier.touch_many(chain)
        except Exception as exc:
            self._tier_error("mark chunks used", exc)

    def _get(self, key: bytes, start: int, end: int) -> MemoryLease | None:
        """A verified lease on chunk ``key`` of tokens ``[start, end)``, or ``None`` on a miss."""
        try:
            lease = self.tier.get(key, metrics=self.metrics)
        except Exception as exc:
            self._tier_error("get a chunk", exc)
            return None
        return None if lease is None else self._check_shape(key, lease, end - start)

    def _check_shape(self, key: bytes, lease: MemoryLease, num_tokens: int) -> MemoryLease | None:
        if lease.tensor.shape == self._chunk_shape(num_tokens):
            return lease
        logger.warning(
            "Chunk %s has shape %s, expected %s; treating it as a miss.",
            key.hex(),
            tuple(lease.tensor.shape),
            self._chunk_shape(num_tokens),
        )
        lease.release()
        return None

    def _allocate_store(self, plan: RequestPlan) -> list[Pending]:
        """Lease buffers for the chunks a store saves (leading ones only when memory is short).

        The prefix they extend (the request's chunks before the last one stored) is never
        evicted for them (``protect``): chunks stored at the cost of their own prefix could
        never be hit. Each records its parent (the previous chunk's key).
        """
        pending: list[Pending] = []
        candidates = [
            i
            for i in range(plan.first_chunk, len(plan.keys))
            if plan.ranges[i][1] - plan.ranges[i][0] == self.chunk_size
            or self.config.save_unfull_chunk  # else: a trailing partial chunk, not saved
        ]
        todo = [
            candidates[n]
            for n in cascade.keys_to_store(self._tiers, [plan.keys[i] for i in candidates])
        ]
        self._touch(plan.keys)  # this chain's present chunks are the last to be evicted
        protect = frozenset(plan.keys[: todo[-1]]) if todo else frozenset()  # the prefix
        n = 0
        while n < len(todo):  # runs of chunks of one size, each leased in one pass
            tokens = plan.ranges[todo[n]][1] - plan.ranges[todo[n]][0]
            run = 1
            while n + run < len(todo) and (
                plan.ranges[todo[n + run]][1] - plan.ranges[todo[n + run]][0] == tokens
            ):
                run += 1
            try:
                leases = self.tier.allocate_many(
                    self._chunk_shape(tokens),
                    self.metadata.kv_dtype,
                    run,
                    metrics=self.metrics,
                    protect=protect,
                )
            except Exception as exc:
                self._tier_error("allocate", exc)
                leases = []
            for i, lease in zip(todo[n : n + run], leases, strict=False):
                start, end = plan.ranges[i]
                parent = plan.keys[i - 1] if i else None
                pending.append(
                    Pending(plan.keys[i], ChunkTransfer(start, end, lease.tensor), lease, parent)
                )
            if len(leases) < run:
                self.metrics.failed_allocations.inc()
                logger.debug(
                    "Out of host memory: storing %d of %d chunks.", len(pending), len(todo)
                )
                break
            n += run
        return pending

    def _commit_store(
        self,
        pending: Sequence[Pending],
        started: float,
        chain: Sequence[bytes] = (),
        sums: Sequence[int] | None = None,
    ) -> int:
        """Checksum the filled buffers and hand them to the tier; returns tokens stored.

        ``sums`` are the chunks' ``lmcache-mix64-sum`` values computed by the connector on the
        device. They stay with the bytes (``MemoryLease.checksum``), and the host does not
        hash those chunks again. ``chain`` (the request's keys) is then marked used in chain
        order.
        """
        if sums is not None and self._tiers.checksum:
            for p, value in zip(pending, sums, strict=True):
                p.lease.checksum = value
        committed = cascade.publish(
            self._tiers, [(p.key, p.lease) for p in pending], [p.parent for p in pending]
        )
        stored_tokens = sum(p.chunk.num_tokens for p in pending[:committed])
        self._touch(chain)
        self.metrics.store_seconds.observe(time.perf_counter() - started)
        return stored_tokens

    def _acquire_hits(self, plan: RequestPlan, held: HeldHit | None = None) -> list[Pending]:
        """Leases on the longest run of present chunks after the masked prefix.

        Chunks in ``held`` get a share of its lease (verified at ``lookup_and_lease``, not
        hashed again); the others come from the tier, verified.
        """
        run = self._hit_run(plan, plan.first_chunk, held)
        pending = [
            Pending(
                key,
                ChunkTransfer(
                    *plan.ranges[plan.first_chunk + n], lease.tensor, checksum=lease.checksum
                ),
                lease,
            )
            for n, (key, lease) in enumerate(run)
        ]
        self._touch(plan.keys[: plan.first_chunk + len(pending)])
        return pending

    def _check_held(self, held: HeldHit | None, action: str) -> None:
        if held is not None and held.released:
            raise LeaseError(
                f"LMCacheEngine.{action}: held={held!r} was released before the {action}; its "
                "chunks may be gone. Release it after the retrieve, or pass held=None."
            )

    def _load_failures(
        self, pending: Sequence[Pending], checks: Sequence[LoadChecks | None], skip_tokens: int
    ) -> list[int]:
        """Positions of the loaded chunks whose bytes did not match their checksum.

        Call it after the connector's copies completed and before the leases go. A chunk the
        connector verified before its scatter counts as it said. Partial sums of layer calls
        are added up and compared. A chunk with a checksum that the connector did not check
        is hashed here, on the host. Each bad chunk is counted in ``checksum_failures`` and
        dropped from the CPU tier.
        """
        expected = [p.chunk.checksum for p in pending]
        if all(e is None for e in expected):
            return []
        checked: set[int] = set()
        failed: set[int] = set()
        partial: dict[int, list[int]] = {}  # position -> [sum so far, layers covered]
        for check in checks:
            if check is None:
                continue
            if check.verified:
                for pos, ok in zip(check.chunks, check.ok(), strict=True):
                    checked.add(pos)
                    if not ok:
                        failed.add(pos)
                continue
            for pos, value in zip(check.chunks, check.sums(), strict=True):
                acc = partial.setdefault(pos, [0, 0])
                acc[0] += value
                acc[1] += len(check.layers)
        for pos, (total, layers) in partial.items():
            if pos not in checked and layers == self.metadata.num_layers:
                checked.add(pos)
                if total % (1 << 64) != expected[pos]:
                    failed.add(pos)
        for pos, p in enumerate(pending):
            want = expected[pos]
            if want is None or pos in checked or p.chunk.end <= skip_tokens:
                continue
            if chunk_checksum(p.lease.tensor) != want:  # a connector that does not verify
                failed.add(pos)
        for pos in sorted(failed):
            self.metrics.checksum_failures.inc()
            logger.warning(
                "Checksum mismatch for chunk %s loaded from the CPU tier: its bytes changed "
                "after they were stored. Its tokens are reported as not loaded (the engine "
                "recomputes them) and the chunk is dropped.",
                pending[pos].key.hex(),
            )
            try:
                self.tier.remove(pending[pos].key)
            except Exception as exc:
                self._tier_error("drop a bad chunk", exc)
        return sorted(failed)

    def _hit_mask(self, plan: RequestPlan, pending: Sequence[Pending]) -> torch.Tensor:
        mask = torch.zeros(plan.num_tokens, dtype=torch.bool)
        if pending:
            mask[pending[0].chunk.start : pending[-1].chunk.end] = True
        return mask

    def _count_loaded(self, pending: Sequence[Pending], started: float) -> None:
        self.metrics.loaded_chunks.inc(len(pending))
        self.metrics.loaded_bytes.inc(sum(p.lease.nbytes for p in pending))
        self.metrics.retrieve_seconds.observe(time.perf_counter() - started)

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
        self._touch(plan.keys[:found])
        return self._count_lookup(plan, found)

    def lookup_and_lease(
        self, tokens: Tokens, *, salt: str = "", extra_keys: ExtraKeys | None = None
    ) -> HeldHit:
        """Like :meth:`lookup`, but verifies and leases the hit chunks until the hit is released.

        Each chunk of the longest stored prefix is taken from the tier with its checksum
        verified; the first missing or mismatching chunk ends the hit. While the returned
        :class:`~lmcache.held_hit.HeldHit` is held its chunks are not evicted, and
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
        chunks = self._hit_run(plan, 0)
        self._touch(plan.keys[: len(chunks)])
        return HeldHit(chunks, self._count_lookup(plan, len(chunks)))

    def cut_held_hit(self, hit: HeldHit, ok: Sequence[bool]) -> None:
        """Shorten ``hit`` to the chunks before the first one whose bytes failed their checksum
        (``ok[i]`` is ``False``); each failed chunk is counted and dropped from the CPU tier.

        For a caller that verified the held chunks itself, e.g. on the device right after the
        lookup, so that a bad chunk is a miss before anything was promised to the engine.
        """
        bad = [i for i, good in enumerate(ok) if not good]
        if not bad:
            return
        for i in bad:
            self.metrics.checksum_failures.inc()
            logger.warning(
                "Checksum mismatch for chunk %s in the CPU tier: its bytes changed after they "
                "were stored. Treating it as a miss and dropping it.",
                hit.keys[i].hex(),
            )
            try:
                self.tier.remove(hit.keys[i])
            except Exception as exc:
                self._tier_error("drop a bad chunk", exc)
        hit.truncate(bad[0], bad[0] * self.chunk_size)

    def _count_lookup(self, plan: RequestPlan, found: int) -> int:
        hit = plan.ranges[found - 1][1] if found else 0
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
        pending = self._allocate_store(plan)
        try:
            return PlannedStore(
                self, connector, pending, plan.keys, transfer, started, prepare=prepare
            )
        except BaseException:
            release_all(pending)
            raise

    def batch_stores(
        self, stores: Sequence[PlannedStore], transfer: TransferSpec | None = None
    ) -> StoreBatch:
        """Several stores planned with ``plan_store(..., prepare=False)``, to copy in one
        connector call (:class:`~lmcache.layerwise.StoreBatch`): one gather and one set of
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
        self._check_held(held, "retrieve")
        started = time.perf_counter()
        plan = self._plan(tokens, mask, transfer, salt, extra_keys, known_keys=known_keys)
        pending = self._acquire_hits(plan, held)
        if not pending:
            return self._hit_mask(plan, pending)
        try:
            try:
                checks = connector.to_gpu([p.chunk for p in pending], transfer)
            finally:
                connector.synchronize()
            failed = self._load_failures(pending, [checks], transfer.skip_tokens)
        finally:
            release_all(pending)
        self._count_loaded(pending, started)
        mask = self._hit_mask(plan, pending)
        for pos in failed:
            mask[pending[pos].chunk.start : pending[pos].chunk.end] = False
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
        pending = self._allocate_store(plan)
        return LayerwiseStore(self, connector, pending, transfer, started, chain=plan.keys)

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
        self._check_held(held, "retrieve_layerwise")
        started = time.perf_counter()
        plan = self._plan(tokens, mask, transfer, salt, extra_keys, known_keys=known_keys)
        pending = self._acquire_hits(plan, held)
        return LayerwiseRetrieve(
            self, connector, pending, transfer, self._hit_mask(plan, pending), started
        )

    def clear(self) -> None:
        """Drop the chunks this engine's model stored (owner: its metadata fingerprint).

        On a shared tier (:func:`lmcache.tiers.process_cpu_tier`) the chunks of engines with
        other fingerprints (other models, geometry or ranks) stay. Engines with the same
        fingerprint share their chunks (same keys), so those go too. Leases held on the bytes
        (a :class:`~lmcache.held_hit.HeldHit`, a retrieve in flight) stay valid.

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
