# SPDX-License-Identifier: Apache-2.0
"""lmcache's settings from vLLM's ``kv_transfer_config.kv_connector_extra_config``.

Both the adapter and vLLM's in-tree shim read them, so they live in a module of their own.
"""

from __future__ import annotations

from typing import Any

from lmcache.config import LMCacheConfig, load_config
from lmcache_vllm.vllm_types import VllmConfig

__all__ = ["UNPREFIXED_KEYS", "extra_config_overrides", "load_lmcache_config"]

#: Keys of ``kv_connector_extra_config`` that LMCache users write without the ``lmcache.``
#: prefix and that vLLM itself reads (its in-tree wrapper picks its CUDA-graph mode from
#: ``extra_config["use_layerwise"]``).
UNPREFIXED_KEYS = ("use_layerwise",)


def extra_config_overrides(extra: dict[str, Any] | None) -> dict[str, Any]:
    """lmcache overrides in ``kv_connector_extra_config``: keys prefixed ``lmcache.``, plus the
    unprefixed :data:`UNPREFIXED_KEYS` (the prefixed form wins when both are given)."""
    extra = dict(extra or {})
    out = {k: v for k, v in extra.items() if isinstance(k, str) and k.startswith("lmcache.")}
    for key in UNPREFIXED_KEYS:
        if key in extra and f"lmcache.{key}" not in out:
            out[f"lmcache.{key}"] = extra[key]
    return out


def load_lmcache_config(vllm_config: VllmConfig) -> LMCacheConfig:
    """lmcache config: defaults < ``LMCACHE_CONFIG_FILE`` < ``LMCACHE_*`` env <
    ``kv_connector_extra_config`` (see :func:`extra_config_overrides`)."""
    ktc = vllm_config.kv_transfer_config
    return load_config(
        overrides=extra_config_overrides(getattr(ktc, "kv_connector_extra_config", None))
    )
