# SPDX-License-Identifier: Apache-2.0
"""Uploads of small host tensors (indices, slot lists, expected checksums) to a device without
allocating page-locked memory per call.

Allocating page-locked memory costs a driver call each time, and CUDA may order work on
other streams around it: a load's index upload could then stall a concurrent store's copies.
:class:`UploadRing` keeps a few page-locked buffers and reuses each once its last upload has
finished on the device. It never waits for the device: uploads are enqueued from the engine's
own thread, behind its forward pass, so a wait there would hold the engine until that pass ends.
With every kept buffer busy, an upload takes an extra buffer, held (not reused, not freed) until
its copy has finished: the copy may be a raw DMA that torch's allocator does not know about.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from lmcache.devices.backend import DeviceBackend

__all__ = ["UploadRing"]


class UploadRing:
    """A ring of page-locked int64 host buffers for uploads to one device.

    Args:
        backend: The device's backend (page-locked memory, events, copies).
        device: The device uploads go to.
        slots: Buffers kept for reuse.
        min_numel: Initial size of a new buffer, in int64 elements.
    """

    def __init__(
        self, backend: DeviceBackend, device: torch.device, slots: int = 8, min_numel: int = 1 << 12
    ) -> None:
        if slots < 1:
            raise ValueError(f"UploadRing: expected at least 1 slot, found {slots}.")
        self.backend = backend
        self.device = device
        self.slots = slots
        self.min_numel = min_numel
        self._ring: list[list[Any]] = []  # [page-locked int64 buffer, event of its last upload]
        self._extra: list[list[Any]] = []  # the same, taken while the ring was busy
        # Taking a slot, filling it and recording its upload is one step under this lock: a
        # store may be planned on one thread while a load runs on another.
        self._lock = threading.Lock()

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` (int64, any shape) copied to the device on the current stream.

        The copy is enqueued, not waited for. The returned tensor is valid for work enqueued
        after it on the current stream (or on streams that wait for it).
        """
        if host.dtype != torch.int64:
            raise TypeError(f"UploadRing.upload: expected an int64 tensor, found {host.dtype}.")
        if not self.backend.has_streams:
            return host.to(self.device).clone()
        numel = host.numel()
        stream = self.backend.current_stream(self.device)
        with self._lock:
            slot = self._take(numel)
            buf = slot[0][:numel].view(host.shape)
            buf.copy_(host)
            on_dev = torch.empty(host.shape, dtype=torch.int64, device=self.device)
            self.backend.copy(on_dev, buf, stream)
            slot[1] = self.backend.event_after(stream)
        return on_dev

    def _take(self, numel: int) -> list[Any]:
        """A ``[buffer of at least numel, None]`` slot whose last upload has finished (the caller
        holds the lock and records its new upload's event in slot ``[1]``).

        A buffer whose upload is still queued is skipped, never waited for. With the whole ring
        busy, the slot is an extra buffer, dropped once its upload has finished.
        """
        self._extra = [s for s in self._extra if not self.backend.event_query(s[1])]
        ring = self._ring
        for slot in ring:
            if slot[1] is None or self.backend.event_query(slot[1]):
                break
        else:
            slot = [self._pinned(max(numel, self.min_numel)), None]
            (ring if len(ring) < self.slots else self._extra).append(slot)
            return slot
        if slot[0].numel() < numel:
            slot[0] = self._pinned(max(numel, 2 * slot[0].numel()))
        slot[1] = None
        ring.remove(slot)
        ring.append(slot)  # most recently used last: the first busy one is the oldest
        return slot

    def _pinned(self, numel: int) -> torch.Tensor:
        return self.backend.pinned_empty(numel * 8).view(torch.int64)

    def close(self) -> None:
        """Wait for the uploads still queued, then drop the buffers."""
        with self._lock:
            for _, event in self._ring + self._extra:
                if event is not None:
                    self.backend.event_synchronize(event)
            self._ring = []
            self._extra = []
