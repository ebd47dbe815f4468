# SPDX-License-Identifier: Apache-2.0
"""Frozen import path of vLLM's in-tree ``LMCacheConnectorV1``.

vLLM's ``vllm/distributed/kv_transfer/kv_connector/v1/lmcache_connector.py`` does
``from lmcache.integration.vllm.vllm_v1_adapter import LMCacheConnectorV1Impl`` and constructs it as
``LMCacheConnectorV1Impl(vllm_config, role, wrapper)``. The implementation lives in the
``lmcache-vllm`` distribution; this module forwards attribute access to
``lmcache_vllm.vllm_v1_adapter`` lazily, and raises ``ImportError`` with the install command when
that package is missing.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

_TARGET = "lmcache_vllm.vllm_v1_adapter"
_INSTALL_HINT = (
    "lmcache.integration.vllm requires the lmcache-vllm adapter: "
    'pip install "lmcache-core[vllm]" (or pip install lmcache-vllm)'
)

__all__ = ["LMCacheConnectorV1Impl"]  # noqa: F822 - provided lazily by __getattr__


def _target() -> ModuleType:
    try:
        return importlib.import_module(_TARGET)
    except ImportError as exc:
        if exc.name is not None and not exc.name.startswith("lmcache_vllm"):
            raise
        raise ImportError(f"{_INSTALL_HINT} (could not import {_TARGET}: {exc})") from exc


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    try:
        return getattr(_target(), name)
    except AttributeError:
        raise AttributeError(f"{_TARGET} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted(__all__)
