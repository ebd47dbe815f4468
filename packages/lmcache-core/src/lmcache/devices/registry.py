# SPDX-License-Identifier: Apache-2.0
"""Which :class:`~lmcache.devices.backend.DeviceBackend` serves a device.

``cuda`` and ``cpu`` are built in (created on first use). Any other device type comes from a
device package: an entry point of group ``lmcache.devices`` (``xpu =
"lmcache_xpu.device:register"``), a callable that calls :func:`register_backend`, loaded the
first time that device type is asked for (``LMCACHE_PLUGIN_AUTOLOAD=0`` switches the loading
off). An unknown device type is an error naming the device and the package to install.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import threading
from collections.abc import Callable

import torch

from lmcache._install_hint import adapter_install_command
from lmcache.devices.backend import DeviceBackend

__all__ = [
    "DEVICE_ENTRY_POINT_GROUP",
    "get_backend",
    "host_backend",
    "register_backend",
    "registered_backends",
]

logger = logging.getLogger(__name__)

DEVICE_ENTRY_POINT_GROUP = "lmcache.devices"
"""Entry points ``<device_type> = "module:callable"``; the callable registers a backend."""


def _cuda() -> DeviceBackend:
    from lmcache.devices.cuda import CudaBackend

    return CudaBackend()


def _cpu() -> DeviceBackend:
    from lmcache.devices.cpu import CpuBackend

    return CpuBackend()


_LOCK = threading.RLock()
_BUILTIN: dict[str, Callable[[], DeviceBackend]] = {"cuda": _cuda, "cpu": _cpu}
_BACKENDS: dict[str, DeviceBackend] = {}
_PLUGINS_TRIED: set[str] = set()


def register_backend(backend: DeviceBackend, *, clobber: bool = False) -> None:
    """Serve ``backend.device_type`` with ``backend`` (a device package's ``register``).

    Raises:
        ValueError: another backend already serves that device type and ``clobber`` is false.
    """
    with _LOCK:
        have = _BACKENDS.get(backend.device_type)
        if have is not None and have is not backend and not clobber:
            raise ValueError(
                f"A device backend for {backend.device_type!r} is already registered "
                f"({type(have).__name__}); pass clobber=True to replace it."
            )
        _BACKENDS[backend.device_type] = backend


def registered_backends() -> tuple[str, ...]:
    """Device types with a backend, built-in ones included (without loading plug-ins)."""
    with _LOCK:
        return tuple(sorted(set(_BACKENDS) | set(_BUILTIN)))


def _autoload() -> bool:
    return os.environ.get("LMCACHE_PLUGIN_AUTOLOAD", "1").strip().lower() not in {
        "0",
        "false",
        "no",
        "off",
    }


def _load_plugin(device_type: str) -> None:
    if device_type in _PLUGINS_TRIED:
        return
    _PLUGINS_TRIED.add(device_type)
    if not _autoload():
        return
    for ep in importlib.metadata.entry_points(group=DEVICE_ENTRY_POINT_GROUP, name=device_type):
        try:
            register = ep.load()
        except ImportError as exc:
            logger.warning("Could not import device plug-in %s (%s): %s", ep.name, ep.value, exc)
            continue
        register()


def get_backend(device: torch.device | str) -> DeviceBackend:
    """The backend of ``device`` (``"cuda:1"``, ``torch.device("xpu")``, ``"cpu"``...),
    loading a device plug-in if needed.

    Raises:
        ValueError: no backend serves the device's type.
    """
    # a string is split by hand: torch.device() refuses device types it does not know
    device_type = device.type if isinstance(device, torch.device) else device.split(":", 1)[0]
    with _LOCK:
        backend = _BACKENDS.get(device_type)
        if backend is not None:
            return backend
        make = _BUILTIN.get(device_type)
        if make is None:
            _load_plugin(device_type)
            backend = _BACKENDS.get(device_type)
            if backend is None:
                raise ValueError(
                    f"No device backend for {str(device)!r} (device type {device_type!r}). "
                    f"Registered: {list(registered_backends())}. Install the device package "
                    f"({adapter_install_command(device_type)}), or register one with "
                    "lmcache.devices.register_backend()."
                )
            return backend
        backend = make()
        _BACKENDS[device_type] = backend
        return backend


def host_backend() -> DeviceBackend:
    """The backend whose page-locked memory host buffers should use: the first available of
    CUDA and the registered device backends, else the CPU's (plain memory)."""
    cuda = get_backend("cuda")
    if cuda.is_available():
        return cuda
    with _LOCK:
        others = [b for t, b in sorted(_BACKENDS.items()) if t not in ("cuda", "cpu")]
    for backend in others:
        if backend.is_available():
            return backend
    return get_backend("cpu")
