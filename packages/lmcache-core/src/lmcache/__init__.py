# SPDX-License-Identifier: Apache-2.0
"""lmcache: a KV-cache layer for LLM serving engines.

Serving engines (vLLM, SGLang) keep each request's attention KV in paged device memory and drop it
when the request ends. lmcache saves that KV in chunks to a host memory pool, a local disk folder
and a shared Redis/Valkey server, and loads it back into the engine's pages when a later request starts with
the same tokens, so the engine skips that prefill.

Public entry points (imported lazily; ``import lmcache`` never imports an engine):

- :class:`lmcache.config.LMCacheConfig`, :func:`lmcache.config.load_config`
- :mod:`lmcache.errors`: the exceptions shared across lmcache (``ConfigError``, ``KVLayoutError``,
  ``LeaseError``, ...), importable from where each is raised too
- :class:`lmcache.metadata.LMCacheMetadata` and :func:`lmcache.model_identity.model_digest`
  (what a model name stands for: configuration and weights)
- :class:`lmcache.cache_engine.LMCacheEngine` (``lookup`` / ``lookup_and_lease`` / ``store`` /
  ``retrieve``) and :class:`lmcache.cache_engine.HeldHit` (a leased lookup hit)
- :func:`lmcache.gpu_connector.CreateGPUConnector` and the connector interface
- :mod:`lmcache.keys` (chunk keys), :mod:`lmcache.memory` (host pool and leases),
  :mod:`lmcache.tiers` (CPU, disk and Redis/Valkey tiers), :mod:`lmcache.metrics` (Prometheus metrics)
- :mod:`lmcache.testing` (a conformance suite for connectors, real ``redis-server`` fixtures)

Engine adapters are separate distributions, installed with an extra from the wheels a checkout
builds (``pip install "./dist/lmcache_core-0.1.0-py3-none-any.whl[vllm]"
./dist/lmcache_vllm-0.1.0-py3-none-any.whl``).

LMCache's own ``lmcache`` distribution ships an import package of the same name; with both
installed their files would mix, so ``import lmcache`` refuses to load while that distribution
is installed (:func:`_refuse_conflicting_distribution`).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
from typing import Any

__version__ = "0.1.0"

_LAZY: dict[str, str] = {
    "LMCacheConfig": "lmcache.config",
    "load_config": "lmcache.config",
    "ConfigError": "lmcache.errors",
    "LMCacheMetadata": "lmcache.metadata",
    "LMCacheEngine": "lmcache.cache_engine",
    "HeldHit": "lmcache.engine.held_hit",
    "CreateGPUConnector": "lmcache.gpu_connector",
}

__all__ = ["__version__", *_LAZY]


def _apply_log_level() -> None:
    """``LMCACHE_LOG_LEVEL=DEBUG`` (or INFO, WARNING, ...) sets our loggers' level."""
    level = os.environ.get("LMCACHE_LOG_LEVEL", "").strip().upper()
    if not level:
        return
    if not isinstance(logging.getLevelName(level), int):
        logging.getLogger(__name__).warning(
            "LMCACHE_LOG_LEVEL=%r is not a logging level; expected one of DEBUG, INFO, WARNING, "
            "ERROR, CRITICAL. Keeping the default.",
            level,
        )
        return
    for name in ("lmcache", "lmcache_vllm", "lmcache_sglang", "lmcache_xpu"):
        logging.getLogger(name).setLevel(level)


_apply_log_level()

#: Distributions that install an import package named ``lmcache`` other than ours.
CONFLICTING_DISTRIBUTIONS = ("lmcache",)


def _refuse_conflicting_distribution() -> None:
    """Raise ImportError when LMCache's ``lmcache`` distribution is installed too (read from
    installed metadata: both write ``site-packages/lmcache/``, and mixed files load the wrong
    code)."""
    for name in CONFLICTING_DISTRIBUTIONS:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        raise ImportError(
            f"lmcache-core cannot load: the distribution '{name}' {version} (LMCache) is installed "
            "too and ships the same 'lmcache' import package, so their files mix. Uninstall both "
            f"and reinstall ours: pip uninstall -y {name} lmcache-core, then install lmcache-core "
            "from the wheels built from an lmcache checkout (see its README's Install)"
        )


_refuse_conflicting_distribution()


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lmcache' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(__all__)
