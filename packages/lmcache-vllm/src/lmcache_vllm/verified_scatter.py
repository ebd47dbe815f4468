# SPDX-License-Identifier: Apache-2.0
"""Chunk checksums on the device for the fused path: sums on store, verified scatters on load.

:class:`ChunkChecksums` belongs to one :class:`~lmcache_vllm.fused_transfer.FusedTransfer` on a
device with streams. It uses the ``torch.ops.lmcache`` kernels through :mod:`lmcache.gpu_ops`
(the pure-torch reference where the extension is absent).

- **Store.** Once a call's gathers have filled the chunk-major staging buffer, one
  ``checksum_chunks`` launch sums every chunk's bytes there. The sums go to a pinned host
  tensor on the same stream, so they are readable when the chunk bytes are.
- **Load, all layers.** After the host copies into staging, one ``checksum_chunks`` launch sums
  the staged chunks and compares each with the sum stored with it. One ``scatter_kv`` launch
  then writes every layer of the chunks that matched. A chunk that did not match keeps its
  slots at ``-1``, so none of its bytes reach the engine's pages. The verdicts go back as
  :class:`~lmcache.gpu_connector.checksums.LoadChecks`.
- **Load, some layers** (a layerwise load). The same ``scatter_kv`` launch returns the sums of
  the layers it moved. The cache engine adds the calls' sums and compares them at the end.

Nothing here waits for the device. This module never imports vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lmcache import gpu_ops
from lmcache.gpu_connector.checksums import LoadChecks, StoreChecksums
from lmcache.gpu_connector.interface import ChunkTransfer, TransferSpec

if TYPE_CHECKING:
    from lmcache.devices import DeviceBackend
    from lmcache_vllm.fused_plan import StagingPlan
    from lmcache_vllm.paged_cache import PagedKVCache

__all__ = ["ChunkChecksums", "LoadIndex"]


@dataclass(frozen=True)
class LoadIndex:
    """Device tensors of one load's staged chunks (uploaded together in one copy).

    Attributes:
        positions: Position in the call's chunk list of each staged chunk.
        offsets: ``[staged + 1]`` int64, the staging token offset of each staged chunk.
        slots: ``[tokens]`` int64, the engine slot of each staging token; ``-1`` for tokens
            the engine holds already.
        chunk_of: ``[tokens]`` int64, the staged chunk of each staging token.
        expected: ``[staged]`` int64, each chunk's stored sum (its bits).
        has_sum: ``[staged]`` bool, whether the chunk has a stored sum.
        row_bytes: Staging bytes of one token (all staged layers).
    """

    positions: list[int]
    offsets: torch.Tensor
    slots: torch.Tensor
    chunk_of: torch.Tensor
    expected: torch.Tensor
    has_sum: torch.Tensor
    row_bytes: int


def _signed(value: int) -> int:
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


class ChunkChecksums:
    """Checksums and verified scatters of one fused cache (see the module docstring).

    Args:
        cache: The paged cache (``kv_concat`` or ``mla``).
        backend: The cache device's backend.
    """

    def __init__(self, cache: PagedKVCache, backend: DeviceBackend) -> None:
        self.device = cache.device
        self.backend = backend
        if cache.kv_format == "mla":
            self.paged = gpu_ops.PagedKV.from_vllm_mla(list(cache.caches))
        else:
            self.paged = gpu_ops.PagedKV.from_vllm(list(cache.caches), cache.head_size_k)
        # Load (or JIT-build) the extension now, at engine start, not on the first request.
        gpu_ops.uses_cext(self.device)

    # -- store --------------------------------------------------------------------------------

    def store_sums(self, plan: StagingPlan, staging: torch.Tensor) -> StoreChecksums:
        """Enqueue the sums of every staged chunk (all layers) on the current stream."""
        offsets = self._upload(_token_offsets(plan))
        sums = gpu_ops.checksum_chunks(staging, offsets, unit_bytes=plan.row_bytes)
        return StoreChecksums(self._download(sums))

    # -- load ---------------------------------------------------------------------------------

    def load_index(
        self, plan: StagingPlan, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> LoadIndex:
        """The device tensors of a load of ``plan``'s staged chunks (one upload, no wait)."""
        skip = transfer.skip_tokens
        positions: list[int] = []
        counts: list[int] = []
        expected: list[int] = []
        has: list[int] = []
        slot_parts: list[torch.Tensor] = []
        sm = transfer.slot_mapping
        for i, c in enumerate(chunks):
            t0 = min(max(skip - c.start, 0), c.num_tokens)
            if t0 >= c.num_tokens:
                continue  # the engine holds all of it: not staged
            positions.append(i)
            counts.append(c.num_tokens)
            expected.append(_signed(c.checksum) if c.checksum is not None else 0)
            has.append(c.checksum is not None)
            part = sm[c.start : c.end].to(torch.int64)
            if t0:
                part = part.clone()
                part[:t0] = -1
            slot_parts.append(part)
        k, total = len(positions), sum(counts)
        host_slots = (
            torch.cat(slot_parts).cpu() if slot_parts else torch.empty(0, dtype=torch.int64)
        )
        chunk_of = torch.repeat_interleave(torch.arange(k, dtype=torch.int64), torch.tensor(counts))
        offsets = [0]
        for n in counts:
            offsets.append(offsets[-1] + n)
        packed = torch.cat(
            [
                torch.tensor(offsets, dtype=torch.int64),
                host_slots,
                chunk_of,
                torch.tensor(expected, dtype=torch.int64),
                torch.tensor(has, dtype=torch.int64),
            ]
        )
        dev = self._upload(packed)
        a = k + 1
        return LoadIndex(
            positions,
            dev[:a],
            dev[a : a + total],
            dev[a + total : a + 2 * total],
            dev[a + 2 * total : a + 2 * total + k],
            dev[a + 2 * total + k :].bool(),
            plan.row_bytes,
        )

    def verified_scatter(self, index: LoadIndex, staging: torch.Tensor) -> LoadChecks:
        """Verify every staged chunk (all layers), then scatter the ones that matched; all on
        the current stream. ``staging`` holds exactly the staged chunks, all layers."""
        sums = gpu_ops.checksum_chunks(staging, index.offsets, unit_bytes=index.row_bytes)
        ok = (sums == index.expected) | ~index.has_sum
        slots = torch.where(ok[index.chunk_of], index.slots, -1)
        gpu_ops.scatter_kv(self.paged, slots, index.offsets, staging)
        return LoadChecks(index.positions, ok=self._download(ok))

    def summed_scatter(
        self, index: LoadIndex, staging: torch.Tensor, layers: range, *, staging_full: bool
    ) -> LoadChecks:
        """Scatter ``layers`` of every staged chunk and return the sums of the bytes moved (the
        engine compares them once every layer has moved); on the current stream."""
        sums = torch.empty(len(index.positions), dtype=torch.int64, device=self.device)
        gpu_ops.scatter_kv(
            self.paged,
            index.slots,
            index.offsets,
            staging,
            checksums=sums,
            layers=layers,
            staging_full=staging_full,
        )
        return LoadChecks(index.positions, sums=self._download(sums), layers=layers)

    def _upload(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` on the device, through page-locked memory, without a host wait."""
        if self.device.type == "cpu":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def _download(self, dev: torch.Tensor) -> torch.Tensor:
        """A host copy of small ``dev``, enqueued on the current stream (read it after the
        stream's work completes)."""
        if self.device.type == "cpu":
            return dev.clone()
        host = torch.empty(dev.shape, dtype=dev.dtype, pin_memory=True)
        self.backend.copy(host, dev, self.backend.current_stream(self.device))
        return host


def _token_offsets(plan: StagingPlan) -> torch.Tensor:
    """``[staged + 1]`` int64 staging token offsets of ``plan``'s staged chunks."""
    offsets = [0]
    for start, end, _ in plan.staged:
        offsets.append(offsets[-1] + end - start)
    return torch.tensor(offsets, dtype=torch.int64)
