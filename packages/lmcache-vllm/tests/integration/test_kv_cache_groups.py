# SPDX-License-Identifier: Apache-2.0
"""An engine whose KV cache has several groups (vLLM's hybrid KV cache manager, forced on with
``--no-disable-hybrid-kv-cache-manager``) is refused with the fix: lmcache moves every layer
through one block table, so it would load other blocks into the other groups' layers.

vLLM's CPU build cannot run the hybrid manager, so the connector is built here with vLLM's own
``KVCacheConfig`` objects, as vLLM builds it for a model with sliding-window layers.
"""

from __future__ import annotations

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

from lmcache_vllm.connector import LMCacheConnectorV1
from lmcache_vllm.testing import connector_vllm_config

BLOCK, HEADS, HEAD = 16, 2, 64


def _config(groups: list[KVCacheGroupSpec]) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


def _full(names: list[str]) -> KVCacheGroupSpec:
    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32
    )
    return KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec)


def _sliding(names: list[str]) -> KVCacheGroupSpec:
    spec = SlidingWindowSpec(
        block_size=BLOCK,
        num_kv_heads=HEADS,
        head_size=HEAD,
        dtype=torch.float32,
        sliding_window=128,
    )
    return KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec)


def _vllm_config(tmp_path):
    return connector_vllm_config(
        engine_id=f"groups-{tmp_path.name}",
        block_size=BLOCK,
        head_size=HEAD,
        extra_config={"lmcache.chunk_size": 64},
    )


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_several_kv_cache_groups_are_refused_with_the_fix(tmp_path, role):
    hybrid = _config(
        [_full(["model.layers.0.self_attn.attn"]), _sliding(["model.layers.1.self_attn.attn"])]
    )
    with pytest.raises(ValueError) as err:
        LMCacheConnectorV1(_vllm_config(tmp_path), role, hybrid)
    msg = str(err.value)
    assert "2 groups" in msg and "SlidingWindowSpec" in msg
    assert "--disable-hybrid-kv-cache-manager" in msg


def test_one_kv_cache_group_is_accepted(tmp_path):
    one = _config([_full([f"model.layers.{i}.self_attn.attn" for i in range(2)])])
    connector = LMCacheConnectorV1(_vllm_config(tmp_path), KVConnectorRole.SCHEDULER, one)
    assert connector._impl.scheduler is not None  # built, not refused
    connector.shutdown()
