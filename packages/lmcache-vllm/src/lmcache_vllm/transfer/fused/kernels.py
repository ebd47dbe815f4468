# SPDX-License-Identifier: Apache-2.0
"""The one-launch kernels of the fused path, with the checksum each copy carries.

:class:`ChunkKernels` gathers a call's chunks into staging and scatters them back, one launch for
all layers, summing or verifying each chunk in the same pass. The store
(:mod:`~lmcache_vllm.transfer.fused.store`) and the load (:mod:`~lmcache_vllm.transfer.fused.load`)
of a device with streams share one. It uses the ``torch.ops.lmcache`` kernels through :mod:`lmcache.gpu_ops`
(their Triton port or vectorized torch where the compiled kernels are absent).

- **Store.** One ``gather_kv`` launch per piece fills the chunk-major staging buffer and sums
  each chunk's bytes in the same pass (:meth:`ChunkKernels.gather_span`). The sums go to a
  pinned host tensor on the same stream, so they are readable when the chunk bytes are.
- **Load, all layers.** After the host copies into staging, one ``checksum_chunks`` launch sums
  the staged chunks and compares each with the sum stored with it. One ``scatter_kv`` launch
  then writes every layer of the chunks that matched. A chunk that did not match keeps its
  slots at ``-1``, so none of its bytes reach the engine's pages. The verdicts go back as
  :class:`~lmcache.gpu_connector.checksums.LoadChecks`.
- **Before a load.** :meth:`ChunkKernels.verify_chunks` checks a hit right after its lookup,
  in its device copy or through a scratch buffer, and waits. A bad chunk is then a miss, before
  vLLM is promised its tokens. A load from a device copy checked this way scatters it with
  :meth:`ChunkKernels.scatter`: each chunk is verified once.
- **Unverified loads** (chunks with no sum, checksums off) take the same one-launch scatter.
- **Load, some layers** (a layerwise load). The same ``scatter_kv`` launch returns the sums of
  the layers it moved. The cache engine adds the calls' sums and compares them at the end.

Nothing here waits for the device. This module never imports vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from lmcache import gpu_ops
from lmcache.gpu_connector.checksums import (
    LoadChecks,
    StoreChecksums,
    expected_part,
    expected_sums,
    match_sums,
    pack_index,
    split_index,
    staged_tokens,
)
from lmcache.gpu_connector.device_checks import DeviceChecks
from lmcache.gpu_connector.interface import ChunkTransfer, TransferSpec

if TYPE_CHECKING:
    from lmcache.devices import DeviceBackend
    from lmcache_vllm.transfer.fused.plan import StagingPlan
    from lmcache_vllm.transfer.paged_cache import PagedKVCache

__all__ = ["ChunkKernels", "KernelIndex"]


@dataclass(frozen=True)
class KernelIndex:
    """Device tensors of one load's staged chunks (uploaded together in one copy).

    Attributes:
        positions: Position in the call's chunk list of each staged chunk.
        offsets: ``[staged + 1]`` int64, the staging token offset of each staged chunk.
        slots: ``[tokens]`` int64, the engine slot of each staging token; ``-1`` for tokens
            the engine holds already.
        chunk_of: ``[tokens]`` int64, the staged chunk of each staging token.
        expected: ``[2 * staged]`` int64, each chunk's stored sum (its bits), then whether it
            has one (1 or 0).
        row_bytes: Staging bytes of one token (all staged layers).
    """

    positions: list[int]
    offsets: torch.Tensor
    slots: torch.Tensor
    chunk_of: torch.Tensor
    expected: torch.Tensor
    row_bytes: int


def _offsets(counts: Sequence[int]) -> list[int]:
    """``[len(counts) + 1]`` running offsets of consecutive ranges of ``counts`` units, checked
    on the host (the kernels trust the device copy)."""
    return gpu_ops.build_chunk_offsets(counts)


class ChunkKernels:
    """Checksums and verified scatters of one fused cache (see the module docstring).

    Args:
        cache: The paged cache (``kv_concat`` or ``mla``).
        backend: The cache device's backend.
    """

    def __init__(self, cache: PagedKVCache, backend: DeviceBackend) -> None:
        self.cache = cache
        self.device = cache.device
        self.backend = backend
        if cache.kv_format == "mla":
            self.paged = gpu_ops.PagedKV.from_vllm_mla(list(cache.caches))
        else:
            self.paged = gpu_ops.PagedKV.from_vllm(list(cache.caches), cache.head_size_k)
        # a 16k-token load's index is ~33k int64: one buffer of 64k holds a 32k-token one
        self.checks = DeviceChecks(self.paged, backend, upload_numel=1 << 16)

    # -- store --------------------------------------------------------------------------------

    def one_launch(self, transfer: TransferSpec) -> bool:
        """Whether ``transfer`` can go through the kernels as one launch: they run as one here
        (compiled or Triton, :func:`lmcache.gpu_ops.one_launch_ops`), and its slot mapping is
        on the host (checked there, with no device sync)."""
        return transfer.slot_mapping.device.type == "cpu" and gpu_ops.one_launch_ops(self.device)

    def close(self) -> None:
        """Drop the pinned upload buffers."""
        self.checks.close()

    def store_sums(self, plan: StagingPlan, staging: torch.Tensor) -> StoreChecksums:
        """Enqueue the sums of every staged chunk (all layers) on the current stream."""
        offsets = self.checks.upload(
            torch.tensor(_offsets([end - start for start, end, _ in plan.staged]))
        )
        sums = gpu_ops.checksum_chunks(staging, offsets, unit_bytes=plan.row_bytes)
        return StoreChecksums(self.checks.download(sums))

    # -- load ---------------------------------------------------------------------------------

    def load_index(
        self, plan: StagingPlan, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> KernelIndex:
        """The device tensors of a load of ``plan``'s staged chunks (one upload, no wait).

        The tokens and slots come from :func:`~lmcache.gpu_connector.checksums.staged_tokens`.
        """
        skip = transfer.skip_tokens
        positions, counts, tokens, host_slots = staged_tokens(chunks, transfer.slot_mapping, skip)
        moved = tokens >= skip
        # the kernels skip a slot outside the cache without a word: refuse one here
        self.cache.check_slots(
            torch.from_numpy(host_slots[moved]), lambda: torch.from_numpy(tokens[moved])
        )
        checksums = [chunks[i].checksum for i in positions]
        dev = self.checks.upload(pack_index(counts.tolist(), host_slots, checksums))
        k, total = len(positions), int(counts.sum())
        return KernelIndex(positions, *split_index(dev, k, total), plan.row_bytes)

    def verified_scatter(self, index: KernelIndex, staging: torch.Tensor) -> LoadChecks:
        """Verify every staged chunk (all layers), then scatter the ones that matched; all on
        the current stream. ``staging`` holds exactly the staged chunks, all layers."""
        return self.checks.verified_scatter(index, staging, index.row_bytes)

    gather_sms: int = 8
    """SMs a store's gather may use. A store runs beside the next forward pass: the gather only
    has to stay ahead of the copy to the host, so the model keeps the other SMs (an SM moves
    tens of GB/s on the device, PCIe about 55)."""

    def gather_span(
        self,
        index: KernelIndex,
        staging: torch.Tensor,
        sums: torch.Tensor | None,
        span: tuple[int, int, int, int],
    ) -> None:
        """:meth:`gather_layers` of all layers, one piece: staged chunks ``[a, b)``, staging tokens
        ``[ta, tb)`` (``span``), their sums into ``sums[a:b]`` (none: no sums); on the current
        stream."""
        a, b, ta, tb = span
        rb = index.row_bytes
        gpu_ops.gather_kv(
            self.paged,
            index.slots[ta:tb],
            index.offsets[a : b + 1] - ta,
            staging[ta * rb : tb * rb],
            checksums=None if sums is None else sums[a:b],
            max_sms=self.gather_sms,
        )

    def new_sums(self, count: int) -> torch.Tensor:
        """A device tensor for the sums of ``count`` chunks (:meth:`gather_span` fills it)."""
        return self.checks.new_sums(count)

    def sums_to_host(self, sums: torch.Tensor) -> StoreChecksums:
        """``sums`` as a store's checksums, their copy to the host enqueued on the current
        stream (readable with the store's bytes)."""
        return StoreChecksums(self.checks.download(sums))

    def gather_layers(
        self, index: KernelIndex, staging: torch.Tensor, sums: torch.Tensor | None, layers: range
    ) -> None:
        """Gather ``layers`` of every staged chunk into ``staging`` (those layers only), and
        each chunk's sum of their bytes into ``sums`` (none: no sums); on the current stream."""
        gpu_ops.gather_kv(
            self.paged,
            index.slots,
            index.offsets,
            staging,
            checksums=sums,
            layers=layers,
            max_sms=self.gather_sms,
        )

    def scatter(
        self, index: KernelIndex, staging: torch.Tensor, layers: range, *, staging_full: bool
    ) -> None:
        """Scatter ``layers`` of every staged chunk, unchecked (one launch); on the current
        stream. For chunks with no sum, or verified already in these very bytes."""
        self.checks.scatter(index, staging, layers, staging_full)

    def scatter_pieces(
        self,
        index: KernelIndex,
        staging: torch.Tensor,
        spans: Sequence[tuple[int, int, int, int]],
        ready: Sequence[Any],
    ) -> None:
        """:meth:`scatter` of all layers piece by piece: piece ``i`` (``spans[i]``, as in
        :meth:`gather_span`) once event ``ready[i]`` (its copy into staging) has completed."""
        rb = index.row_bytes
        stream = self.backend.current_stream(self.device)
        for (a, b, ta, tb), event in zip(spans, ready, strict=True):
            self.backend.wait_event(stream, event)
            gpu_ops.scatter_kv(
                self.paged,
                index.slots[ta:tb],
                index.offsets[a : b + 1] - ta,
                staging[ta * rb : tb * rb],
            )

    @staticmethod
    def checked_before(index: KernelIndex) -> LoadChecks:
        """The checks of a load whose chunks were all verified in its very staged bytes before
        (at lookup): every chunk matched. No device work, nothing to wait for."""
        return LoadChecks(index.positions, ok=torch.ones(len(index.positions), dtype=torch.bool))

    def verified_scatter_pieces(
        self,
        index: KernelIndex,
        staging: torch.Tensor,
        spans: Sequence[tuple[int, int, int, int]],
        ready: Sequence[Any],
    ) -> LoadChecks:
        """:meth:`verified_scatter` piece by piece: piece ``i`` (``spans[i]``, as in
        :meth:`gather_span`) is checked and scattered once event ``ready[i]`` (its copy into
        staging) has completed; on the current stream."""
        rb = index.row_bytes
        ok = torch.empty(len(index.positions), dtype=torch.bool, device=self.device)
        stream = self.backend.current_stream(self.device)
        for (a, b, ta, tb), event in zip(spans, ready, strict=True):
            self.backend.wait_event(stream, event)
            ok[a:b] = self.checks.scatter_matching(
                staging[ta * rb : tb * rb],
                index.offsets[a : b + 1] - ta,
                index.slots[ta:tb],
                index.chunk_of[ta:tb] - a,
                expected_part(index.expected, a, b),
                rb,
            )
        return LoadChecks(index.positions, ok=self.checks.download(ok))

    def summed_scatter(
        self, index: KernelIndex, staging: torch.Tensor, layers: range, *, staging_full: bool
    ) -> LoadChecks:
        """Scatter ``layers`` of every staged chunk and return the sums of the bytes moved (the
        engine compares them once every layer has moved); on the current stream."""
        return self.checks.summed_scatter(index, staging, layers, staging_full=staging_full)

    # -- verify ahead of a load -----------------------------------------------------------------

    scratch_bytes: int = 256 << 20
    """Device buffer through which :meth:`verify_chunks` checks chunks with no device copy."""

    def verify_chunks(
        self,
        chunks: Sequence[ChunkTransfer],
        stream: Any,
        staged: tuple[torch.Tensor, Sequence[int], Sequence[tuple[int, Any]]] | None = None,
    ) -> list[bool]:
        """Whether each chunk's bytes match its ``checksum`` (``True`` without one); waits.

        ``staged``: a device copy of the chunks, back to back (e.g. a hit's prefetch), checked
        in place. It is the buffer, each chunk's byte offset in it, and ``(chunk stop, event)``
        per piece of its copy: each piece is checked once its own copy is in. Without it the
        chunks are copied through a scratch buffer of at most :attr:`scratch_bytes`, piece by
        piece, on ``stream``.
        """
        sizes = [c.buffer.numel() * c.buffer.element_size() for c in chunks]
        expected = [c.checksum for c in chunks]
        backend = self.backend
        parts: list[torch.Tensor] = []
        with backend.use_stream(stream):
            if staged is not None:
                buf, offs, ready = staged
                ends = [*offs[1 : len(chunks)], offs[len(chunks) - 1] + sizes[-1]]
                first = 0
                for stop, event in ready:
                    stop = min(stop, len(chunks))
                    if stop <= first:
                        continue
                    backend.wait_event(stream, event)
                    bounds = [*offs[first:stop], ends[stop - 1]]
                    parts.append(self._check(buf, bounds, expected[first:stop]))
                    first = stop
                if first < len(chunks):
                    raise ValueError(
                        f"verify_chunks: the staged copy's pieces end at chunk {first}; "
                        f"expected all {len(chunks)} chunks"
                    )
            else:
                cap = max(self.scratch_bytes, max(sizes))
                scratch = torch.empty(min(cap, sum(sizes)), dtype=torch.uint8, device=self.device)
                i = 0
                while i < len(chunks):
                    j, at, bounds = i, 0, [0]
                    while j < len(chunks) and (j == i or at + sizes[j] <= cap):
                        src = chunks[j].buffer.reshape(-1).view(torch.uint8)
                        backend.copy(scratch[at : at + sizes[j]], src, stream)
                        at += sizes[j]
                        bounds.append(at)
                        j += 1
                    parts.append(self._check(scratch, bounds, expected[i:j]))
                    i = j
            done = backend.event_after(stream)
        backend.event_synchronize(done)
        return [bool(v) for part in parts for v in part.tolist()]

    def _check(
        self, data: torch.Tensor, bounds: Sequence[int], expected: Sequence[int | None]
    ) -> torch.Tensor:
        """Enqueue: whether each byte range ``[bounds[i], bounds[i + 1])`` of ``data`` sums to
        ``expected[i]`` (a host tensor, readable once the stream's work completes)."""
        gpu_ops.check_data_offsets("verify_chunks", bounds, data, 1)  # host values: no wait
        dev = self.checks.upload(
            torch.tensor([*bounds, *expected_sums(expected)], dtype=torch.int64)
        )
        k = len(expected)
        sums = gpu_ops.checksum_chunks(data, dev[: k + 1])
        return self.checks.download(match_sums(sums, dev[k + 1 :]))
