# SPDX-License-Identifier: Apache-2.0
"""The device half of chunk checksums, shared by the connectors that move KV through the kernels.

A connector that gathers and scatters with :mod:`lmcache.gpu_ops` holds one :class:`DeviceChecks`
for its paged KV. It does three things there:

- **Uploads** of a transfer's index (offsets, slots, expected sums) through an
  :class:`~lmcache.devices.UploadRing`, so no call allocates page-locked memory.
- **Downloads** of small results (sums, verdicts) into page-locked host memory on the current
  stream. The caller reads them once the stream's work has completed.
- **The verified scatter.** Staged chunks are summed and compared with their stored sums.
  Only the chunks that match are written: a chunk that does not match has its slots set to
  ``-1``, so none of its bytes reach the engine's pages.

Everything is enqueued on the current stream; nothing here waits for the device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from lmcache import gpu_ops
from lmcache.devices import UploadRing
from lmcache.gpu_connector.checksums import LoadChecks, match_sums

if TYPE_CHECKING:
    from lmcache.devices import DeviceBackend

__all__ = ["DeviceChecks", "StagedChunks"]


class StagedChunks(Protocol):
    """A kernel transfer's device index of its ``k`` staged chunks
    (:func:`~lmcache.gpu_connector.checksums.split_index` of one upload)."""

    @property
    def positions(self) -> list[int]:
        """Position of each staged chunk in the call's chunk list."""

    @property
    def offsets(self) -> torch.Tensor:
        """``[k + 1]`` staging token offset of each chunk."""

    @property
    def slots(self) -> torch.Tensor:
        """``[tokens]`` engine slot of each staging token; ``-1`` is never written."""

    @property
    def chunk_of(self) -> torch.Tensor:
        """``[tokens]`` chunk (``0..k-1``) of each staging token."""

    @property
    def expected(self) -> torch.Tensor:
        """``[2 * k]`` :func:`~lmcache.gpu_connector.checksums.expected_sums` of the chunks."""


class DeviceChecks:
    """Checksum work of one connector's paged KV on its device (see the module docstring).

    Args:
        paged: The engine's pages, as the kernels address them.
        backend: The pages' device backend: every stream, copy and host buffer goes through it.
        upload_numel: Initial size of an upload buffer, in int64 elements.
    """

    def __init__(
        self, paged: gpu_ops.PagedKV, backend: DeviceBackend, upload_numel: int = 1 << 12
    ) -> None:
        self.paged = paged
        self.device = paged.device
        self.backend = backend
        self.uploads = UploadRing(backend, paged.device, min_numel=upload_numel)
        # Load the kernels (or probe their Triton port) now, at engine start, not on the first
        # request; without the compiled kernels the one WARNING is logged here.
        gpu_ops.one_launch_ops(self.device)

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        """Int64 ``host`` on the device, enqueued on the current stream (no host wait)."""
        if self.device.type == "cpu":
            return host
        return self.uploads.upload(host)

    def download(self, dev: torch.Tensor) -> torch.Tensor:
        """A page-locked host copy of small ``dev``, enqueued on the current stream.

        Read it after the stream's work completes. The copy is torch's own: the pinned allocator
        the buffer comes from then knows a copy is pending, and does not hand the buffer out
        again before it completes, even if the caller drops it early (a raw runtime copy would
        not tell it).
        """
        if self.device.type == "cpu":
            return dev.clone()
        nbytes = dev.numel() * dev.element_size()
        host = self.backend.pinned_empty(nbytes).view(dev.dtype).view(dev.shape)
        host.copy_(dev, non_blocking=True)
        return host

    def new_sums(self, count: int) -> torch.Tensor:
        """A device tensor for the sums of ``count`` chunks (the kernels fill it)."""
        return torch.empty(count, dtype=torch.int64, device=self.device)

    def scatter_matching(
        self,
        staging: torch.Tensor,
        offsets: torch.Tensor,
        slots: torch.Tensor,
        chunk_of: torch.Tensor,
        expected: torch.Tensor,
        unit_bytes: int,
        layers: range | None = None,
    ) -> torch.Tensor:
        """Sum each staged chunk, then scatter only those that match; all on the current stream.

        Args:
            staging: Chunk-major staging holding every layer of ``k`` chunks back to back.
            offsets: ``[k + 1]`` staging token offset of each chunk.
            slots: ``[tokens]`` engine slot of each staging token; ``-1`` is never written.
            chunk_of: ``[tokens]`` chunk (``0..k-1``) of each staging token.
            expected: ``[2 * k]`` :func:`~lmcache.gpu_connector.checksums.expected_sums`.
            unit_bytes: Staging bytes of one token.
            layers: The layers ``staging`` holds and the scatter writes (all by default).

        Returns:
            ``[k]`` bool on the device: whether each chunk matched (and was written).
        """
        sums = gpu_ops.checksum_chunks(staging, offsets, unit_bytes=unit_bytes)
        ok = match_sums(sums, expected)
        gpu_ops.scatter_kv(
            self.paged, torch.where(ok[chunk_of], slots, -1), offsets, staging, layers=layers
        )
        return ok

    def verified_scatter(
        self,
        index: StagedChunks,
        staging: torch.Tensor,
        unit_bytes: int,
        layers: range | None = None,
    ) -> LoadChecks:
        """:meth:`scatter_matching` of every chunk of ``index``, the verdicts downloaded as the
        load's checks."""
        ok = self.scatter_matching(
            staging, index.offsets, index.slots, index.chunk_of, index.expected, unit_bytes, layers
        )
        return LoadChecks(index.positions, ok=self.download(ok))

    def summed_scatter(
        self, index: StagedChunks, staging: torch.Tensor, layers: range, staging_full: bool = False
    ) -> LoadChecks:
        """Scatter ``layers`` of the staged chunks and return the sums of the bytes moved; on the
        current stream. The engine adds the calls' sums up and compares them once every layer
        has moved."""
        sums = self.new_sums(len(index.positions))
        self.scatter(index, staging, layers, staging_full, sums)
        return LoadChecks(index.positions, sums=self.download(sums), layers=layers)

    def scatter(
        self,
        index: StagedChunks,
        staging: torch.Tensor,
        layers: range,
        staging_full: bool = False,
        sums: torch.Tensor | None = None,
    ) -> None:
        """Scatter ``layers`` of the staged chunks, unchecked (one launch), on the current stream;
        ``sums`` receives the sums of the bytes moved."""
        gpu_ops.scatter_kv(
            self.paged,
            index.slots,
            index.offsets,
            staging,
            checksums=sums,
            layers=layers,
            staging_full=staging_full,
        )

    def close(self) -> None:
        """Wait for the uploads still queued: none may read a freed buffer."""
        self.uploads.close()
