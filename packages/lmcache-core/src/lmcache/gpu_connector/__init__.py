# SPDX-License-Identifier: Apache-2.0
"""GPU connectors: move KV between an engine's paged memory and lmcache's host chunks.

- :mod:`~lmcache.gpu_connector.interface`: :class:`GPUConnectorInterface` and its lifecycle.
- :mod:`~lmcache.gpu_connector.registry`: ``"<engine>.<device>"`` keys, entry-point discovery,
  :func:`CreateGPUConnector`.
- :mod:`~lmcache.gpu_connector.gpu_ops`: host <-> device copies and injectable device ops.
- :mod:`~lmcache.gpu_connector.reference`: pure-torch paged gather/scatter (fallback + oracle).
- :mod:`~lmcache.gpu_connector.utils`: device helpers.
- :mod:`~lmcache.gpu_connector.layer_range`: what slot-mapped connectors share (the
  :class:`LayerRangeConnector` base, :func:`moved_tokens`, :func:`engine_selector`).
- :mod:`~lmcache.gpu_connector.checksums`: the sums a connector hands back to the engine, and
  the packed index of a kernel transfer.
- :mod:`~lmcache.gpu_connector.device_checks`: :class:`DeviceChecks`, the device half of those
  sums that the kernel connectors share (index uploads, result downloads, the verified scatter).

Names are imported lazily; nothing here imports an engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmcache.gpu_connector.interface import (
        ChunkTransfer,
        EngineInfo,
        GPUConnectorInterface,
        KVLayoutError,
        SupportsLayerwise,
        TransferSpec,
        supports_layerwise,
    )
    from lmcache.gpu_connector.registry import (
        CreateGPUConnector,
        register_gpu_connector,
        registered_gpu_connectors,
    )

_LAZY: dict[str, str] = {
    "ChunkTransfer": "lmcache.gpu_connector.interface",
    "EngineInfo": "lmcache.gpu_connector.interface",
    "GPUConnectorInterface": "lmcache.gpu_connector.interface",
    "KVLayoutError": "lmcache.gpu_connector.interface",
    "SupportsLayerwise": "lmcache.gpu_connector.interface",
    "TransferSpec": "lmcache.gpu_connector.interface",
    "supports_layerwise": "lmcache.gpu_connector.interface",
    "CreateGPUConnector": "lmcache.gpu_connector.registry",
    "register_gpu_connector": "lmcache.gpu_connector.registry",
    "registered_gpu_connectors": "lmcache.gpu_connector.registry",
}

__all__ = [
    "ChunkTransfer",
    "CreateGPUConnector",
    "EngineInfo",
    "GPUConnectorInterface",
    "KVLayoutError",
    "SupportsLayerwise",
    "TransferSpec",
    "register_gpu_connector",
    "registered_gpu_connectors",
    "supports_layerwise",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lmcache.gpu_connector' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
