# SPDX-License-Identifier: Apache-2.0
"""Public names and entry points are pinned; the modules outside SGLang's hooks never import it."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import distribution

import lmcache
import lmcache_sglang
from lmcache_sglang import gpu_connector, hook_config, kv_pools, mp_connector, page_store


def test_public_names() -> None:
    assert lmcache_sglang.__all__ == ["__version__"]
    assert lmcache_sglang.__version__ == lmcache.__version__
    assert sorted(gpu_connector.__all__) == [
        "KV_LAYOUTS",
        "SGLangKVConnector",
        "select_cpu",
        "select_cuda",
    ]
    assert sorted(page_store.__all__) == ["HeldPages", "PAGE_KEY_FORMAT", "PageStore"]
    assert "UnifiedLMCacheMPConnector" in mp_connector.__all__
    assert "build_metadata" in kv_pools.__all__ and "hook_config" in hook_config.__all__


def test_entry_points() -> None:
    eps = {(e.group, e.name): e.value for e in distribution("lmcache-sglang").entry_points}
    assert eps == {
        ("lmcache.gpu_connectors", "sglang.cpu"): "lmcache_sglang.gpu_connector:select_cpu",
        ("lmcache.gpu_connectors", "sglang.cuda"): "lmcache_sglang.gpu_connector:select_cuda",
    }


def test_modules_outside_the_hooks_do_not_import_sglang() -> None:
    code = (
        "import sys, lmcache_sglang, lmcache_sglang.gpu_connector, lmcache_sglang.page_store, "
        "lmcache_sglang.kv_pools, lmcache_sglang.hook_config, lmcache_sglang.mp_connector, "
        "lmcache_sglang.mp_metadata, lmcache_sglang.legacy_adapter, lmcache_sglang.testing; "
        "import lmcache.integration.sglang.lmcache_mp_metadata as m; m.LMCacheExternalFlow; "
        "assert 'sglang' not in sys.modules, 'sglang imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_core_shims_forward_to_lmcache_sglang() -> None:
    from lmcache.integration.sglang.lmcache_mp_metadata import (
        LMCacheExternalFlow,
        LMCachePendingStore,
    )
    from lmcache.integration.sglang.unified_lmcache_mp_connector import (
        UnifiedLMCacheMPConnector,
    )
    from lmcache_sglang import mp_connector as impl
    from lmcache_sglang import mp_metadata

    assert UnifiedLMCacheMPConnector is impl.UnifiedLMCacheMPConnector
    assert LMCacheExternalFlow is mp_metadata.LMCacheExternalFlow
    assert LMCachePendingStore is mp_metadata.LMCachePendingStore


def test_core_shims_of_sglang_0_5_17_forward_to_lmcache_sglang() -> None:
    from lmcache.integration.sglang.multi_process_adapter import LMCacheMPConnector
    from lmcache.integration.sglang.sglang_adapter import (
        LMCacheLayerwiseConnector,
        LoadMetadata,
        StoreMetadata,
    )
    from lmcache.integration.sglang.utils import lmcache_get_config
    from lmcache_sglang import legacy_adapter as impl

    assert LMCacheMPConnector is impl.LMCacheMPConnector
    assert LMCacheLayerwiseConnector is impl.LMCacheLayerwiseConnector
    assert (LoadMetadata, StoreMetadata) == (impl.LoadMetadata, impl.StoreMetadata)
    assert lmcache_get_config is impl.lmcache_get_config


def test_core_shim_without_the_adapter_names_the_install() -> None:
    """With lmcache_sglang absent, SGLang's import fails with the install command."""
    code = (
        "import sys; sys.modules['lmcache_sglang'] = None\n"
        "try:\n"
        "    from lmcache.integration.sglang.unified_lmcache_mp_connector import "
        "UnifiedLMCacheMPConnector\n"
        "except ImportError as exc:\n"
        "    assert 'pip install lmcache-sglang' in str(exc), exc\n"
        "else:\n"
        "    raise SystemExit('no ImportError')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
