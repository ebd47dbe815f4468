# SPDX-License-Identifier: Apache-2.0
"""The test-only ``sgl_kernel`` stand-in matches torch reference ops, and refuses the rest."""

from __future__ import annotations

import pytest
import torch

sgl_kernel = pytest.importorskip("sgl_kernel", reason="installed only in `nox -s sglang`")


def test_copy_all_layer_kv_cache_matches_index_copy() -> None:
    torch.manual_seed(0)
    buffers = [torch.randn(32, 2, 8).to(torch.bfloat16) for _ in range(3)]
    expected = [b.clone() for b in buffers]
    src = torch.tensor([1, 5, 9, 4])
    tgt = torch.tensor([4, 20, 21, 1])  # slot 4 and 1 are both source and target
    for e in expected:
        e[tgt] = e[src].clone()
    ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in buffers], dtype=torch.int64)
    sgl_kernel.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for b, e in zip(buffers, expected, strict=True):
        assert torch.equal(b, e)


def test_assign_req_to_token_pool_matches_slices() -> None:
    req_to_token = torch.zeros(4, 16, dtype=torch.int32)
    expected = req_to_token.clone()
    rows, starts, ends = torch.tensor([2, 0]), torch.tensor([3, 0]), torch.tensor([7, 2])
    out = torch.arange(100, 106, dtype=torch.int64)
    expected[2, 3:7] = out[:4].to(torch.int32)
    expected[0, 0:2] = out[4:6].to(torch.int32)
    sgl_kernel.assign_req_to_token_pool_cpu(rows, req_to_token, starts, ends, out, 16)
    assert torch.equal(req_to_token, expected)


def test_other_names_raise_a_clear_error() -> None:
    with pytest.raises(AttributeError, match="test-only"):
        _ = sgl_kernel.fused_add_rmsnorm
    with pytest.raises(ImportError):
        from sgl_kernel import fused_add_rmsnorm  # noqa: F401
    with pytest.raises(NotImplementedError, match="speculative decoding"):
        sgl_kernel.verify_tree_greedy_cpu()
