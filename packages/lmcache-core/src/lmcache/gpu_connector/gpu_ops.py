# SPDX-License-Identifier: Apache-2.0
"""Host <-> device copies through the device backend (:mod:`lmcache.devices`).

:func:`lmcache_memcpy_async_h2d` / :func:`lmcache_memcpy_async_d2h` validate a tensor pair and
hand it to the :class:`~lmcache.devices.DeviceBackend` of the device tensor's type.

:class:`HostDeviceOps`, :func:`register_device_ops` and :func:`get_device_ops` are the earlier,
smaller interface, kept for plug-ins written against it: :func:`get_device_ops` answers a view
of the device's backend, and :func:`register_device_ops` registers ops as a backend (copies,
current stream and synchronize; the rest behaves as on a device without streams). New code uses
:func:`lmcache.devices.get_backend` and :func:`lmcache.devices.register_backend`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lmcache.devices import registry as _registry
from lmcache.devices.backend import DeviceBackend, copy_pair
from lmcache.devices.cpu import CpuBackend
from lmcache.devices.registry import DEVICE_ENTRY_POINT_GROUP, get_backend, register_backend

__all__ = [
    "DEVICE_ENTRY_POINT_GROUP",
    "HostDeviceOps",
    "get_device_ops",
    "lmcache_memcpy_async_d2h",
    "lmcache_memcpy_async_h2d",
    "register_device_ops",
    "registered_device_types",
]

CopyFn = Callable[[torch.Tensor, torch.Tensor, Any], None]


@dataclass(frozen=True)
class HostDeviceOps:
    """Host <-> device copy and stream operations of one device type (the earlier interface;
    see :class:`lmcache.devices.DeviceBackend` for the whole one).

    Attributes:
        device_type: ``torch.device.type`` these ops serve, e.g. ``"cuda"``.
        h2d: ``h2d(dst_device, src_host, stream)`` enqueues a copy on ``stream`` (``None`` =
            current stream). Shapes and dtypes are already validated.
        d2h: ``d2h(dst_host, src_device, stream)``, likewise.
        current_stream: ``current_stream(device)`` returns the device's current stream (``None``
            for devices without streams).
        synchronize: ``synchronize(stream)`` waits for ``stream`` (``None`` = the whole device).
    """

    device_type: str
    h2d: CopyFn
    d2h: CopyFn
    current_stream: Callable[[torch.device], Any]
    synchronize: Callable[[Any], None]


class _OpsBackend(CpuBackend):
    """A backend made of :class:`HostDeviceOps` (:func:`register_device_ops`): its copies,
    current stream and synchronize; no streams of its own and events always complete, as on
    the CPU backend it extends."""

    def __init__(self, ops: HostDeviceOps) -> None:
        self.ops = ops
        self.device_type = ops.device_type

    def device_for_rank(self, local_rank: int) -> torch.device:
        return DeviceBackend.device_for_rank(self, local_rank)

    def current_stream(self, device: torch.device) -> Any:
        return self.ops.current_stream(device)

    def wait_stream(self, waiter: Any, stream: Any) -> None:
        self.ops.synchronize(stream)

    def synchronize(self, target: Any = None) -> None:
        self.ops.synchronize(None if isinstance(target, torch.device) else target)

    def record_event(self, event: Any, stream: Any) -> Any:
        self.ops.synchronize(stream)  # the event completes when it is recorded
        return event

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any = None) -> None:
        d, s = copy_pair(dst, src, "copy")
        (self.ops.d2h if d.device.type == "cpu" else self.ops.h2d)(d, s, stream)

    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, stream: Any = None) -> None:
        self.ops.h2d(dst, src, stream)

    def copy_d2h(self, dst: torch.Tensor, src: torch.Tensor, stream: Any = None) -> None:
        self.ops.d2h(dst, src, stream)


_VIEWS_LOCK = threading.Lock()
_VIEWS: dict[int, tuple[DeviceBackend, HostDeviceOps]] = {}


def _view(backend: DeviceBackend) -> HostDeviceOps:
    if isinstance(backend, _OpsBackend):
        return backend.ops
    with _VIEWS_LOCK:
        have = _VIEWS.get(id(backend))
        if have is None or have[0] is not backend:
            ops = HostDeviceOps(
                backend.device_type,
                backend.copy_h2d,
                backend.copy_d2h,
                backend.current_stream,
                backend.synchronize,
            )
            have = _VIEWS[id(backend)] = (backend, ops)
        return have[1]


def register_device_ops(device_type: str, ops: HostDeviceOps, *, clobber: bool = False) -> None:
    """Register ``ops`` as the backend of ``device_type`` (e.g. ``"xpu"``).

    Raises:
        ValueError: ``ops.device_type`` differs from ``device_type``, or a backend is already
            registered for it (other than these very ops) and ``clobber`` is false.
    """
    if ops.device_type != device_type:
        raise ValueError(
            f"register_device_ops({device_type!r}, ...) got ops for {ops.device_type!r}; "
            "the two must match."
        )
    with _registry._LOCK:
        have = _registry._BACKENDS.get(device_type)
        if have is not None and _view(have) is ops:
            return
        if have is None and device_type in _registry._BUILTIN and not clobber:
            have = get_backend(device_type)
        if have is not None and not clobber:
            raise ValueError(
                f"Device ops for {device_type!r} are already registered; pass clobber=True to "
                "replace them."
            )
        register_backend(_OpsBackend(ops), clobber=True)


def registered_device_types() -> tuple[str, ...]:
    """Device types with a backend (without loading plug-ins)."""
    return _registry.registered_backends()


def get_device_ops(device_type: str) -> HostDeviceOps:
    """The :class:`HostDeviceOps` view of ``device_type``'s backend, loading a device plug-in
    if needed.

    Raises:
        ValueError: no backend serves ``device_type`` (names the package to install).
    """
    return _view(get_backend(device_type))


def _check_pair(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(
            f"{name}: dst and src must have the same shape and dtype; found dst "
            f"{list(dst.shape)} {dst.dtype} and src {list(src.shape)} {src.dtype}. Allocate dst "
            "with src's shape and dtype."
        )


def lmcache_memcpy_async_h2d(dst: torch.Tensor, src: torch.Tensor, stream: Any = None) -> None:
    """Copy host tensor ``src`` into device tensor ``dst`` (asynchronous on CUDA).

    The copy is enqueued by the device's backend on ``stream`` (``None`` = current stream); it
    overlaps with the host only when ``src`` is pinned. Keep both tensors alive until the stream
    is synchronized. CPU-to-CPU is a plain ``copy_``.

    Args:
        dst: Device tensor ``[*shape]``.
        src: Host tensor ``[*shape]``, same dtype.
        stream: Device stream, or ``None``.

    Raises:
        ValueError: shapes/dtypes differ, ``src`` is not on the host, or no backend serves the
            device type.
    """
    _check_pair(dst, src, "lmcache_memcpy_async_h2d")
    if src.device.type != "cpu":
        raise ValueError(
            f"lmcache_memcpy_async_h2d: src must be a host (cpu) tensor, found {src.device}; "
            "use lmcache_memcpy_async_d2h for device-to-host copies."
        )
    backend = get_backend(dst.device)
    backend.copy_h2d(dst, src, stream)
    if stream is not None:  # the allocator must not reuse dst before ``stream`` is done
        backend.record_stream(dst, stream)


def lmcache_memcpy_async_d2h(dst: torch.Tensor, src: torch.Tensor, stream: Any = None) -> None:
    """Copy device tensor ``src`` into host tensor ``dst`` (asynchronous on CUDA).

    Args:
        dst: Host tensor ``[*shape]`` (pinned for a truly asynchronous copy).
        src: Device tensor ``[*shape]``, same dtype.
        stream: Device stream, or ``None`` for the current stream.

    Raises:
        ValueError: shapes/dtypes differ, ``dst`` is not on the host, or no backend serves the
            device type.
    """
    _check_pair(dst, src, "lmcache_memcpy_async_d2h")
    if dst.device.type != "cpu":
        raise ValueError(
            f"lmcache_memcpy_async_d2h: dst must be a host (cpu) tensor, found {dst.device}; "
            "use lmcache_memcpy_async_h2d for host-to-device copies."
        )
    backend = get_backend(src.device)
    backend.copy_d2h(dst, src, stream)
    if stream is not None:
        backend.record_stream(src, stream)
