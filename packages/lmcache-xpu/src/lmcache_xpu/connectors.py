# SPDX-License-Identifier: Apache-2.0
"""The ``vllm.xpu`` and ``sglang.xpu`` connector selectors: the vLLM and SGLang connector
classes, unchanged, over XPU tensors.

Those classes reach the device only through the backend of their KV caches' device
(``lmcache.devices.get_backend``: :class:`~lmcache_xpu.device.XpuBackend` for ``xpu``), and their
gather/scatter is pure torch indexing; none of their fast paths calls a CUDA-only op (the CUDA
kernels are not wired into them), so no class is copied or subclassed to swap the device:

- ``vllm.xpu``: :class:`lmcache_vllm.gpu_connector.VLLMPagedConnector` (the ``vllm.cuda``
  class). An XPU cache takes its ``kv_concat``/``mla`` paths, the fused strided path when the
  layers share one buffer, through the backend's torch copies.
- ``sglang.xpu``: :class:`lmcache_sglang.gpu_connector.SGLangKVConnector` (the ``sglang.cuda``
  class).

The adapter is imported when the key is first used, so this package never needs an engine or an
adapter installed; a missing adapter is an ``ImportError`` naming its install command.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from lmcache._install_hint import adapter_install_command
from lmcache.gpu_connector.layer_range import engine_selector

if TYPE_CHECKING:
    from lmcache.config import LMCacheConfig
    from lmcache.gpu_connector.interface import EngineInfo, GPUConnectorInterface
    from lmcache.metadata import LMCacheMetadata

__all__ = ["select_sglang", "select_vllm"]


def _missing(key: str, engine: str, exc: ImportError) -> ImportError:
    return ImportError(
        f"The {key!r} GPU connector is lmcache-{engine}'s connector class, which could not be "
        f"imported ({exc}); install it: {adapter_install_command(engine)}"
    )


def _reuse(
    engine_name: str,
    module: str,
    cls: str,
    args: tuple[LMCacheConfig, LMCacheMetadata, EngineInfo, Mapping[str, Any] | None],
) -> type[GPUConnectorInterface] | None:
    """The ``<engine_name>.xpu`` selection: that adapter's own class, imported on first use."""
    key = f"{engine_name}.xpu"
    try:
        connector = getattr(importlib.import_module(module), cls)
    except ImportError as exc:
        raise _missing(key, engine_name, exc) from exc
    return engine_selector(engine_name, "xpu", connector)(*args)


def select_vllm(
    config: LMCacheConfig,
    metadata: LMCacheMetadata,
    engine: EngineInfo,
    layout_hints: Mapping[str, Any] | None = None,
) -> type[GPUConnectorInterface] | None:
    """Selector of ``vllm.xpu``: :class:`lmcache_vllm.gpu_connector.VLLMPagedConnector`."""
    args = (config, metadata, engine, layout_hints)
    return _reuse("vllm", "lmcache_vllm.gpu_connector", "VLLMPagedConnector", args)


def select_sglang(
    config: LMCacheConfig,
    metadata: LMCacheMetadata,
    engine: EngineInfo,
    layout_hints: Mapping[str, Any] | None = None,
) -> type[GPUConnectorInterface] | None:
    """Selector of ``sglang.xpu``: :class:`lmcache_sglang.gpu_connector.SGLangKVConnector`."""
    args = (config, metadata, engine, layout_hints)
    return _reuse("sglang", "lmcache_sglang.gpu_connector", "SGLangKVConnector", args)
