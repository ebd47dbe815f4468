# SPDX-License-Identifier: Apache-2.0
"""Small device helpers shared by connectors."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from lmcache.config import LMCacheConfig

__all__ = [
    "current_stream_for",
    "get_device_type",
    "is_pinned_memory_available",
    "need_gpu_interm_buffer",
]


def need_gpu_interm_buffer(config: LMCacheConfig) -> bool:
    """Whether device connectors gather into a device staging buffer first.

    With ``config.gpu_staging_buffer`` the CUDA connectors gather the paged KV into a contiguous
    device buffer ``[num_layers, num_tokens, kv_width]`` and move it with one copy-engine DMA,
    instead of having SMs read/write host memory over PCIe (as fast, and leaves SMs to the model).
    """
    return bool(config.gpu_staging_buffer)


def get_device_type(t: torch.Tensor) -> str:
    """``t.device.type``: ``"cuda"``, ``"cpu"``, ``"xpu"``, ..."""
    return t.device.type


def current_stream_for(device: torch.device | str) -> Any:
    """The current stream of ``device`` (``None`` for the CPU), through its device backend.

    Raises:
        ValueError: no backend serves the device type (:func:`lmcache.devices.get_backend`).
    """
    from lmcache.devices import get_backend

    dev = torch.device(device)
    return get_backend(dev).current_stream(dev)


def is_pinned_memory_available() -> bool:
    """Whether host memory can be page-locked (a device backend other than the CPU's is
    available: CUDA, or a registered one such as XPU)."""
    from lmcache.devices import host_backend

    return host_backend().device_type != "cpu"
