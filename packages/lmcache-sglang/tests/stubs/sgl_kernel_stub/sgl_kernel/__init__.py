# SPDX-License-Identifier: Apache-2.0
"""Test-only stand-in for ``sgl_kernel`` on the CPU.

``sglang-kernel`` has no CPU build on PyPI, yet SGLang 0.5.23's CPU engine imports
two functions from it at load: ``copy_all_layer_kv_cache_cpu``
(``sglang.kernels.ops.kvcache.cache_move``) and ``assign_req_to_token_pool_cpu``
(``sglang.srt.mem_cache.allocation``). This package implements those in plain torch, following
SGLang's own Triton kernels, and raises a clear error for every other name, so a test never
silently runs a fake kernel. It is installed only into the
``nox -s sglang`` test venv.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

__version__ = "0.0.0+lmcache.test.stub"
__all__ = ["assign_req_to_token_pool_cpu", "copy_all_layer_kv_cache_cpu"]


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """Copy rows ``src_loc -> tgt_loc`` inside every buffer (what SGLang's CPU kernel does).

    Args:
        data_ptrs: ``[num_buffers]`` integer tensor, the base address of each KV buffer.
        strides: ``[num_buffers]`` integer tensor, bytes per row (slot) of each buffer.
        tgt_loc: ``[num_locs]`` destination slot indices.
        src_loc: ``[num_locs]`` source slot indices (same length as ``tgt_loc``).
    """
    if tgt_loc.numel() != src_loc.numel():
        raise ValueError(
            f"copy_all_layer_kv_cache_cpu: tgt_loc has {tgt_loc.numel()} slots but src_loc has "
            f"{src_loc.numel()}; expected the same count"
        )
    src = [int(s) for s in src_loc.tolist()]
    tgt = [int(t) for t in tgt_loc.tolist()]
    # Read every source row first: a slot may be both a source and a target in one call.
    for base, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        rows = [ctypes.string_at(int(base) + s * int(stride), int(stride)) for s in src]
        for t, row in zip(tgt, rows, strict=True):
            ctypes.memmove(int(base) + t * int(stride), row, int(stride))


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """``req_to_token[req_pool_indices[i], start[i]:end[i]] = out_cache_loc[...]``, packed.

    Request ``i``'s slots are the next ``end[i] - start[i]`` entries of ``out_cache_loc`` (as in
    SGLang's Triton ``assign_req_to_token_pool``).
    """
    if req_to_token.shape[1] != pool_len:
        raise ValueError(
            f"assign_req_to_token_pool_cpu: pool_len={pool_len} but req_to_token has "
            f"{req_to_token.shape[1]} columns"
        )
    offset = 0
    for row, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        n = int(end) - int(start)
        if n <= 0:
            continue
        req_to_token[int(row), int(start) : int(end)] = out_cache_loc[offset : offset + n].to(
            req_to_token.dtype
        )
        offset += n


#: Names SGLang 0.5.23's CPU engine imports at module load but calls only for features the tests
#: do not use (speculative decoding). They import; calling one raises ``NotImplementedError``.
IMPORTED_NOT_IMPLEMENTED: tuple[str, ...] = (
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "build_tree_kernel_efficient_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "rotate_input_ids_cpu",
    "verify_tree_greedy_cpu",
)


def _not_implemented(name: str) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"sgl_kernel.{name} was called, but lmcache's test-only sgl_kernel stand-in only "
            "lets SGLang import it (speculative decoding is not run in lmcache's CPU tests). "
            "Use the real sglang-kernel build (CUDA) for this feature."
        )

    call.__name__ = name
    return call


def __getattr__(name: str) -> Any:
    if name in IMPORTED_NOT_IMPLEMENTED:
        return _not_implemented(name)
    raise AttributeError(
        f"sgl_kernel.{name} is not available: this is lmcache's test-only CPU stand-in for "
        "sgl_kernel, which implements only the functions SGLang's CPU engine imports at load "
        f"({', '.join(__all__)}). A code path that needs any other sgl_kernel op "
        "needs the real sglang-kernel build (CUDA)."
    )
