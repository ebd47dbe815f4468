# SPDX-License-Identifier: Apache-2.0
"""Host <-> device copies, dispatched through injectable per-device ops.

Connectors never branch on the device: they call :func:`lmcache_memcpy_async_h2d` /
:func:`lmcache_memcpy_async_d2h` (or :func:`get_device_ops` directly), which look up the
:class:`HostDeviceOps` registered for the device tensor's ``device.type``. ``cuda`` and ``cpu``
are built in; a device package adds its own with :func:`register_device_ops`, typically from an
entry point of group ``lmcache.devices`` (``xpu = "lmcache_xpu.device:register"``), which is
loaded the first time an unknown device type is asked for.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lmcache._install_hint import adapter_install_command

__all__ = [
    "DEVICE_ENTRY_POINT_GROUP",
    "HostDeviceOps",
    "get_device_ops",
    "lmcache_memcpy_async_d2h",
    "lmcache_memcpy_async_h2d",
    "register_device_ops",
    "registered_device_types",
]

logger = logging.getLogger(__name__)

DEVICE_ENTRY_POINT_GROUP = "lmcache.devices"
"""Entry points ``<device_type> = "module:callable"``; the callable registers device ops."""

CopyFn = Callable[[torch.Tensor, torch.Tensor, Any], None]


@dataclass(frozen=True)
class HostDeviceOps:
    """Host <-> device copy and stream operations of one device type.

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


def _cpu_copy(dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
    dst.copy_(src)


def _cpu_current_stream(device: torch.device) -> Any:
    return None


def _cpu_synchronize(stream: Any) -> None:
    return None


def _cuda_copy(dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
    if stream is None:
        dst.copy_(src, non_blocking=True)
        return
    device_tensor = dst if dst.device.type == "cuda" else src
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
    # The caching allocator must not reuse the device memory before ``stream`` is done with it.
    device_tensor.record_stream(stream)


def _cuda_current_stream(device: torch.device) -> Any:
    return torch.cuda.current_stream(device)


def _cuda_synchronize(stream: Any) -> None:
    if stream is None:
        torch.cuda.synchronize()
    else:
        stream.synchronize()


_LOCK = threading.RLock()
_OPS: dict[str, HostDeviceOps] = {
    "cpu": HostDeviceOps("cpu", _cpu_copy, _cpu_copy, _cpu_current_stream, _cpu_synchronize),
    "cuda": HostDeviceOps("cuda", _cuda_copy, _cuda_copy, _cuda_current_stream, _cuda_synchronize),
}
_PLUGINS_TRIED: set[str] = set()


def register_device_ops(device_type: str, ops: HostDeviceOps, *, clobber: bool = False) -> None:
    """Register the host <-> device ops of ``device_type`` (e.g. ``"xpu"``).

    Raises:
        ValueError: ``ops.device_type`` differs from ``device_type``, or ops are already
            registered for it and ``clobber`` is false.
    """
    if ops.device_type != device_type:
        raise ValueError(
            f"register_device_ops({device_type!r}, ...) got ops for {ops.device_type!r}; "
            "the two must match."
        )
    with _LOCK:
        if device_type in _OPS and _OPS[device_type] is not ops and not clobber:
            raise ValueError(
                f"Device ops for {device_type!r} are already registered; pass clobber=True to "
                "replace them."
            )
        _OPS[device_type] = ops


def registered_device_types() -> tuple[str, ...]:
    """Device types with registered ops (without loading plug-ins)."""
    with _LOCK:
        return tuple(sorted(_OPS))


def _load_device_plugin(device_type: str) -> None:
    if device_type in _PLUGINS_TRIED:
        return
    _PLUGINS_TRIED.add(device_type)
    if os.environ.get("LMCACHE_PLUGIN_AUTOLOAD", "1").strip().lower() in {
        "0",
        "false",
        "no",
        "off",
    }:
        return
    for ep in importlib.metadata.entry_points(group=DEVICE_ENTRY_POINT_GROUP, name=device_type):
        try:
            register = ep.load()
        except ImportError as exc:
            logger.warning("Could not import device plug-in %s (%s): %s", ep.name, ep.value, exc)
            continue
        register()


def get_device_ops(device_type: str) -> HostDeviceOps:
    """The :class:`HostDeviceOps` for ``device_type``, loading a device plug-in if needed.

    Raises:
        ValueError: no ops are registered for ``device_type``.
    """
    with _LOCK:
        ops = _OPS.get(device_type)
        if ops is None:
            _load_device_plugin(device_type)
            ops = _OPS.get(device_type)
        if ops is None:
            raise ValueError(
                f"No host<->device ops for device type {device_type!r}. Registered: "
                f"{sorted(_OPS)}. Install the device package ("
                f"{adapter_install_command(device_type)}) or call register_device_ops()."
            )
        return ops


def _check_pair(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(
            f"{name}: dst and src must have the same shape and dtype; found dst "
            f"{list(dst.shape)} {dst.dtype} and src {list(src.shape)} {src.dtype}. Allocate dst "
            "with src's shape and dtype."
        )


def lmcache_memcpy_async_h2d(dst: torch.Tensor, src: torch.Tensor, stream: Any = None) -> None:
    """Copy host tensor ``src`` into device tensor ``dst`` (asynchronous on CUDA).

    On CUDA the copy is enqueued with ``non_blocking=True`` on ``stream`` (``None`` = current
    stream); it overlaps with the host only when ``src`` is pinned. Keep both tensors alive until
    the stream is synchronized. CPU-to-CPU is a plain ``copy_``.

    Args:
        dst: Device tensor ``[*shape]``.
        src: Host tensor ``[*shape]``, same dtype.
        stream: Device stream, or ``None``.

    Raises:
        ValueError: shapes/dtypes differ, ``src`` is not on the host, or the device type has no
            registered ops.
    """
    _check_pair(dst, src, "lmcache_memcpy_async_h2d")
    if src.device.type != "cpu":
        raise ValueError(
            f"lmcache_memcpy_async_h2d: src must be a host (cpu) tensor, found {src.device}; "
            "use lmcache_memcpy_async_d2h for device-to-host copies."
        )
    get_device_ops(dst.device.type).h2d(dst, src, stream)


def lmcache_memcpy_async_d2h(dst: torch.Tensor, src: torch.Tensor, stream: Any = None) -> None:
    """Copy device tensor ``src`` into host tensor ``dst`` (asynchronous on CUDA).

    Args:
        dst: Host tensor ``[*shape]`` (pinned for a truly asynchronous copy).
        src: Device tensor ``[*shape]``, same dtype.
        stream: Device stream, or ``None`` for the current stream.

    Raises:
        ValueError: shapes/dtypes differ, ``dst`` is not on the host, or the device type has no
            registered ops.
    """
    _check_pair(dst, src, "lmcache_memcpy_async_d2h")
    if dst.device.type != "cpu":
        raise ValueError(
            f"lmcache_memcpy_async_d2h: dst must be a host (cpu) tensor, found {dst.device}; "
            "use lmcache_memcpy_async_h2d for host-to-device copies."
        )
    get_device_ops(src.device.type).d2h(dst, src, stream)
