# SPDX-License-Identifier: Apache-2.0
"""``vllm.general_plugins`` entry point: registers the connector name ``LMCacheConnector``.

vLLM calls :func:`register` in every process it starts (engine core, workers, API server);
registering twice is harmless. It also gives vLLM's in-tree ``LMCacheConnectorV1`` class the
class-level hooks it lacks (stats, Prometheus, CUDA-graph mode; :mod:`lmcache_vllm.in_tree`).
"""

from __future__ import annotations

import contextlib
import logging

__all__ = ["CONNECTOR_NAME", "register"]

logger = logging.getLogger(__name__)

CONNECTOR_NAME = "LMCacheConnector"
"""``kv_connector`` value that selects lmcache through this plugin."""


def register() -> None:
    """Register ``LMCacheConnector`` with vLLM's ``KVConnectorFactory`` (idempotent)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:  # vLLM without the v1 connector API: nothing to register with
        logger.warning("lmcache-vllm plugin: vLLM's KVConnectorFactory is not importable")
        return
    from lmcache_vllm.in_tree import patch_in_tree_class

    patch_in_tree_class()
    if CONNECTOR_NAME in KVConnectorFactory._registry:
        return
    # ValueError: registered meanwhile by another thread or import path
    with contextlib.suppress(ValueError):
        KVConnectorFactory.register_connector(
            CONNECTOR_NAME, "lmcache_vllm.connector", "LMCacheConnectorV1"
        )
