# SPDX-License-Identifier: Apache-2.0
"""The :class:`DeviceBackend` interface: everything a connector does to a device besides
running torch ops on its tensors.

A connector gets one backend at construction (``get_backend(kv_caches[0].device)``) and reaches
the device only through it: streams, events, synchronisation, page-locked host memory and
host <-> device copies. Its lifecycle:

1. ``backend = get_backend(device)`` (:mod:`lmcache.devices.registry`); ``device_for_rank``
   gives the device of a local rank.
2. ``load = backend.new_stream(device)``, ``store = backend.new_stream(device)``: a load stream
   and a store stream per connector and device (``None`` on devices without streams).
3. Work is ordered with events: ``ev = backend.record_event(backend.new_event(), stream)``, then
   ``backend.wait_event(other, ev)`` (device side) or ``backend.event_synchronize(ev)`` (host).
4. Bytes move with ``copy`` (one tensor pair), ``copy_batch`` (many pairs, one call where the
   runtime can) and ``copy_2d`` (``height`` rows at a constant pitch on both sides), all
   enqueued on a stream; the caller keeps the tensors alive until the stream has passed them.

A stream or event is whatever the device's runtime uses (``torch.cuda.Stream``...); ``None``
is the stream of a device without streams (CPU), whose copies are synchronous and whose events
are always complete. Implementations: :mod:`lmcache.devices.cuda`, :mod:`lmcache.devices.cpu`,
device packages (``lmcache_xpu.device``) and :class:`lmcache.testing.recording_backend.RecordingBackend`.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["DeviceBackend", "copy_pair"]


def copy_pair(dst: torch.Tensor, src: torch.Tensor, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dst, src)`` ready for ``dst.copy_(src)``: as given when shape and dtype match, else
    both as flat bytes (contiguous tensors of the same byte size: a copy never converts).

    Raises:
        ValueError: the byte sizes differ, or a tensor of another shape/dtype is not contiguous.
    """
    if dst.shape == src.shape and dst.dtype == src.dtype:
        return dst, src
    nd, ns = dst.numel() * dst.element_size(), src.numel() * src.element_size()
    if nd != ns or not (dst.is_contiguous() and src.is_contiguous()):
        raise ValueError(
            f"{what}: dst {list(dst.shape)} {dst.dtype} ({nd} bytes) and src {list(src.shape)} "
            f"{src.dtype} ({ns} bytes) must have the same shape and dtype, or be contiguous "
            "with the same byte size"
        )
    return dst.reshape(-1).view(torch.uint8), src.reshape(-1).view(torch.uint8)


