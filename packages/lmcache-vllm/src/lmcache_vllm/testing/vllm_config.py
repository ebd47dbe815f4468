# SPDX-License-Identifier: Apache-2.0
"""A stand-in for vLLM's ``VllmConfig`` with the fields lmcache's connector sides read.

For driving :class:`~lmcache_vllm.scheduler.side.SchedulerSide` and
:class:`~lmcache_vllm.worker.side.WorkerSide` directly (unit tests, benchmarks) without starting
vLLM; the end-to-end tests use real vLLM.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

__all__ = ["connector_vllm_config"]


def connector_vllm_config(
    *,
    engine_id: str,
    block_size: int,
    head_size: int,
    extra_config: dict[str, Any],
    model: str = "test/model",
    dtype: str = "float32",
    kv_role: str = "kv_both",
) -> Any:
    """A single-rank ``VllmConfig`` stand-in (KV cache dtype ``auto``, no multimodal)."""
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_role=kv_role, engine_id=engine_id, kv_connector_extra_config=dict(extra_config)
        ),
        instance_id="stand-in",
        cache_config=SimpleNamespace(block_size=block_size, cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, rank=0),
        model_config=SimpleNamespace(
            model=model, use_mla=False, get_head_size=lambda: head_size, dtype=dtype
        ),
        compilation_config=SimpleNamespace(static_forward_context={}),
    )
