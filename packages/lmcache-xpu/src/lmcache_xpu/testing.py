# SPDX-License-Identifier: Apache-2.0
"""A stand-in for the ``torch.xpu`` module, to run the whole XPU path on a machine without one.

:class:`FakeXpu` offers what :class:`lmcache_xpu.device.XpuBackend` calls on ``torch.xpu``
(``Stream``, ``Event``, ``current_stream``, ``stream``, ``synchronize``, ``is_available``,
``device_count``, ``set_device``, ``current_device``, ``empty_cache``) and records every call in
:attr:`FakeXpu.calls` with the ``xpu:<i>`` device it concerns. Its streams and events are plain
objects (work runs at once, so every event is complete once recorded). Inside ``stream(s)`` it
also records every ``Tensor.copy_`` (a torch function mode), which runs on the CPU tensors as
usual: the copies a backend enqueues on an XPU stream.

:func:`fake_xpu` forces the stand-in in: an :class:`~lmcache_xpu.device.XpuBackend` over a
:class:`FakeXpu` serves ``xpu`` devices and, since real tensors cannot live on an XPU here, also
the ``cpu`` tensors of the KV caches (the backend hands the runtime ``xpu:<index>`` for them), and
the ``vllm.xpu`` / ``sglang.xpu`` connector keys are registered. An engine then reaches the XPU
backend for its CPU tensors; the test names the ``<engine>.xpu`` key through
``EngineInfo(device="xpu")`` (or :func:`force_engine_device` for the vLLM adapter).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from lmcache_xpu.device import XpuBackend

__all__ = [
    "FakeXpu",
    "FakeXpuEvent",
    "FakeXpuStream",
    "XpuCall",
    "fake_xpu",
    "force_engine_device",
    "register_xpu_connectors",
]


@dataclass(frozen=True)
class XpuCall:
    """One recorded call: ``name`` (``"Stream"``, ``"Stream.wait_stream"``, ``"copy"``...),
    ``device`` (``"xpu:0"``, ``""`` when none applies) and ``detail`` (the other arguments)."""

    name: str
    device: str
    detail: tuple[Any, ...] = ()


class FakeXpuStream:
    """A ``torch.xpu.Stream`` stand-in."""

    def __init__(self, fake: FakeXpu, device: torch.device, index: int, priority: int) -> None:
        self.fake, self.device, self.index, self.priority = fake, device, index, priority

    def __repr__(self) -> str:
        return f"FakeXpuStream({self.device}, #{self.index})"

    def wait_stream(self, other: Any) -> None:
        self.fake._record("Stream.wait_stream", self.device, self, other)

    def wait_event(self, event: Any) -> None:
        if isinstance(event, FakeXpuEvent):
            event.waited_by.append(self)
        self.fake._record("Stream.wait_event", self.device, self, event)

    def record_event(self, event: Any = None) -> Any:
        event = self.fake.Event() if event is None else event
        event.record(self)
        return event

    def synchronize(self) -> None:
        self.fake._record("Stream.synchronize", self.device, self)

    def query(self) -> bool:
        return True


class FakeXpuEvent:
    """A ``torch.xpu.Event`` stand-in: complete once recorded."""

    def __init__(self, fake: FakeXpu, index: int) -> None:
        self.fake, self.index = fake, index
        self.stream: FakeXpuStream | None = None
        self.waited_by: list[FakeXpuStream] = []

    def __repr__(self) -> str:
        return f"FakeXpuEvent(#{self.index})"

    def _where(self) -> Any:
        return self.stream.device if self.stream is not None else ""

    def record(self, stream: Any = None) -> None:
        self.stream = self.fake.current_stream() if stream is None else stream
        self.fake._record("Event.record", self._where(), self, self.stream)

    def wait(self, stream: Any = None) -> None:
        (self.fake.current_stream() if stream is None else stream).wait_event(self)

    def query(self) -> bool:
        self.fake._record("Event.query", self._where(), self)
        return True

    def synchronize(self) -> None:
        self.fake._record("Event.synchronize", self._where(), self)


class _CopyRecorder(TorchFunctionMode):
    """Records ``Tensor.copy_`` while a :class:`FakeXpu` stream is current (the copies run)."""

    def __init__(self, fake: FakeXpu, stream: FakeXpuStream) -> None:
        super().__init__()
        self.fake, self.stream = fake, stream

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        recorders = self.fake._recorders()
        if func is torch.Tensor.copy_ and args and recorders and recorders[-1] is self:
            dst = args[0]
            self.fake._record(
                "copy",
                self.stream.device,
                dst.numel() * dst.element_size(),
                self.stream,
                bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False)),
            )
        return func(*args, **kwargs)


class FakeXpu:
    """A ``torch.xpu`` stand-in with ``num_devices`` devices (see the module docstring)."""

    def __init__(self, num_devices: int = 1) -> None:
        self.num_devices = num_devices
        self.calls: list[XpuCall] = []
        self._lock = threading.Lock()
        self._streams = 0
        self._events = 0
        self._local = threading.local()  # per thread, as torch's current streams are
        self._defaults: dict[int, FakeXpuStream] = {}

    # -- recording ---------------------------------------------------------------------------

    def _record(self, name: str, device: Any = "", *detail: Any) -> None:
        with self._lock:
            self.calls.append(XpuCall(name, str(device), tuple(detail)))

    def names(self) -> list[str]:
        """The recorded call names, in order."""
        return [c.name for c in self.calls]

    def of(self, name: str) -> list[XpuCall]:
        """The recorded calls named ``name``."""
        return [c for c in self.calls if c.name == name]

    def clear(self) -> None:
        with self._lock:
            self.calls.clear()

    def _index(self, device: Any) -> int:
        if device is None:
            return self.current_device()
        if isinstance(device, int):
            return device
        d = torch.device(device)
        if d.type != "xpu":
            raise RuntimeError(f"FakeXpu: expected an xpu device, got {str(d)!r}")
        return 0 if d.index is None else int(d.index)

    def _current(self) -> dict[int, FakeXpuStream]:
        current = getattr(self._local, "current", None)
        if current is None:
            current = self._local.current = {}
        return current

    def _recorders(self) -> list[_CopyRecorder]:
        """The thread's active copy recorders (only the innermost records a copy)."""
        stack = getattr(self._local, "recorders", None)
        if stack is None:
            stack = self._local.recorders = []
        return stack

    def _new(self, index: int, priority: int) -> FakeXpuStream:
        with self._lock:
            self._streams += 1
            n = self._streams
        return FakeXpuStream(self, torch.device("xpu", index), n, priority)

    # -- the torch.xpu surface ---------------------------------------------------------------

    def is_available(self) -> bool:
        return self.num_devices > 0

    def device_count(self) -> int:
        return self.num_devices

    def current_device(self) -> int:
        return int(getattr(self._local, "device", 0))

    def set_device(self, device: Any) -> None:
        self._local.device = self._index(device)
        self._record("set_device", f"xpu:{self._local.device}")

    def empty_cache(self) -> None:
        self._record("empty_cache")

    def Stream(self, device: Any = None, priority: int = 0) -> FakeXpuStream:
        stream = self._new(self._index(device), priority)
        self._record("Stream", stream.device, stream, priority)
        return stream

    def Event(self, enable_timing: bool = False) -> FakeXpuEvent:
        with self._lock:
            self._events += 1
            n = self._events
        self._record("Event", "", n)
        return FakeXpuEvent(self, n)

    def current_stream(self, device: Any = None) -> FakeXpuStream:
        index = self._index(device)
        stream = self._current().get(index)
        if stream is None:
            with self._lock:
                stream = self._defaults.get(index)
            if stream is None:
                stream = self._new(index, 0)
                with self._lock:
                    stream = self._defaults.setdefault(index, stream)
        return stream

    @contextlib.contextmanager
    def stream(self, stream: Any) -> Iterator[Any]:
        if stream is None:
            yield None
            return
        current = self._current()
        index = stream.device.index
        before = current.get(index)
        current[index] = stream
        self._record("stream", stream.device, stream)
        recorder = _CopyRecorder(self, stream)
        self._recorders().append(recorder)
        try:
            with recorder:
                yield stream
        finally:
            self._recorders().pop()
            if before is None:
                current.pop(index, None)
            else:
                current[index] = before

    def synchronize(self, device: Any = None) -> None:
        self._record("synchronize", f"xpu:{self._index(device)}" if device is not None else "")


