# SPDX-License-Identifier: Apache-2.0
"""``lmcache.integration.sglang.sglang_adapter``: a path SGLang's ``--enable-lmcache`` imports.

SGLang 0.5.17-0.5.19 ``srt/mem_cache/storage/lmcache/lmc_radix_cache.py`` does ``from
lmcache.integration.sglang.sglang_adapter import LMCacheLayerwiseConnector, LoadMetadata,
StoreMetadata``. The implementation lives in the ``lmcache-sglang`` distribution
(``lmcache_sglang.legacy_adapter``, running in process on lmcache's engine); this module forwards
attribute access to it lazily, and raises ``ImportError`` with the install command when that
package is missing.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

_TARGET = "lmcache_sglang.legacy_adapter"
_INSTALL_HINT = (
    "lmcache.integration.sglang requires the lmcache-sglang adapter: "
    'pip install "lmcache-core[sglang]" (or pip install lmcache-sglang)'
)

__all__ = [  # noqa: F822 - lazy, see __getattr__
    "LMCacheLayerwiseConnector",
    "LoadMetadata",
    "StoreMetadata",
]


def _target() -> ModuleType:
    try:
        return importlib.import_module(_TARGET)
    except ImportError as exc:
        if exc.name is not None and not exc.name.startswith("lmcache_sglang"):
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
