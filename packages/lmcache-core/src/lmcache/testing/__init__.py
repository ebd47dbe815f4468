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
- :func:`~lmcache.testing.tiny_model.build_tiny_llama`,
  :func:`~lmcache.testing.tiny_model.make_prompt`: a tiny random Llama (and its word-level
  tokenizer) written with ``transformers`` at test time, and prompts for it (re-exported by
  ``lmcache_vllm.testing`` and ``lmcache_sglang.testing``).
- :mod:`lmcache.testing.node_owner`: a real node cache owner and engine child processes for
  node cache tests (:mod:`lmcache.node`).

Imported lazily, so ``import lmcache.testing`` does not import pytest (nor ``transformers``).
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
    from lmcache.testing.tiny_model import build_tiny_llama, make_prompt

_LAZY: dict[str, str] = {
    "GPUConnectorConformance": "lmcache.testing.conformance",
    "PagedCPUConnector": "lmcache.testing.paged_cpu_connector",
    "RedisClusterServer": "lmcache.testing.redis_server",
    "RedisSentinel": "lmcache.testing.redis_server",
    "RedisServer": "lmcache.testing.redis_server",
    "redis_server_path": "lmcache.testing.redis_server",
    "build_tiny_llama": "lmcache.testing.tiny_model",
    "make_prompt": "lmcache.testing.tiny_model",
}

__all__ = [
    "GPUConnectorConformance",
    "PagedCPUConnector",
    "RedisClusterServer",
    "RedisSentinel",
    "RedisServer",
    "build_tiny_llama",
    "make_prompt",
    "redis_server_path",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lmcache.testing' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
