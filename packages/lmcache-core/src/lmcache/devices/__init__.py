# SPDX-License-Identifier: Apache-2.0
"""Device backends: the one way lmcache reaches a device.

A :class:`DeviceBackend` covers everything a connector does to a device besides torch ops on
its tensors: the device of a local rank, streams (a load stream and a store stream per
connector and device), events (record, wait, query, synchronize), page-locked host memory of
exactly the requested size, and host <-> device copies (single, batched, 2D). Connectors get
one from :func:`get_backend` for their KV caches' device at construction and never call
``torch.cuda`` or ``torch.xpu`` themselves.

Built in: ``cuda`` (:mod:`lmcache.devices.cuda`) and ``cpu`` (:mod:`lmcache.devices.cpu`).
A device package registers its own through the entry-point group ``lmcache.devices``::

    [project.entry-points."lmcache.devices"]
    xpu = "lmcache_xpu.device:register"      # register() calls register_backend(XpuBackend())

:class:`~lmcache.devices.upload_ring.UploadRing` uploads small index tensors through
page-locked buffers allocated once, not per call.

Tests use :class:`lmcache.testing.recording_backend.RecordingBackend`, which runs on CPU tensors
and records every call.
"""

from __future__ import annotations

from lmcache.devices.backend import DeviceBackend
from lmcache.devices.registry import (
    DEVICE_ENTRY_POINT_GROUP,
    get_backend,
    host_backend,
    register_backend,
    registered_backends,
)
from lmcache.devices.upload_ring import UploadRing

__all__ = [
    "DEVICE_ENTRY_POINT_GROUP",
    "DeviceBackend",
    "UploadRing",
    "get_backend",
    "host_backend",
    "register_backend",
    "registered_backends",
]
