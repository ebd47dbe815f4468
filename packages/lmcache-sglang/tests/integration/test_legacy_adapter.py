# SPDX-License-Identifier: Apache-2.0
"""SGLang 0.5.17-0.5.19's ``--enable-lmcache`` connectors, driven with real SGLang pools.

Only SGLang 0.5.23 installs here, so ``LMCRadixCache`` itself cannot run; these tests replay its
calls (``lmc_radix_cache.py`` of 0.5.17: ``store_kv`` at request end; MP mode ``lookup_kv`` then
``retrieve_kv`` with ``offset``/``prefix_pad``; IP mode ``start_load_kv`` then the KV pool's
per-layer ``load_kv_layerwise``) through the core shim paths SGLang imports, on real
``MHATokenToKVPool(device="cpu")`` buffers, and compare the loaded slots with the stored ones.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from lmcache.integration.sglang.multi_process_adapter import LMCacheMPConnector
from lmcache.integration.sglang.sglang_adapter import (
    LMCacheLayerwiseConnector,
    LoadMetadata,
    StoreMetadata,
)
from lmcache.integration.sglang.utils import lmcache_get_config
from lmcache.tiers import reset_process_cpu_tiers
from lmcache_sglang.testing import make_prompt

CHUNK = 64
MODEL = "/models/tiny-llama"
TOKENS = make_prompt(300, 11)  # 4 full chunks stored (256 tokens), a 44-token tail not


@pytest.fixture(autouse=True)
def _fresh_tier() -> Iterator[None]:
    reset_process_cpu_tiers()
    yield
    reset_process_cpu_tiers()


@pytest.fixture
def config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in list(os.environ):
        if name.startswith("LMCACHE_"):
            monkeypatch.delenv(name)
    path = tmp_path / "lmcache.yaml"
    path.write_text(f"mp_host: 127.0.0.1\nmp_port: 5556\nchunk_size: {CHUNK}\n")
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(path))  # the MP connector's fallback
    return path


def _pool(seed: int) -> Any:
    pool = MHATokenToKVPool(
        1024,
        1,
        torch.bfloat16,
        head_num=2,
        head_dim=64,
        layer_num=3,
        device="cpu",
        enable_memory_saver=False,
        start_layer=0,
        end_layer=3,
    )
    gen = torch.Generator().manual_seed(seed)
    for buf in (*pool.k_buffer, *pool.v_buffer):
        buf.copy_(torch.randn(buf.shape, generator=gen).to(buf.dtype))
    return pool


def _kwargs(pool: Any, model: str = MODEL) -> dict[str, Any]:
    return {
        "sgl_config": SimpleNamespace(model_path=model, num_hidden_layers=3),
        "tp_size": 1,
        "rank": 0,
        "k_pool": pool.k_buffer,
        "v_pool": pool.v_buffer,
        "tp_group": None,
    }


def _kv(pool: Any, slots: torch.Tensor) -> torch.Tensor:
    return torch.stack(
        [
            torch.stack([k[slots], v[slots]])
            for k, v in zip(pool.k_buffer, pool.v_buffer, strict=True)
        ]
    )


def _store(config_file: Path) -> tuple[Any, torch.Tensor]:
    src = _pool(1)
    slots = torch.randperm(1000)[:300] + 1
    conn = LMCacheLayerwiseConnector(config_file=str(config_file), **_kwargs(src))
    stored = conn.store_kv(StoreMetadata(None, TOKENS, slots, 0, "store"))
    assert stored == 4 * CHUNK
    return src, slots


def _load_slots(value_numel: int, uncached: int) -> tuple[torch.Tensor, torch.Tensor]:
    new = torch.randperm(1000)[:uncached] + 1
    mapping = torch.cat([torch.full((value_numel,), -1, dtype=torch.int64), new])
    return new, mapping


def test_lmcache_get_config_reads_our_yaml_and_the_daemon_address(config_file: Path) -> None:
    cfg = lmcache_get_config(str(config_file))
    assert (cfg.chunk_size, cfg.mp_host, cfg.mp_port) == (CHUNK, "127.0.0.1", 5556)


def test_mp_lookup_then_retrieve(config_file: Path) -> None:
    src, src_slots = _store(config_file)
    dst = _pool(2)
    before = [t.clone() for t in (*dst.k_buffer, *dst.v_buffer)]
    conn = LMCacheMPConnector(page_size=1, host="127.0.0.1", port=5556, **_kwargs(dst))
    assert conn.chunk_size() == CHUNK
    value_numel = 70  # SGLang's radix holds 70 tokens
    matched = conn.lookup_kv(TOKENS, "r1")
    assert matched == 4 * CHUNK
    prefix_pad = value_numel % CHUNK
    new, mapping = _load_slots(value_numel, matched - value_numel)
    n = conn.retrieve_kv(LoadMetadata(TOKENS, mapping, value_numel - prefix_pad, prefix_pad, "r1"))
    assert n - prefix_pad == matched - value_numel  # what LMCRadixCache inserts
    assert torch.equal(_kv(dst, new), _kv(src, src_slots[value_numel:matched]))
    untouched = torch.ones(1025, dtype=torch.bool)
    untouched[new] = False
    for t, b in zip((*dst.k_buffer, *dst.v_buffer), before, strict=True):
        assert torch.equal(t[untouched], b[untouched])
    conn.end_session("r1")


def _with_kernels(conn: Any) -> Any:
    """``conn`` with its connector on the kernel path (as on CUDA; here the ops' CPU reference),
    so chunks carry device sums and loads verify them."""
    gpu = conn.engine.gpu_connector
    gpu.kernels = gpu.kernel_transfer()
    conn.engine.set_gpu_connector(gpu)
    assert gpu.verifies_checksums
    return conn


def test_mp_retrieve_counts_only_the_prefix_before_a_bad_chunk(config_file: Path) -> None:
    """A chunk that fails its checksum at load is a hole in what landed: ``retrieve_kv`` reports
    the tokens before it, never the chunks after it (LMCRadixCache takes a prefix)."""
    src = _pool(1)
    src_slots = torch.randperm(1000)[:300] + 1
    store = _with_kernels(LMCacheLayerwiseConnector(config_file=str(config_file), **_kwargs(src)))
    assert store.store_kv(StoreMetadata(None, TOKENS, src_slots, 0, "store")) == 4 * CHUNK
    dst = _pool(2)
    before = [t.clone() for t in (*dst.k_buffer, *dst.v_buffer)]
    conn = _with_kernels(
        LMCacheMPConnector(page_size=1, host="127.0.0.1", port=5556, **_kwargs(dst))
    )
    assert conn.lookup_kv(TOKENS, "r1") == 4 * CHUNK
    conn._held["r1"].tensors()[2].reshape(-1).view(torch.uint8)[9] ^= 0x10  # chunk 2, after lookup
    new, mapping = _load_slots(CHUNK, 3 * CHUNK)  # SGLang holds chunk 0
    n = conn.retrieve_kv(LoadMetadata(TOKENS, mapping, CHUNK, 0, "r1"))
    assert n == CHUNK  # chunk 1; chunk 3 landed too, but after the hole
    assert torch.equal(_kv(dst, new[:CHUNK]), _kv(src, src_slots[CHUNK : 2 * CHUNK]))
    bad = new[CHUNK : 2 * CHUNK]
    for t, b in zip((*dst.k_buffer, *dst.v_buffer), before, strict=True):
        assert torch.equal(t[bad], b[bad])  # the bad chunk never reached the pool
    assert conn.engine.metrics.value("checksum_failures") == 1
    conn.end_session("r1")


def test_ip_layerwise_load_through_the_per_layer_hook(config_file: Path) -> None:
    src, src_slots = _store(config_file)
    dst = _pool(3)
    conn = LMCacheLayerwiseConnector(config_file=str(config_file), **_kwargs(dst))
    value_numel = 100
    matched = conn.lookup_kv(TOKENS)
    new, mapping = _load_slots(value_numel, matched - value_numel)
    prefix_pad = value_numel % CHUNK
    n = conn.start_load_kv(LoadMetadata(TOKENS, mapping, value_numel - prefix_pad))
    assert n - prefix_pad == matched - value_numel
    expected = _kv(src, src_slots[value_numel:matched])
    for layer in range(3):  # the KV pool calls the hook per layer, sometimes twice (K and V)
        conn.load_kv_layerwise(layer)
        conn.load_kv_layerwise(layer)
        assert torch.equal(_kv(dst, new)[layer], expected[layer])


def test_other_model_misses(config_file: Path) -> None:
    _store(config_file)
    other = LMCacheMPConnector(page_size=1, **_kwargs(_pool(4), model="/models/other"))
    assert other.lookup_kv(TOKENS, "r") == 0
    other.release_pending("r")
