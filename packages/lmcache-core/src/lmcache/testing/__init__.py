# SPDX-License-Identifier: Apache-2.0
"""Test helpers shipped with lmcache-core for adapters' test suites.

- :class:`~lmcache.testing.conformance.GPUConnectorConformance`: the connector conformance suite
  adapters subclass (needs pytest).
- :class:`~lmcache.testing.paged_cpu_connector.PagedCPUConnector`: a real connector over a
  simple paged CPU layout (register it as ``"mock.cpu"`` with target
  ``"lmcache.testing.paged_cpu_connector:select"``).
- :class:`~lmcache.testing.redis_server.RedisServer`, ``RedisClusterServer``,
  ``RedisSentinel``: real ``redis-server`` processes on 127.0.0.1 for tier tests
  (:func:`~lmcache.testing.redis_server.redis_server_path` is ``None`` where none is installed).

Imported lazily, so ``import lmcache.testing`` does not import pytest.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmcache.testing.conformance import GPUConnectorConformance
    from lmcache.testing.paged_cpu_connector import PagedCPUConnector
    from lmcache.testing.redis_server import (
        RedisClusterServer,
        RedisSentinel,
        RedisServer,
        redis_server_path,
    )

_LAZY: dict[str, str] = {
    "GPUConnectorConformance": "lmcache.testing.conformance",
    "PagedCPUConnector": "lmcache.testing.paged_cpu_connector",
    "RedisClusterServer": "lmcache.testing.redis_server",
    "RedisSentinel": "lmcache.testing.redis_server",
    "RedisServer": "lmcache.testing.redis_server",
    "redis_server_path": "lmcache.testing.redis_server",
}

__all__ = [
    "GPUConnectorConformance",
    "PagedCPUConnector",
    "RedisClusterServer",
    "RedisSentinel",
    "RedisServer",
    "redis_server_path",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lmcache.testing' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
