# SPDX-License-Identifier: Apache-2.0
"""Helpers that turn vLLM's configuration into the numbers lmcache needs.

Everything here is a pure function of configuration values (no vLLM import at module import
time), so it is unit-tested over made-up parallel configurations.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "calculate_local_rank_and_world_size",
    "get_vllm_torch_dev",
    "vllm_kv_dtype",
]


def get_vllm_torch_dev() -> tuple[str, Any]:
    """The device kind vLLM runs on here and its torch device module.

    Returns:
        ``(kind, module)`` where ``kind`` is ``"cuda"``, ``"xpu"`` or ``"cpu"`` (the suffix of
        the ``"vllm.<kind>"`` GPU connector key) and ``module`` is ``torch.cuda``, ``torch.xpu``
        or ``torch.cpu``. vLLM's own platform is asked first (a vLLM built for the CPU reports
        ``cpu`` even where a GPU is visible); without vLLM, torch decides.
    """
    kind: str | None = None
    try:
        from vllm.platforms import current_platform

        if current_platform.is_cuda_alike():
            kind = "cuda"
        elif current_platform.is_xpu():
            kind = "xpu"
        elif current_platform.is_cpu():
            kind = "cpu"
    except ImportError:
        kind = None
    if kind is None:
        kind = _available_device_type()
    return kind, getattr(torch, kind)


def _available_device_type() -> str:
    """``"cuda"`` or ``"xpu"`` when its device backend sees a device (an XPU backend only
    when its package is installed), else ``"cpu"``."""
    from lmcache.devices import get_backend

    for kind in ("cuda", "xpu"):
        try:
            if get_backend(kind).is_available():
                return kind
        except ValueError:  # no backend for it (device package not installed)
            continue
    return "cpu"


def calculate_local_rank_and_world_size(vllm_config: Any) -> tuple[int, int]:
    """This worker's device index on its node and the number of workers on the node.

    The rules (vLLM's placement):

    - One replica is ``tensor_parallel_size * pipeline_parallel_size`` workers with global rank
      ``parallel_config.rank = pp_rank * tp + tp_rank``.
    - Single node (``nnodes == 1``): every worker of every local data-parallel replica is on this
      node; replica ``data_parallel_rank_local`` starts at ``dp_local_rank * world_size``.
    - Multi-node: a replica spans ``nnodes_within_dp = nnodes // (dp_size // dp_size_local)``
      nodes, tensor parallel inside a node and pipeline stages across nodes, so each node holds
      ``world_size // nnodes_within_dp`` workers of the replica and the local rank is
      ``rank % that``. Local data-parallel replicas on the same node are offset as above.

    Args:
        vllm_config: A ``VllmConfig`` (or anything with a ``parallel_config`` carrying the
            same attribute names).

    Returns:
        ``(local_rank, local_world_size)``.

    Raises:
        ValueError: the numbers are inconsistent (a rank outside its world, nodes not divisible
            among data-parallel groups).
    """
    pc = vllm_config.parallel_config
    tp = int(pc.tensor_parallel_size)
    pp = int(getattr(pc, "pipeline_parallel_size", 1))
    world = tp * pp
    rank = int(getattr(pc, "rank", 0))
    if not 0 <= rank < world:
        raise ValueError(
            f"parallel_config.rank={rank} is outside the replica's world of {world} workers "
            f"(tensor_parallel_size={tp} x pipeline_parallel_size={pp})"
        )
    nnodes = int(getattr(pc, "nnodes", 1) or 1)
    dp_size = int(getattr(pc, "data_parallel_size", 1) or 1)
    dp_local_size = int(getattr(pc, "data_parallel_size_local", 1) or 1)
    dp_local_rank = getattr(pc, "data_parallel_rank_local", None)
    dp_local_rank = 0 if dp_local_rank is None else int(dp_local_rank)

    if nnodes == 1:
        per_node = world
    else:
        dp_node_groups = max(dp_size // dp_local_size, 1)
        if nnodes % dp_node_groups != 0:
            raise ValueError(
                f"nnodes={nnodes} must be divisible by the number of data-parallel node groups "
                f"({dp_node_groups} = data_parallel_size {dp_size} / data_parallel_size_local "
                f"{dp_local_size})"
            )
        nodes_per_replica = max(nnodes // dp_node_groups, 1)
        if world % nodes_per_replica != 0:
            raise ValueError(
                f"a replica of {world} workers cannot be spread evenly over "
                f"{nodes_per_replica} nodes"
            )
        per_node = world // nodes_per_replica
    local_rank = dp_local_rank * per_node + rank % per_node
    local_world_size = per_node * dp_local_size
    return local_rank, local_world_size


def vllm_kv_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of vLLM's KV cache for ``cache_config.cache_dtype``.

    Args:
        cache_dtype: ``"auto"`` (the model dtype), ``"bfloat16"``, ``"float16"``, ``"half"``,
            ``"float32"``, ``"fp8"``/``"fp8_e4m3"``, ``"fp8_e5m2"``.
        model_dtype: The model's dtype.

    Raises:
        ValueError: an unknown cache dtype.
    """
    if cache_dtype in ("auto", None):
        return model_dtype
    table = {
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
        "half": torch.float16,
        "float": torch.float32,
        "float32": torch.float32,
        "fp8": torch.float8_e4m3fn,
        "fp8_e4m3": torch.float8_e4m3fn,
        "fp8_e5m2": torch.float8_e5m2,
    }
    try:
        return table[cache_dtype]
    except KeyError:
        raise ValueError(
            f"Unknown vLLM cache_dtype {cache_dtype!r}; expected one of {sorted(table)} or 'auto'"
        ) from None
