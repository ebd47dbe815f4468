# SPDX-License-Identifier: Apache-2.0
"""calculate_local_rank_and_world_size / get_vllm_torch_dev over made-up configurations."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from lmcache_vllm.utils import (
    calculate_local_rank_and_world_size,
    get_vllm_torch_dev,
    vllm_kv_dtype,
)


def cfg(tp=1, pp=1, rank=0, nnodes=1, dp=1, dp_local=1, dp_rank_local=None):
    return SimpleNamespace(
        parallel_config=SimpleNamespace(
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            rank=rank,
            nnodes=nnodes,
            data_parallel_size=dp,
            data_parallel_size_local=dp_local,
            data_parallel_rank_local=dp_rank_local,
        )
    )


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (cfg(), (0, 1)),
        (cfg(tp=4, rank=3), (3, 4)),
        (cfg(tp=2, pp=2, rank=3), (3, 4)),  # single node: every stage is local
        # two nodes, TP inside a node, PP across nodes: stage 1 lives on node 1
        (cfg(tp=4, pp=2, rank=5, nnodes=2), (1, 4)),
        (cfg(tp=4, pp=2, rank=2, nnodes=2), (2, 4)),
        # two local DP replicas of TP=2 on one node: replica 1 starts at device 2
        (cfg(tp=2, rank=1, dp=2, dp_local=2, dp_rank_local=1), (3, 4)),
        (cfg(tp=2, rank=0, dp=2, dp_local=2, dp_rank_local=0), (0, 4)),
        # four nodes, DP=2 with one replica per 2 nodes (dp_local=1), TP=8 x PP=2
        (cfg(tp=8, pp=2, rank=9, nnodes=4, dp=2, dp_local=1, dp_rank_local=0), (1, 8)),
    ],
)
def test_local_rank_and_world_size(config, expected):
    assert calculate_local_rank_and_world_size(config) == expected


def test_rank_outside_world_is_rejected():
    with pytest.raises(ValueError, match="outside the replica"):
        calculate_local_rank_and_world_size(cfg(tp=2, rank=2))


def test_nodes_not_divisible_by_dp_groups_is_rejected():
    with pytest.raises(ValueError, match="divisible"):
        calculate_local_rank_and_world_size(cfg(tp=2, nnodes=3, dp=2, dp_local=1))


def _torch_kind() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu"
    return "cpu"


def test_torch_dev_without_vllm_follows_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm.platforms", None)  # importing it raises ImportError
    kind, module = get_vllm_torch_dev()
    assert kind == _torch_kind()
    assert module is getattr(torch, kind)


@pytest.mark.parametrize("platform", ["cpu", "cuda", "xpu"])
def test_torch_dev_asks_vllms_platform_first(monkeypatch, platform):
    """vLLM's platform wins over torch (a vLLM built for the CPU says cpu next to a GPU)."""
    current = SimpleNamespace(
        is_cuda_alike=lambda: platform == "cuda",
        is_xpu=lambda: platform == "xpu",
        is_cpu=lambda: platform == "cpu",
    )
    monkeypatch.setitem(sys.modules, "vllm.platforms", SimpleNamespace(current_platform=current))
    kind, module = get_vllm_torch_dev()
    assert kind == platform
    assert module is getattr(torch, platform)


def test_kv_dtype():
    assert vllm_kv_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert vllm_kv_dtype("fp8_e5m2", torch.bfloat16) is torch.float8_e5m2
    with pytest.raises(ValueError, match="Unknown vLLM cache_dtype"):
        vllm_kv_dtype("int3", torch.float16)
