# SPDX-License-Identifier: Apache-2.0
"""A KV cache of several groups (vLLM's hybrid KV cache manager), built with vLLM's own
``KVCacheConfig`` objects as vLLM builds them for a model with sliding-window layers.

Our connector class implements ``SupportsHMA``: it accepts several groups and keeps one stream
per group. vLLM's in-tree wrapper does not pass each group's blocks on, so with several groups
it is refused with the fix (select ``LMCacheConnector``). End to end on real vLLM:
test_hybrid_models.py.
"""

from __future__ import annotations

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorRole,
    SupportsHMA,
    supports_hma,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from lmcache_vllm.connector import LMCacheConnector, LMCacheConnectorV1
from lmcache_vllm.kv_groups import kv_groups
from lmcache_vllm.testing import connector_vllm_config
from lmcache_vllm.vllm_v1_adapter import LMCacheConnectorV1Impl
from lmcache_vllm.worker.grouped import GroupedWorkerSide

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


HYBRID = [_full(["model.layers.0.self_attn.attn"]), _sliding(["model.layers.1.self_attn.attn"])]


def test_our_class_supports_vllms_hybrid_manager():
    assert supports_hma(LMCacheConnectorV1) and issubclass(LMCacheConnector, SupportsHMA)


def test_vllm_specs_are_read_as_groups():
    mamba = MambaSpec(
        block_size=1024, shapes=((3, 8), (2, 4, 4)), dtypes=(torch.float32, torch.float32)
    )
    groups = kv_groups(_config([*HYBRID, KVCacheGroupSpec(["model.layers.2.mixer"], mamba)]), BLOCK)
    assert [(g.kind, g.window, g.block_size) for g in groups] == [
        ("full", 0, BLOCK),
        ("sliding", 128, BLOCK),
        ("mamba", 0, 1024),
    ]


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_several_kv_cache_groups_are_accepted_by_our_class(tmp_path, role):
    connector = LMCacheConnectorV1(_vllm_config(tmp_path), role, _config(HYBRID))
    try:
        impl = connector._impl
        if role == KVConnectorRole.SCHEDULER:
            assert impl.scheduler.multi_group and not impl.scheduler.inert
        else:
            assert isinstance(impl.worker, GroupedWorkerSide) and len(impl.worker.streams) == 2
    finally:
        connector.shutdown()


def test_several_kv_cache_groups_are_refused_for_the_in_tree_wrapper(tmp_path):
    class InTreeWrapper:  # vLLM's in-tree LMCacheConnectorV1: not SupportsHMA
        _kv_cache_config = _config(HYBRID)

    with pytest.raises(ValueError) as err:
        LMCacheConnectorV1Impl(_vllm_config(tmp_path), KVConnectorRole.SCHEDULER, InTreeWrapper())
    msg = str(err.value)
    assert "2 groups" in msg and "SlidingWindowSpec" in msg
    assert '"kv_connector":"LMCacheConnector"' in msg and "--disable-hybrid-kv-cache-manager" in msg


def test_one_kv_cache_group_is_accepted(tmp_path):
    one = _config([_full([f"model.layers.{i}.self_attn.attn" for i in range(2)])])
    connector = LMCacheConnectorV1(_vllm_config(tmp_path), KVConnectorRole.SCHEDULER, one)
    assert connector._impl.scheduler is not None and not connector._impl.scheduler.multi_group
    connector.shutdown()
