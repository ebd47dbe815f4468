# SPDX-License-Identifier: Apache-2.0
"""Import hygiene: ``import lmcache`` pulls in no engine; public names are pinned."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import lmcache.gpu_connector
import lmcache.gpu_connector.gpu_ops
import lmcache.gpu_connector.reference
import lmcache.gpu_connector.registry
import lmcache.gpu_connector.utils
import lmcache.testing
import lmcache.tiers
from lmcache._install_hint import adapter_install_command

EXPECTED_GPU_CONNECTOR_ALL = [
    "ChunkTransfer",
    "CreateGPUConnector",
    "EngineInfo",
    "GPUConnectorInterface",
    "KVLayoutError",
    "SupportsLayerwise",
    "TransferSpec",
    "register_gpu_connector",
    "registered_gpu_connectors",
    "supports_layerwise",
]


def _fresh_interpreter(code: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_import_lmcache_leaves_engines_out() -> None:
    result = _fresh_interpreter(
        "import json, sys\n"
        "import lmcache, lmcache.gpu_connector, lmcache.gpu_connector.registry\n"
        "from lmcache.gpu_connector import CreateGPUConnector, registered_gpu_connectors\n"
        "registered_gpu_connectors()\n"
        "engines = sorted(m for m in sys.modules if m.split('.')[0] in\n"
        "    ('vllm', 'sglang', 'lmcache_vllm', 'lmcache_sglang', 'pytest'))\n"
        "print(json.dumps({'engines': engines}))\n"
    )
    assert result == {"engines": []}


def test_import_gpu_connector_is_lazy() -> None:
    result = _fresh_interpreter(
        "import json, sys\n"
        "import lmcache.gpu_connector\n"
        "print(json.dumps({'registry': 'lmcache.gpu_connector.registry' in sys.modules}))\n"
    )
    assert result == {"registry": False}


def test_gpu_connector_all_pinned() -> None:
    assert lmcache.gpu_connector.__all__ == EXPECTED_GPU_CONNECTOR_ALL
    for name in EXPECTED_GPU_CONNECTOR_ALL:
        assert getattr(lmcache.gpu_connector, name) is not None
    assert set(EXPECTED_GPU_CONNECTOR_ALL) <= set(dir(lmcache.gpu_connector))


def test_submodule_all_pinned() -> None:
    assert sorted(lmcache.gpu_connector.registry.__all__) == sorted(
        [
            "ENTRY_POINT_GROUP",
            "ENGINE_EXTRA",
            "PLUGINS_ENV",
            "PLUGIN_AUTOLOAD_ENV",
            "ConnectorSelector",
            "CreateGPUConnector",
            "register_gpu_connector",
            "registered_gpu_connectors",
        ]
    )
    assert lmcache.gpu_connector.registry.ENTRY_POINT_GROUP == "lmcache.gpu_connectors"
    assert sorted(lmcache.gpu_connector.gpu_ops.__all__) == sorted(
        [
            "DEVICE_ENTRY_POINT_GROUP",
            "HostDeviceOps",
            "get_device_ops",
            "lmcache_memcpy_async_d2h",
            "lmcache_memcpy_async_h2d",
            "register_device_ops",
            "registered_device_types",
        ]
    )
    assert sorted(lmcache.gpu_connector.reference.__all__) == [
        "gather_paged",
        "pack_kv",
        "scatter_paged",
        "unpack_kv",
    ]
    assert sorted(lmcache.gpu_connector.utils.__all__) == [
        "current_stream_for",
        "get_device_type",
        "is_pinned_memory_available",
        "need_gpu_interm_buffer",
    ]
    assert lmcache.testing.__all__ == [
        "GPUConnectorConformance",
        "PagedCPUConnector",
        "RedisClusterServer",
        "RedisSentinel",
        "RedisServer",
        "build_tiny_llama",
        "make_prompt",
        "redis_server_path",
    ]
    assert sorted(lmcache.tiers.__all__) == [
        "CHECKSUM_SLICE_BYTES",
        "CPUTier",
        "LowerTier",
        "ReadRequest",
        "process_cpu_tier",
        "process_lower_tiers",
        "reset_process_cpu_tiers",
        "tensor_checksum",
    ]


SHIMS = {
    "lmcache.integration.sglang.lmcache_mp_metadata": [
        "LMCacheExternalFlow",
        "LMCachePendingStore",
    ],
    "lmcache.integration.sglang.multi_process_adapter": ["LMCacheMPConnector"],
    "lmcache.integration.sglang.sglang_adapter": [
        "LMCacheLayerwiseConnector",
        "LoadMetadata",
        "StoreMetadata",
    ],
    "lmcache.integration.sglang.unified_lmcache_mp_connector": ["UnifiedLMCacheMPConnector"],
    "lmcache.integration.sglang.utils": ["lmcache_get_config"],
    "lmcache.integration.vllm.vllm_v1_adapter": ["LMCacheConnectorV1Impl"],
}


def test_integration_shims_without_their_adapter() -> None:
    """Each engine-facing shim lists its names, imports nothing, and names the install command
    when its adapter package is missing."""
    result = _fresh_interpreter(
        "import importlib, json, sys\n"
        "sys.modules['lmcache_vllm'] = sys.modules['lmcache_sglang'] = None\n"
        f"shims = {SHIMS!r}\n"
        "out = {}\n"
        "for name, names in shims.items():\n"
        "    m = importlib.import_module(name)\n"
        "    row = [m.__all__ == names, dir(m) == sorted(names)]\n"
        "    try:\n"
        "        getattr(m, names[0])\n"
        "    except ImportError as exc:\n"
        "        row.append(str(exc).split(' (could not import')[0])\n"
        "    try:\n"
        "        m.__path__\n"
        "    except AttributeError:\n"
        "        row.append('no dunder')\n"
        "    out[name] = row\n"
        "print(json.dumps(out))\n"
    )
    for name in SHIMS:
        engine = name.split(".")[2]
        hint = (
            f"lmcache.integration.{engine} requires the lmcache-{engine} adapter: "
            f"{adapter_install_command(engine)}"
        )
        assert result[name] == [True, True, hint, "no dunder"], name


def test_tiny_model_imports_without_transformers() -> None:
    result = _fresh_interpreter(
        "import json, sys\n"
        "from lmcache.testing import build_tiny_llama, make_prompt\n"
        "from lmcache.testing.tiny_model import FIRST_WORD_ID\n"
        "prompt = make_prompt(64, 3, vocab_size=50)\n"
        "print(json.dumps({'transformers': 'transformers' in sys.modules,\n"
        "    'ok': all(FIRST_WORD_ID <= t < 50 for t in prompt) and prompt == make_prompt(64, 3,\n"
        "    vocab_size=50) and len(prompt) == 64}))\n"
    )
    assert result == {"transformers": False, "ok": True}


def test_unknown_attribute_is_attribute_error() -> None:
    try:
        lmcache.gpu_connector.NoSuchThing  # noqa: B018
    except AttributeError as exc:
        assert "NoSuchThing" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def test_log_level_from_environment() -> None:
    code = (
        "import logging, lmcache; "
        "print(logging.getLogger('lmcache').level, logging.getLogger('lmcache_vllm').level)"
    )
    env = {**os.environ, "LMCACHE_LOG_LEVEL": "debug"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(logging.DEBUG), str(logging.DEBUG)]
    env["LMCACHE_LOG_LEVEL"] = "loud"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and "is not a logging level" in out.stderr
    assert out.stdout.split() == ["0", "0"]


def test_top_level_lazy_names() -> None:
    import lmcache.cache_engine
    import lmcache.engine.held_hit

    assert "HeldHit" in lmcache.__all__ and "HeldHit" in dir(lmcache)
    assert lmcache.HeldHit is lmcache.engine.held_hit.HeldHit is lmcache.cache_engine.HeldHit
    assert lmcache.LMCacheEngine is lmcache.cache_engine.LMCacheEngine
    assert sorted(lmcache.cache_engine.__all__) == [
        "ExtraKeys",
        "HeldHit",
        "LMCacheEngine",
        "LayerwiseRetrieve",
        "LayerwiseStore",
        "PlannedStore",
        "StagedStore",
        "StoreBatch",
        "Tokens",
    ]


def test_import_refuses_lmcaches_own_distribution(tmp_path: Path) -> None:
    """With LMCache's `lmcache` distribution installed (its metadata on the path), `import
    lmcache` fails with one line naming it and the fix; without it, the import works."""
    site = tmp_path / "site"
    dist = site / "lmcache-0.3.9.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: lmcache\nVersion: 0.3.9\n")
    code = "import lmcache"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *sys.path])}
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert bad.returncode != 0
    last = bad.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "ImportError: lmcache-core cannot load: the distribution 'lmcache' 0.3.9"
    )
    assert "pip uninstall -y lmcache lmcache-core" in last
    env["PYTHONPATH"] = os.pathsep.join(sys.path)  # control: the same interpreter without it
    good = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert good.returncode == 0, good.stderr