class DeviceBackend(ABC):
    """Streams, events, host memory and copies of one device type (see the module docstring).

    Attributes:
        device_type: The ``torch.device.type`` served, e.g. ``"cuda"``.
        has_streams: Whether work is queued on streams and runs asynchronously (``False``:
            every stream is ``None``, every copy synchronous, every event complete).
    """

    device_type: str
    has_streams: bool = True

    # -- devices -----------------------------------------------------------------------------

    @abstractmethod
    def is_available(self) -> bool:
        """Whether this process can use a device of this type."""

    @abstractmethod
    def device_count(self) -> int:
        """Devices of this type visible to the process (0 when unavailable)."""

    def device_for_rank(self, local_rank: int) -> torch.device:
        """The device a worker of ``local_rank`` uses: ``<type>:<local_rank % device_count>``.

        Raises:
            RuntimeError: no device of this type is visible.
        """
        n = self.device_count()
        if n <= 0:
            raise RuntimeError(
                f"local rank {local_rank} needs a {self.device_type} device, found none; check "
                f"that the {self.device_type} runtime sees a device (visible-devices variables)"
            )
        return torch.device(self.device_type, local_rank % n)

    def set_device(self, device: torch.device) -> None:
        """Make ``device`` the calling thread's current device (no-op by default)."""
        return None

    def empty_cache(self) -> None:
        """Return cached, unused device memory to the driver (no-op by default)."""
        return None

    # -- streams -----------------------------------------------------------------------------

    @abstractmethod
    def current_stream(self, device: torch.device) -> Any:
        """The stream the calling thread enqueues on for ``device`` (``None``: no streams)."""

    @abstractmethod
    def new_stream(self, device: torch.device, priority: int = 0) -> Any:
        """A new stream on ``device`` (``None``: no streams)."""

    @abstractmethod
    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Context in which ``stream`` is the current stream (``None``: leave it unchanged)."""

    @abstractmethod
    def wait_stream(self, waiter: Any, stream: Any) -> None:
        """Order later work of ``waiter`` after the work queued on ``stream`` so far."""

    def stream_synchronize(self, stream: Any) -> None:
        """Block the host until ``stream``'s queued work is done."""
        self.synchronize(stream)

    @abstractmethod
    def synchronize(self, target: Any = None) -> None:
        """Block the host until ``target`` (a stream, or a ``torch.device``; ``None``: every
        device of this type) has finished its queued work."""

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tell the device allocator that ``tensor`` is in use on ``stream`` (no-op by default)."""
        return None

    # -- events ------------------------------------------------------------------------------

    @abstractmethod
    def new_event(self, blocking: bool = False) -> Any:
        """A new event; ``blocking``: a host wait sleeps instead of spinning."""

    @abstractmethod
    def record_event(self, event: Any, stream: Any) -> Any:
        """Record ``event`` on ``stream`` (after its queued work); returns ``event``."""

    @abstractmethod
    def wait_event(self, stream: Any, event: Any) -> None:
        """Order later work of ``stream`` after ``event`` (device side; the host goes on)."""

    @abstractmethod
    def event_synchronize(self, event: Any) -> None:
        """Block the host until ``event`` has completed."""

    @abstractmethod
    def event_query(self, event: Any) -> bool:
        """Whether ``event`` has completed."""

    def event_after(self, stream: Any, blocking: bool = False) -> Any:
        """A new event recorded on ``stream`` now."""
        return self.record_event(self.new_event(blocking), stream)

    # -- host memory -------------------------------------------------------------------------

    @abstractmethod
    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        """An uninitialised ``[nbytes]`` uint8 host tensor, page-locked where the device supports
        it (plain memory otherwise); freed like any tensor."""

    def host_register(self, tensor: torch.Tensor) -> bool:
        """Page-lock an existing contiguous host tensor in place; ``False`` when not supported
        (the tensor stays pageable). The caller unregisters it before freeing it."""
        return False

    def host_unregister(self, tensor: torch.Tensor) -> None:
        """Undo :meth:`host_register` (no-op when it returned ``False``)."""
        return None

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is page-locked host memory."""
        return False

    # -- copies ------------------------------------------------------------------------------

    @abstractmethod
    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any = None) -> None:
        """Enqueue ``dst <- src`` on ``stream`` (``None``: the current stream). Any direction
        between the host and this device; same byte size; non-contiguous tensors go through
        torch's strided copy."""

    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, stream: Any = None) -> None:
        """:meth:`copy` of host ``src`` into device ``dst``."""
        self.copy(dst, src, stream)

    def copy_d2h(self, dst: torch.Tensor, src: torch.Tensor, stream: Any = None) -> None:
        """:meth:`copy` of device ``src`` into host ``dst``."""
        self.copy(dst, src, stream)

    def copy_batch(
        self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], stream: Any = None
    ) -> None:
        """Enqueue ``dsts[i] <- srcs[i]`` for every ``i`` on ``stream``, in one runtime call
        where the device has one (copies within the batch may run in any order: they must not
        overlap), else one :meth:`copy` each."""
        if len(dsts) != len(srcs):
            raise ValueError(f"copy_batch: {len(dsts)} destinations but {len(srcs)} sources")
        for d, s in zip(dsts, srcs, strict=True):
            self.copy(d, s, stream)

    def copy_2d(
        self,
        dst: torch.Tensor,
        dpitch: int,
        src: torch.Tensor,
        spitch: int,
        width: int,
        height: int,
        stream: Any = None,
    ) -> None:
        """Enqueue ``height`` copies of ``width`` bytes: row ``i`` from byte ``i * spitch`` of
        ``src`` to byte ``i * dpitch`` of ``dst`` (``dst``/``src``: tensors starting at row 0
        whose storages hold every row). One runtime call where the device has one, else one
        :meth:`copy` per row."""
        drows, srows = _rows(dst, dpitch, width, height), _rows(src, spitch, width, height)
        for i in range(height):
            self.copy(drows[i], srows[i], stream)


def _rows(t: torch.Tensor, pitch: int, width: int, height: int) -> torch.Tensor:
    """``[height, width]`` uint8 view of ``t``'s storage, row ``i`` at byte ``i * pitch``."""
    if t.dtype != torch.uint8:
        t = t.reshape(-1).view(torch.uint8)
    return t.as_strided((height, width), (pitch, 1), t.storage_offset())