def register_xpu_connectors() -> None:
    """Register ``vllm.xpu`` and ``sglang.xpu`` (what the entry points declare), replacing
    any earlier registration of those keys."""
    from lmcache.gpu_connector.registry import register_gpu_connector

    register_gpu_connector("vllm.xpu", "lmcache_xpu.connectors:select_vllm", clobber=True)
    register_gpu_connector("sglang.xpu", "lmcache_xpu.connectors:select_sglang", clobber=True)


@contextlib.contextmanager
def fake_xpu(num_devices: int = 1) -> Iterator[FakeXpu]:
    """Force the XPU backend over a :class:`FakeXpu` in (see the module docstring); on exit the
    ``xpu`` and ``cpu`` backends registered before are restored."""
    from lmcache.devices import registry

    fake = FakeXpu(num_devices)
    # tests only: the registry has no public unregister, so its dict is saved and restored
    with registry._LOCK:
        saved = {t: registry._BACKENDS.get(t) for t in ("xpu", "cpu")}
        for device_type in ("xpu", "cpu"):
            registry._BACKENDS[device_type] = XpuBackend(
                fake, device_type=device_type, pin_memory=False
            )
    register_xpu_connectors()
    try:
        yield fake
    finally:
        with registry._LOCK:
            for device_type, backend in saved.items():
                if backend is None:
                    registry._BACKENDS.pop(device_type, None)
                else:
                    registry._BACKENDS[device_type] = backend


@contextlib.contextmanager
def force_engine_device(device: str = "xpu") -> Iterator[list[str]]:
    """Make the vLLM adapter build its connector under ``vllm.<device>`` whatever device its
    caches are on (with :func:`fake_xpu`: ``vllm.xpu`` for a vLLM CPU engine). Yields the keys
    the adapter asked for."""
    from lmcache_vllm.worker import kv_registration as module

    # Patched by name, because the adapter looks the factory up in this module when it calls it.
    kv_registration: Any = module
    original: Callable[..., Any] = kv_registration.CreateGPUConnector
    keys: list[str] = []

    def create(config: Any, metadata: Any, engine: Any, hints: Any = None) -> Any:
        engine = dataclasses.replace(engine, device=device)
        keys.append(engine.key)
        return original(config, metadata, engine, hints)

    kv_registration.CreateGPUConnector = create
    try:
        yield keys
    finally:
        kv_registration.CreateGPUConnector = original
