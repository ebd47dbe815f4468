# SPDX-License-Identifier: Apache-2.0
"""A stand-in :class:`~lmcache.devices.backend.DeviceBackend` that records every call.

:class:`RecordingBackend` emulates a device of any type (``"cuda"``, ``"xpu"``, ...) on a
machine without one: its streams and events are plain objects, its copies run at once on CPU
tensors, and every stream, event, synchronisation, host-memory and copy call is appended to
:attr:`RecordingBackend.calls` with the device it concerns. Tests register it (``register_backend
(RecordingBackend("xpu"), clobber=True)``) or hand it to the code under test, then assert on
the calls.

It also keeps the order a real device would give its copies. Each stream counts the copies
queued on it; events, ``wait_event`` and ``wait_stream`` carry those counts from stream to stream,
and a host wait (``synchronize``, ``event_synchronize``, an event query) tells the host which
copies have finished. A copy the host has not seen finish is *in flight*
(:meth:`RecordingBackend.in_flight`) even though its bytes moved at once: a real device could
still be reading or writing its host memory. :mod:`lmcache.testing.canaries` uses that to flag
host memory handed back under a copy, and every copy that touches host memory handed back.
The current stream is per thread, as on CUDA.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lmcache.devices.backend import DeviceBackend, copy_pair

__all__ = ["Call", "InFlight", "RecordedEvent", "RecordedStream", "RecordingBackend", "byte_ranges"]


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
    copies: int = 0  # copies queued on it so far
    after: dict[int, int] = field(default_factory=dict)  # stream index -> copies waited for

    def __repr__(self) -> str:
        return f"RecordedStream({self.device}, #{self.index})"


@dataclass(eq=False)
class RecordedEvent:
    """An event; complete once recorded (copies run at once).

    ``clock`` holds, per stream index, the copies that have finished once it has.
    Querying or waiting for it tells the host so.
    """

    index: int
    blocking: bool = False
    stream: RecordedStream | None = None
    recorded: int = 0
    waited_by: list[RecordedStream] = field(default_factory=list)
    clock: dict[int, int] = field(default_factory=dict)
    learn: Callable[[dict[int, int]], None] | None = field(default=None, repr=False)

    def query(self) -> bool:
        if self.learn is not None:
            self.learn(self.clock)
        return True

    def synchronize(self) -> None:
        if self.learn is not None:
            self.learn(self.clock)


@dataclass(frozen=True)
class InFlight:
    """A copy the host has not seen finish: its stream and place in it, the byte ranges
    ``[start, end)`` it writes and reads, and the label of the code that queued it
    (:meth:`RecordingBackend.labelled`)."""

    stream: int
    position: int
    writes: tuple[tuple[int, int], ...]
    reads: tuple[tuple[int, int], ...]
    label: object = None


_MAX_IN_FLIGHT = 1 << 16
"""Copies in flight kept at most (the oldest are forgotten: a test that never waits)."""


def byte_ranges(t: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """The address range ``[start, end)`` that ``t``'s elements span (all of it for a strided
    view); ``()`` for an empty tensor."""
    if t.numel() == 0:
        return ()
    extent = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True)) + 1
    start = t.data_ptr()
    return ((start, start + extent * t.element_size()),)


def _overlaps(ranges: Sequence[tuple[int, int]], lo: int, hi: int) -> bool:
    return any(a < hi and lo < b for a, b in ranges)


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
        self._default: dict[str, RecordedStream] = {}  # each device's stream outside use_stream
        self._local = threading.local()  # .current: this thread's use_stream overrides
        self._events = 0
        self.registered: dict[int, int] = {}  # data_ptr -> nbytes of host_register'ed memory
        self._lock = threading.RLock()  # streams, clocks and copies in flight (many threads)
        self._known: dict[int, int] = {}  # stream index -> copies the host knows finished
        self._in_flight: list[InFlight] = []
        self.copy_watchers: list[Callable[[InFlight], None]] = []
        """Called with every copy as it is queued (``position`` 0 on a device without
        streams, where it has finished when the call returns)."""
        self.violations: list[str] = []
        """Misuses seen: a :meth:`pinned_empty` buffer freed while a copy on it was in flight."""

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
        with self._lock:
            stream = RecordedStream(device, len(self._streams), priority)
            self._streams.append(stream)
        return stream

    def _overrides(self) -> dict[str, RecordedStream]:
        current: dict[str, RecordedStream] | None = getattr(self._local, "current", None)
        if current is None:
            current = self._local.current = {}
        return current

    def current_stream(self, device: torch.device) -> Any:
        if not self.has_streams:
            return None
        key = str(self._dev(device))
        stream = self._overrides().get(key)
        if stream is None:
            with self._lock:
                stream = self._default.get(key)
                if stream is None:
                    stream = self._default[key] = self._stream(self._dev(device))
        return stream

    def new_stream(self, device: torch.device, priority: int = 0) -> Any:
        dev = self._dev(device)
        self._record("new_stream", dev, priority)
        return self._stream(dev, priority) if self.has_streams else None

    @contextlib.contextmanager
    def _using(self, stream: Any) -> Iterator[Any]:
        key = str(stream.device) if isinstance(stream, RecordedStream) else None
        current = self._overrides()
        before = current.get(key) if key is not None else None
        if key is not None:
            current[key] = stream
        self._record("use_stream", self._where(stream), stream)
        try:
            yield stream
        finally:
            if key is not None:
                if before is None:
                    del current[key]
                else:
                    current[key] = before

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return self._using(stream)

    def wait_stream(self, waiter: Any, stream: Any) -> None:
        self._record("wait_stream", self._where(waiter), waiter, stream)
        if isinstance(waiter, RecordedStream) and isinstance(stream, RecordedStream):
            with self._lock:
                _merge(waiter.after, self._clock(stream))

    def synchronize(self, target: Any = None) -> None:
        where = self._where(target) or (str(target) if target is not None else "")
        self._record("synchronize", where, target)
        if isinstance(target, RecordedStream):
            self._learn(self._clock(target))
            return
        with self._lock:  # a device (or all of them): every stream of it is done
            want = None if target is None else str(self._dev(target))
            done = {s.index: s.copies for s in self._streams if want in (None, str(s.device))}
        self._learn(done)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        self._record("record_stream", self._where(stream), stream)

    # -- events ------------------------------------------------------------------------------

    def new_event(self, blocking: bool = False) -> Any:
        with self._lock:
            self._events += 1
            index = self._events
        self._record("new_event", "", blocking)
        return RecordedEvent(index, blocking, learn=self._learn)

    def record_event(self, event: Any, stream: Any) -> Any:
        if isinstance(event, RecordedEvent):
            event.stream = stream if isinstance(stream, RecordedStream) else None
            event.recorded += 1
            event.clock = self._clock(stream) if isinstance(stream, RecordedStream) else {}
        self._record("record_event", self._where(stream), event, stream)
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        if isinstance(event, RecordedEvent) and isinstance(stream, RecordedStream):
            event.waited_by.append(stream)
            with self._lock:
                _merge(stream.after, event.clock)
        self._record("wait_event", self._where(stream), stream, event)

    def event_synchronize(self, event: Any) -> None:
        self._record("event_synchronize", self._where(getattr(event, "stream", None)), event)
        if isinstance(event, RecordedEvent):
            self._learn(event.clock)

    def event_query(self, event: Any) -> bool:
        self._record("event_query", self._where(getattr(event, "stream", None)), event)
        if isinstance(event, RecordedEvent):
            self._learn(event.clock)
        return True

    # -- the order of copies -----------------------------------------------------------------

    def _clock(self, stream: RecordedStream) -> dict[int, int]:
        """The copies that have finished once ``stream``'s queued work has."""
        with self._lock:
            clock = dict(stream.after)
            clock[stream.index] = max(clock.get(stream.index, 0), stream.copies)
        return clock

    def _learn(self, clock: dict[int, int]) -> None:
        """The host waited for ``clock``: drop the copies it covers from those in flight."""
        with self._lock:
            if not clock:
                return
            _merge(self._known, clock)
            known = self._known
            self._in_flight = [c for c in self._in_flight if c.position > known.get(c.stream, 0)]

    @contextlib.contextmanager
    def labelled(self, label: object) -> Iterator[None]:
        """Label the copies this thread queues inside (e.g. with the request they serve)."""
        before = getattr(self._local, "label", None)
        self._local.label = label
        try:
            yield
        finally:
            self._local.label = before

    def in_flight(self, start: int = 0, end: int = 1 << 64) -> list[InFlight]:
        """The copies in flight that write or read bytes in ``[start, end)`` (all of them by
        default)."""
        with self._lock:
            return [
                c
                for c in self._in_flight
                if _overlaps(c.writes, start, end) or _overlaps(c.reads, start, end)
            ]

    def _queued(
        self,
        stream: Any,
        writes: tuple[tuple[int, int], ...],
        reads: tuple[tuple[int, int], ...],
    ) -> None:
        """Count a copy on ``stream`` (``None``: the current stream) and tell the watchers."""
        label = getattr(self._local, "label", None)
        copy = InFlight(-1, 0, writes, reads, label)
        if self.has_streams:
            if not isinstance(stream, RecordedStream):
                stream = self.current_stream(torch.device(self.device_type, 0))
            with self._lock:
                stream.copies += 1
                copy = InFlight(stream.index, stream.copies, writes, reads, label)
                self._in_flight.append(copy)
                if len(self._in_flight) > _MAX_IN_FLIGHT:  # a stream the host never waits for
                    del self._in_flight[: _MAX_IN_FLIGHT // 2]
        for watch in list(self.copy_watchers):
            watch(copy)

    def _freed(self, nbytes: int, start: int) -> None:
        """A :meth:`pinned_empty` buffer's storage was freed (its last tensor went)."""
        late = self.in_flight(start, start + nbytes)
        if late:
            self.violations.append(
                f"a pinned_empty buffer of {nbytes} bytes was freed while {len(late)} copies on "
                "it were in flight (the host never waited for them)"
            )

    # -- host memory -------------------------------------------------------------------------

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        self._record("pinned_empty", "", int(nbytes))
        tensor = torch.empty(int(nbytes), dtype=torch.uint8)
        if self.has_streams and nbytes > 0:  # the storage outlives views: watch it, not them
            weakref.finalize(tensor.untyped_storage(), self._freed, int(nbytes), tensor.data_ptr())
        return tensor

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
        self._queued(stream, byte_ranges(d), byte_ranges(s))
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
        writes = tuple(r for d, _ in pairs for r in byte_ranges(d))
        self._queued(stream, writes, tuple(r for _, s in pairs for r in byte_ranges(s)))
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
        drows, srows = _rows(dst, dpitch, width, height), _rows(src, spitch, width, height)
        self._queued(stream, _row_ranges(drows), _row_ranges(srows))
        drows.copy_(srows)


def _merge(into: dict[int, int], clock: dict[int, int]) -> None:
    for stream, copies in clock.items():
        if copies > into.get(stream, 0):
            into[stream] = copies


def _row_ranges(rows: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """Each row's bytes (a 2D copy skips the bytes between rows, which may be another owner's)."""
    height, width = rows.shape
    if height == 0 or width == 0:
        return ()
    start, pitch = rows.data_ptr(), rows.stride(0)
    return tuple((start + i * pitch, start + i * pitch + width) for i in range(height))


def _rows(t: torch.Tensor, pitch: int, width: int, height: int) -> torch.Tensor:
    if t.dtype != torch.uint8:
        t = t.reshape(-1).view(torch.uint8)
    return t.as_strided((height, width), (pitch, 1), t.storage_offset())
