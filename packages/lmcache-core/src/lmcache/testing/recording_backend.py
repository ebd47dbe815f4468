# SPDX-License-Identifier: Apache-2.0
"""A stand-in :class:`~lmcache.devices.backend.DeviceBackend` that records every call.

:class:`RecordingBackend` emulates a device of any type (``"cuda"``, ``"xpu"``, ...) on a
machine without one: its streams and events are plain objects, its copies run at once on CPU
tensors, and every stream, event, synchronisation, host-memory and copy call is appended to
:attr:`RecordingBackend.calls` with the device it concerns. Tests register it (``register_backend
(RecordingBackend("xpu"), clobber=True)``) or hand it to the code under test, then assert on
the calls.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lmcache.devices.backend import DeviceBackend, copy_pair

__all__ = ["Call", "RecordedEvent", "RecordedStream", "RecordingBackend"]


@dataclass(frozen=True)
class Call:
    """One recorded call: ``name`` (the method), ``device`` (``"xpu:0"``; ``""`` when none
    applies) and ``detail`` (the other arguments that matter: streams, byte counts...)."""

    name: str
    device: str
    detail: tuple[Any, ...] = ()


@dataclass(eq=False)
class RecordedStream:
    """A stream of the emulated device."""

    device: torch.device
    index: int
    priority: int = 0

    def __repr__(self) -> str:
        return f"RecordedStream({self.device}, #{self.index})"


@dataclass(eq=False)
class RecordedEvent:
    """An event; complete once recorded (copies run at once)."""

    index: int
    blocking: bool = False
    stream: RecordedStream | None = None
    recorded: int = 0
    waited_by: list[RecordedStream] = field(default_factory=list)

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class RecordingBackend(DeviceBackend):
    """Emulates ``device_type`` with ``num_devices`` devices (see the module docstring).

    Args:
        device_type: The device type served, e.g. ``"xpu"``.
        num_devices: Devices it reports.
        has_streams: Whether it behaves as an asynchronous device (streams are
            :class:`RecordedStream`), or as one without streams (every stream ``None``).
    """

    def __init__(
        self, device_type: str = "cuda", num_devices: int = 1, *, has_streams: bool = True
    ) -> None:
        self.device_type = device_type
        self.has_streams = has_streams
        self.num_devices = num_devices
        self.calls: list[Call] = []
        self._streams: list[RecordedStream] = []
        self._current: dict[str, RecordedStream] = {}
        self._events = 0
        self.registered: dict[int, int] = {}  # data_ptr -> nbytes of host_register'ed memory

    # -- recording ---------------------------------------------------------------------------

    def _record(self, name: str, device: Any = "", *detail: Any) -> None:
        self.calls.append(Call(name, str(device) if device is not None else "", tuple(detail)))

    def names(self) -> list[str]:
        """The recorded method names, in order."""
        return [c.name for c in self.calls]

    def of(self, name: str) -> list[Call]:
        """The recorded calls of method ``name``."""
        return [c for c in self.calls if c.name == name]

    def clear(self) -> None:
        self.calls.clear()

    def _dev(self, device: Any) -> torch.device:
        d = torch.device(device)
        return torch.device(self.device_type, 0 if d.index is None else d.index)

    @staticmethod
    def _where(stream: Any) -> str:
        return str(stream.device) if isinstance(stream, RecordedStream) else ""

    # -- devices -----------------------------------------------------------------------------

    def is_available(self) -> bool:
        return self.num_devices > 0

    def device_count(self) -> int:
        return self.num_devices

    def set_device(self, device: torch.device) -> None:
        self._record("set_device", self._dev(device))

    def empty_cache(self) -> None:
        self._record("empty_cache")

    # -- streams -----------------------------------------------------------------------------

    def _stream(self, device: torch.device, priority: int = 0) -> RecordedStream:
        stream = RecordedStream(device, len(self._streams), priority)
        self._streams.append(stream)
        return stream

    def current_stream(self, device: torch.device) -> Any:
        if not self.has_streams:
            return None
        dev = self._dev(device)
        stream = self._current.get(str(dev))
        if stream is None:
            stream = self._current[str(dev)] = self._stream(dev)
        return stream

    def new_stream(self, device: torch.device, priority: int = 0) -> Any:
        dev = self._dev(device)
        self._record("new_stream", dev, priority)
        return self._stream(dev, priority) if self.has_streams else None

    @contextlib.contextmanager
    def _using(self, stream: Any) -> Iterator[Any]:
        key = str(stream.device) if isinstance(stream, RecordedStream) else None
        before = self._current.get(key) if key is not None else None
        if key is not None:
            self._current[key] = stream
        self._record("use_stream", self._where(stream), stream)
        try:
            yield stream
        finally:
            if key is not None:
                if before is None:
                    del self._current[key]
                else:
                    self._current[key] = before

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return self._using(stream)

    def wait_stream(self, waiter: Any, stream: Any) -> None:
        self._record("wait_stream", self._where(waiter), waiter, stream)

    def synchronize(self, target: Any = None) -> None:
        where = self._where(target) or (str(target) if target is not None else "")
        self._record("synchronize", where, target)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        self._record("record_stream", self._where(stream), stream)

    # -- events ------------------------------------------------------------------------------

    def new_event(self, blocking: bool = False) -> Any:
        self._events += 1
        self._record("new_event", "", blocking)
        return RecordedEvent(self._events, blocking)

    def record_event(self, event: Any, stream: Any) -> Any:
        if isinstance(event, RecordedEvent):
            event.stream = stream if isinstance(stream, RecordedStream) else None
            event.recorded += 1
        self._record("record_event", self._where(stream), event, stream)
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        if isinstance(event, RecordedEvent) and isinstance(stream, RecordedStream):
            event.waited_by.append(stream)
        self._record("wait_event", self._where(stream), stream, event)

    def event_synchronize(self, event: Any) -> None:
        self._record("event_synchronize", self._where(getattr(event, "stream", None)), event)

    def event_query(self, event: Any) -> bool:
        self._record("event_query", self._where(getattr(event, "stream", None)), event)
        return True

    # -- host memory -------------------------------------------------------------------------

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        self._record("pinned_empty", "", int(nbytes))
        return torch.empty(int(nbytes), dtype=torch.uint8)

    def host_register(self, tensor: torch.Tensor) -> bool:
        nbytes = tensor.numel() * tensor.element_size()
        self.registered[tensor.data_ptr()] = nbytes
        self._record("host_register", "", nbytes)
        return True

    def host_unregister(self, tensor: torch.Tensor) -> None:
        self.registered.pop(tensor.data_ptr(), None)
        self._record("host_unregister", "", tensor.numel() * tensor.element_size())

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.data_ptr() in self.registered

    # -- copies ------------------------------------------------------------------------------

    def _where_copy(self, stream: Any) -> str:
        where = self._where(stream)
        return where or f"{self.device_type}:0"

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any = None) -> None:
        d, s = copy_pair(dst, src, "RecordingBackend.copy")
        self._record("copy", self._where_copy(stream), d.numel() * d.element_size(), stream)
        d.copy_(s)

    def copy_batch(
        self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], stream: Any = None
    ) -> None:
        if len(dsts) != len(srcs):
            raise ValueError(f"copy_batch: {len(dsts)} destinations but {len(srcs)} sources")
        pairs = [
            copy_pair(d, s, "RecordingBackend.copy_batch") for d, s in zip(dsts, srcs, strict=True)
        ]
        sizes = tuple(d.numel() * d.element_size() for d, _ in pairs)
        self._record("copy_batch", self._where_copy(stream), sizes, stream)
        for d, s in pairs:
            d.copy_(s)

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
        self._record("copy_2d", self._where_copy(stream), (dpitch, spitch, width, height), stream)
        drows = _rows(dst, dpitch, width, height)
        drows.copy_(_rows(src, spitch, width, height))


def _rows(t: torch.Tensor, pitch: int, width: int, height: int) -> torch.Tensor:
    if t.dtype != torch.uint8:
        t = t.reshape(-1).view(torch.uint8)
    return t.as_strided((height, width), (pitch, 1), t.storage_offset())
