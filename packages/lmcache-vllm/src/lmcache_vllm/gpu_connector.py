# SPDX-License-Identifier: Apache-2.0
"""The ``lmcache.gpu_connectors`` entry points of lmcache-vllm: ``vllm.cpu`` and ``vllm.cuda``.

Each selector returns :class:`~lmcache_vllm.transfer.paged_connector.VLLMPagedConnector` for
its device, or ``None`` for an engine or device that is not its own.
The connector and its transfer strategies live in :mod:`lmcache_vllm.transfer`.
This module keeps the import path that the entry points and lmcache-xpu name.
It never imports vLLM.
"""

from __future__ import annotations

from lmcache.gpu_connector.layer_range import engine_selector
from lmcache_vllm.transfer.kv_formats import KV_FORMATS
from lmcache_vllm.transfer.paged_connector import VLLMPagedConnector

__all__ = [
    "KV_FORMATS",
    "VLLMPagedConnector",
    "select_cpu",
    "select_cuda",
]

select_cpu = engine_selector("vllm", "cpu", VLLMPagedConnector)
select_cuda = engine_selector("vllm", "cuda", VLLMPagedConnector)
