# SPDX-License-Identifier: Apache-2.0
"""Public names are pinned; the GPU connector module never imports vLLM."""

from __future__ import annotations

import subprocess
import sys

import lmcache_vllm
from lmcache_vllm import gpu_connector, lookup_sockets, utils
from lmcache_vllm.scheduler import lookup_client
from lmcache_vllm.worker import lookup_server


def test_public_names():
    assert lmcache_vllm.__all__ == ["__version__"]
    assert sorted(gpu_connector.__all__) == [
        "KV_FORMATS",
        "VLLMPagedConnector",
        "select_cpu",
        "select_cuda",
    ]
    assert sorted(utils.__all__) == [
        "calculate_local_rank_and_world_size",
        "get_vllm_torch_dev",
        "vllm_kv_dtype",
    ]
    assert lookup_client.__all__ == ["LookupClient"]
    assert lookup_server.__all__ == ["LookupServer", "local_server"]
    assert "socket_path" in lookup_sockets.__all__


def test_gpu_connector_and_lookup_do_not_import_vllm():
    code = (
        "import sys, lmcache_vllm, lmcache_vllm.gpu_connector, lmcache_vllm.scheduler.lookup_client, "
        "lmcache_vllm.transfer.fused.transfer, lmcache_vllm.vllm_types, lmcache_vllm.utils; "
        "assert 'vllm' not in sys.modules, 'vllm imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
