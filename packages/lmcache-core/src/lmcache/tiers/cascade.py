# SPDX-License-Identifier: Apache-2.0
"""The CPU -> disk -> remote cascade, as functions over one :class:`TierStack`.

Whoever keeps chunks in lmcache's tiers under its own keys (:class:`~lmcache.cache_engine.
LMCacheEngine` with token-chunk keys, ``lmcache_sglang.page_store.PageStore`` with SGLang page
hashes) cascades the same way:

- **Lookup** (:func:`stored_prefix`): the longest prefix of keys present in some tier: the CPU
  tier first, then one batched :meth:`~lmcache.tiers.LowerTier.contains` per lower tier for the
  keys after the CPU tier's run. No bytes are read, nothing is leased.
- **Hit** (:func:`hit_run`): verified leases on the longest present prefix. CPU-tier chunks are
  verified by the tier (:func:`cpu_get`); runs of chunks found only below it are read into host
  buffers from :meth:`~lmcache.tiers.CPUTier.allocate` (one batched
  :meth:`~lmcache.tiers.LowerTier.read_into` per tier and run), verified by the lower tier,
  promoted into the CPU tier with ``put`` when ``local_cpu`` (:func:`fetch_into_cpu`), and leased:
  a hit is reported only once its bytes are in host memory. A chunk that cannot be read or fails
  verification ends the hit there.
- **Store** (:func:`keys_to_store`, :func:`publish`): the CPU tier gets the chunks (when
  ``local_cpu``), then every lower tier gets them in chain order with
  :meth:`~lmcache.tiers.LowerTier.submit_chain` (:func:`write_through`: asynchronous, a full
  queue drops and counts). With ``local_cpu`` false the CPU pool only stages the bytes: nothing
  is kept in it, and chunks every lower tier holds already are not staged again.
- **Eviction order**: callers that know each chunk's parent (the previous chunk's key) pass it
  (``parents=``, ``parent=``), so every tier that chooses its victims (CPU, disk) evicts orphans
  first and a chain's tail before its head, and never evicts the prefix a store or promotion
  extends (``protect``) to make room for it.
- **Clear** (:func:`clear`): the CPU tier's entries of the fingerprint (``owner``) and the lower
  tiers' entries of its digest.

A tier that fails is a miss: lower tiers never raise, and CPU-tier errors are caught here and
counted (``tier_errors``). Chunk buffers are ``[num_layers, num_tokens, kv_width]`` of one dtype;
callers pass each chunk's shape (a trailing partial chunk has fewer tokens).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from lmcache.tiers.chunk_format import fingerprint_digest
from lmcache.tiers.cpu_tier import CPUTier
from lmcache.tiers.lower_tier import LowerTier, ReadRequest
from lmcache.tiers.prefix_query import present_prefix

if TYPE_CHECKING:
    from lmcache.memory import MemoryLease
    from lmcache.metrics import LMCacheMetrics

__all__ = [
    "ChunkShape",
    "TierStack",
    "clear",
    "cpu_contains",
    "cpu_get",
    "fetch_into_cpu",
    "flush",
    "hit_run",
    "keys_to_store",
    "lower_presence",
    "publish",
    "stored_prefix",
    "write_through",
]

logger = logging.getLogger(__name__)

ChunkShape = tuple[int, int, int]
"""``(num_layers, num_tokens, kv_width)`` of one chunk buffer."""


@dataclass(frozen=True)
class TierStack:
    """The tiers one engine or store cascades over, and how it uses them.

    Attributes:
        cpu: The CPU tier (chunks in host memory; with ``local_cpu`` false only a staging pool).
        lower: The tiers below it in lookup order (disk, then remote); may be empty.
        fingerprint: The metadata fingerprint of the chunks' model
            (:meth:`lmcache.metadata.LMCacheMetadata.fingerprint`): the CPU tier's ``owner``.
        metrics: Where every tier operation of this stack is counted.
        local_cpu: Keep chunks in the CPU tier (``config.local_cpu``); false: stage only.
        checksum: Checksum chunks put into the CPU tier (``config.checksum``); lower tiers
            always checksum.
        fp_digest: :func:`~lmcache.tiers.chunk_format.fingerprint_digest` of ``fingerprint``,
            under which lower tiers file the chunks (derived).
    """

    cpu: CPUTier
    lower: tuple[LowerTier, ...]
    fingerprint: bytes
    metrics: LMCacheMetrics
    local_cpu: bool = True
    checksum: bool = True
    fp_digest: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "lower", tuple(self.lower))
        object.__setattr__(self, "fp_digest", fingerprint_digest(self.fingerprint))

    @property
    def stores_anything(self) -> bool:
        """Whether a store keeps anything (``local_cpu``, or some lower tier)."""
        return self.local_cpu or bool(self.lower)


def _cpu_error(stack: TierStack, action: str, exc: Exception) -> None:
    stack.metrics.tier_errors.inc()
    logger.warning("CPU tier failed to %s (%r); treating it as a miss.", action, exc)


# ------------------------------------------------------------------------------ lookup


def cpu_contains(stack: TierStack, key: bytes) -> bool:
    """Whether the CPU tier holds ``key`` (no verification; an error is ``False``, counted)."""
    try:
        return stack.cpu.contains(key)
    except Exception as exc:
        _cpu_error(stack, "look up a chunk", exc)
        return False


def _cpu_missing(stack: TierStack, keys: Sequence[bytes], action: str) -> list[int]:
    """:meth:`CPUTier.missing` (one lock); a tier error makes every key missing, counted."""
    try:
        return stack.cpu.missing(keys)
    except Exception as exc:
        _cpu_error(stack, action, exc)
        return list(range(len(keys)))


def lower_presence(stack: TierStack, keys: Sequence[bytes]) -> list[list[bool]]:
    """For each lower tier (in order), whether it holds each of ``keys``: one batched
    :meth:`~lmcache.tiers.LowerTier.contains` per tier (a failing tier answers all ``False``)."""
    return [t.contains(stack.fp_digest, keys, stack.metrics) for t in stack.lower]


def stored_prefix(stack: TierStack, keys: Sequence[bytes]) -> int:
    """How many leading ``keys`` some tier holds: CPU first, then the lower tiers.

    The CPU tier is asked in runs of keys up to its first miss (:func:`~lmcache.tiers.
    prefix_query.present_prefix`; the node cache in one query); the remaining keys go to each lower tier in one batched query; a key
    counts when any tier holds it. Nothing is verified or leased (see :func:`hit_run`).
    """
    at_once = bool(getattr(stack.cpu, "round_trips", False))  # a query is a round trip
    found = present_prefix(keys, lambda r: _cpu_missing(stack, r, "look up a chunk"), at_once)
    if found == len(keys) or not stack.lower:
        return found
    rest = keys[found:]
    below = lower_presence(stack, rest)
    for i, key in enumerate(rest):
        if not (any(p[i] for p in below) or (i and cpu_contains(stack, key))):
            return found + i
    return len(keys)


# ------------------------------------------------------------------------------ hits


def cpu_get(
    stack: TierStack, key: bytes, shape: Sequence[int], dtype: torch.dtype
) -> MemoryLease | None:
    """A verified lease on ``key`` from the CPU tier, or ``None`` (miss, checksum mismatch,
    another shape or dtype, or a tier error; all counted or logged). The caller releases it."""
    try:
        lease = stack.cpu.get(key, metrics=stack.metrics)
    except Exception as exc:
        _cpu_error(stack, "get a chunk", exc)
        return None
    if lease is None:
        return None
    if tuple(lease.tensor.shape) == tuple(shape) and lease.tensor.dtype == dtype:
        return lease
    logger.warning(
        "Chunk %s has shape %s %s, expected %s %s; treating it as a miss.",
        key.hex(),
        tuple(lease.tensor.shape),
        lease.tensor.dtype,
        tuple(shape),
        dtype,
    )
    lease.release()
    return None


def fetch_into_cpu(
    stack: TierStack,
    tier: LowerTier,
    keys: Sequence[bytes],
    shapes: Sequence[Sequence[int]],
    dtype: torch.dtype,
    *,
    parent: bytes | None = None,
    protect: Container[bytes] = frozenset(),
) -> list[MemoryLease]:
    """Read a run of chunks from ``tier`` into CPU-tier buffers, verified, promoted, leased.

    Buffers come from :meth:`~lmcache.tiers.CPUTier.allocate` (evicting, never the keys in
    ``protect``; the run is cut at the first allocation that fails, counted in
    ``failed_allocations``). The run is read
    with one :meth:`~lmcache.tiers.LowerTier.read_into`, which verifies every chunk (header,
    key, fingerprint, geometry, checksum) and stops at the first that is missing or bad. With
    ``local_cpu`` the verified chunks are put into the CPU tier (checksummed when ``checksum``;
    a failing ``put`` stops the promotion, not the hit).

    Args:
        stack: The tiers.
        tier: The lower tier holding the run (one of ``stack.lower``).
        keys: The run's keys, in chain order.
        shapes: Each chunk's ``[num_layers, num_tokens, kv_width]``.
        dtype: The chunks' dtype.
        parent: The key before ``keys[0]`` in its chain (``None``: the chain's head, or
            unknown), recorded with the promoted chunks.
        protect: CPU-tier keys not to evict for the buffers (the prefix the run extends).

    Returns:
        Leases on the leading chunks read and verified (the caller releases them).
    """
    leases: list[MemoryLease] = []
    for shape in shapes[: len(keys)]:
        try:
            lease = stack.cpu.allocate(shape, dtype, metrics=stack.metrics, protect=protect)
        except Exception as exc:
            _cpu_error(stack, "allocate", exc)
            lease = None
        if lease is None:
            stack.metrics.failed_allocations.inc()
            break
        leases.append(lease)
    # each lease goes with its request: a read abandoned past its deadline keeps a share until
    # it returns, so the buffer released below is never reused under it
    requests = [ReadRequest(k, lease.tensor, lease) for k, lease in zip(keys, leases, strict=False)]
    done = tier.read_into(stack.fp_digest, requests, stack.metrics)
    for lease in leases[done:]:
        lease.release()
    leases = leases[:done]
    if stack.local_cpu and leases:
        checksums: list[int | None] = [None] * len(leases)
        if stack.checksum:
            checksums = list(stack.cpu.checksums([lease.tensor for lease in leases]))
        parents = [parent, *keys[: len(leases) - 1]]
        for key, lease, checksum, up in zip(keys, leases, checksums, parents, strict=False):
            try:
                stack.cpu.put(key, lease, checksum, owner=stack.fingerprint, parent=up)
            except Exception as exc:
                _cpu_error(stack, "promote a chunk", exc)
                break
    return leases


def hit_run(
    stack: TierStack,
    keys: Sequence[bytes],
    shapes: Sequence[Sequence[int]],
    dtype: torch.dtype,
    *,
    cpu_lease: Callable[[int], MemoryLease | None] | None = None,
    parent: bytes | None = None,
) -> list[MemoryLease]:
    """Verified leases on the longest run of leading ``keys`` stored in any tier.

    Key ``i`` is taken from ``cpu_lease(i)`` (default: :func:`cpu_get` of the CPU tier); at the
    first key it misses, the lower tiers are asked once (batched) about the rest, and each run of
    keys the first tier holding key ``i`` also holds (up to a key back in the CPU tier) is read
    with :func:`fetch_into_cpu`. A key no tier holds, a short read or a failed verification ends
    the run.

    Args:
        stack: The tiers.
        keys: The chain's keys, in order.
        shapes: Each chunk's ``[num_layers, num_tokens, kv_width]``.
        dtype: The chunks' dtype.
        cpu_lease: A verified lease on key ``i`` from host memory, or ``None`` when it is not
            there (e.g. a share of an already held hit, else :func:`cpu_get`).
        parent: The key before ``keys[0]`` in its chain (``None``: the chain's head, or
            unknown); promoted chunks record their parents, and a promotion never evicts the
            chain's earlier keys to make room.

    Returns:
        One lease per leading key found, in order; the caller releases them. On an exception the
        leases taken so far are released.
    """

    def from_cpu(i: int) -> MemoryLease | None:
        if cpu_lease is not None:
            return cpu_lease(i)
        return cpu_get(stack, keys[i], shapes[i], dtype)

    out: list[MemoryLease] = []
    below: list[list[bool]] | None = None
    base = 0
    try:
        i = 0
        while i < len(keys):
            lease = from_cpu(i)
            if lease is not None:
                out.append(lease)
                i += 1
                continue
            if not stack.lower:
                break
            if below is None:
                base, below = i, lower_presence(stack, keys[i:])
            source = next((t for t, p in enumerate(below) if p[i - base]), None)
            if source is None:
                break
            run = i + 1
            while (
                run < len(keys) and below[source][run - base] and not cpu_contains(stack, keys[run])
            ):
                run += 1
            leases = fetch_into_cpu(
                stack,
                stack.lower[source],
                keys[i:run],
                shapes[i:run],
                dtype,
                parent=keys[i - 1] if i else parent,
                protect=frozenset(keys[:i]),
            )
            out.extend(leases)
            if len(leases) < run - i:
                break
            i = run
    except BaseException:
        for lease in out:
            lease.release()
        raise
    return out


# ------------------------------------------------------------------------------ stores


def keys_to_store(stack: TierStack, keys: Sequence[bytes]) -> list[int]:
    """Positions of the ``keys`` a store must write, in order.

    With ``local_cpu``: those the CPU tier does not hold. Without: those some lower tier lacks
    (one batched query per tier). Nothing when the stack stores nothing.
    """
    if not stack.stores_anything:
        return []
    if stack.local_cpu:
        return _cpu_missing(stack, keys, "look up chunks")
    below = lower_presence(stack, keys)
    return [i for i in range(len(keys)) if not all(p[i] for p in below)]


def write_through(
    stack: TierStack,
    chunks: Sequence[tuple[bytes, MemoryLease, int | None]],
    parents: Sequence[bytes | None] | None = None,
) -> None:
    """Queue a run of one key chain for every lower tier (:meth:`~lmcache.tiers.LowerTier.
    submit_chain`: asynchronous; each tier takes its own share of the leases, and a full queue
    drops the rest of the run, counted in ``dropped_writes``).

    Args:
        stack: The tiers.
        chunks: ``(key, lease, checksum or None)`` per chunk, in chain order.
        parents: Each chunk's chain parent (``None``: a chain's head, or unknown); ``None``
            when no parent is known.
    """
    if not chunks:
        return
    for lower in stack.lower:
        lower.submit_chain(stack.fp_digest, chunks, stack.metrics, parents=parents)


def publish(
    stack: TierStack,
    chunks: Sequence[tuple[bytes, MemoryLease]],
    parents: Sequence[bytes | None] | None = None,
) -> int:
    """Commit filled chunk buffers: checksum, put into the CPU tier, write through below.

    Checksums are taken when ``checksum``, except of chunks that carry the device's sum
    (``MemoryLease.checksum``); with ``local_cpu`` each chunk is put into the CPU tier
    (owner: the fingerprint; a failing ``put`` ends the run there); the committed run goes to
    :func:`write_through`. Counts ``stored_chunks`` and ``stored_bytes``. The caller keeps (and
    releases) its leases; the tiers hold shares of their own. Mark the chain used afterwards
    (:meth:`~lmcache.tiers.CPUTier.touch_many`) so its head ends up the most recent.

    Args:
        stack: The tiers.
        chunks: ``(key, lease)`` per chunk, in chain order, the buffers holding the chunk bytes.
        parents: Each chunk's chain parent (the previous chunk's key; ``None`` for a chain's
            head), recorded by the tiers for their eviction order; ``None`` when unknown.

    Returns:
        How many leading chunks were committed.
    """
    ups: Sequence[bytes | None] = [None] * len(chunks) if parents is None else parents
    if len(ups) != len(chunks):
        raise ValueError(
            f"cascade.publish: {len(chunks)} chunks but {len(ups)} parents; pass one parent per "
            "chunk (None for a chain's head) or parents=None."
        )
    checksums: list[int | None] = [None] * len(chunks)
    # Chunks whose sum the device computed (``lease.checksum``) are verified on the device
    # when they are loaded: hashing them again here would cost the host what the device saved.
    todo = [i for i, (_, lease) in enumerate(chunks) if lease.checksum is None]
    if stack.checksum and todo:
        found = stack.cpu.checksums([chunks[i][1].tensor for i in todo])
        for i, value in zip(todo, found, strict=True):
            checksums[i] = value
    committed: list[tuple[bytes, MemoryLease, int | None]] = []
    for (key, lease), checksum, up in zip(chunks, checksums, ups, strict=True):
        if stack.local_cpu:
            try:
                stack.cpu.put(key, lease, checksum, owner=stack.fingerprint, parent=up)
            except Exception as exc:
                _cpu_error(stack, "store a chunk", exc)
                break
        committed.append((key, lease, checksum))
    write_through(stack, committed, None if parents is None else list(ups[: len(committed)]))
    stack.metrics.stored_chunks.inc(len(committed))
    stack.metrics.stored_bytes.inc(sum(lease.nbytes for _, lease, _ in committed))
    return len(committed)


# ------------------------------------------------------------------------------ lifecycle


def clear(stack: TierStack) -> None:
    """Drop the fingerprint's chunks from every tier: the CPU tier's entries it owns, and the
    lower tiers' entries under its digest (after their queued writes land), including those
    other processes of the same model stored in a shared folder or Redis namespace."""
    try:
        stack.cpu.clear(owner=stack.fingerprint)
    except Exception as exc:
        _cpu_error(stack, "clear", exc)
    for lower in stack.lower:
        lower.clear(stack.fp_digest, stack.metrics)


def flush(stack: TierStack, timeout: float | None = None) -> bool:
    """Wait until every lower tier's queued writes are done (each up to ``timeout`` s);
    returns ``False`` if one timed out."""
    done = True
    for lower in stack.lower:
        done = lower.flush(timeout) and done
    return done
