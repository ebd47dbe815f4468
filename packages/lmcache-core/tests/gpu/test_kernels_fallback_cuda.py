# SPDX-License-Identifier: Apache-2.0
"""The fallbacks of the CUDA kernels on a CUDA device, bit for bit: the Triton port (compiled by
Triton for this GPU) and the vectorized torch ops against the pure-torch reference, and against
the compiled ops when they load. Every layout and storage dtype, skipped and out-of-range slots,
uneven and empty chunks, layer ranges, rows that are not whole words. Both run under
``torch.cuda.set_sync_debug_mode("error")``: a host wait inside them fails the test. Needs a
CUDA GPU (skips with a reason otherwise); the Triton cases need ``triton``.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
from types import ModuleType
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from lmcache import gpu_ops  # noqa: E402
from lmcache.gpu_ops import _cext, _dispatch, _ref, _vectorized  # noqa: E402
from lmcache.gpu_ops.testing import (  # noqa: E402
    DTYPES,
    LAYOUTS,
    RandomKV,
    bits,
    poison_,
    random_chunks,
    random_kv,
    random_slots,
)

DEV = torch.device("cuda")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
IMPLS = [
    "vectorized",
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("triton") is None or INTERPRETED,
            reason="needs triton, not in interpreter mode (run tests/gpu apart from tests/unit)",
        ),
    ),
]


def _impl(name: str) -> ModuleType:
    if name == "vectorized":
        return _vectorized
    from lmcache.gpu_ops import _triton

    return _triton


def _case(layout: str, dtype: torch.dtype, seed: int) -> tuple[RandomKV, torch.Tensor, list[int]]:
    g = torch.Generator().manual_seed(seed)
    r = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    mla = layout.endswith("mla")
    rk = random_kv(
        layout,
        dtype,
        DEV,
        num_layers=r(1, 5),
        num_pages=r(8, 40),
        page_size=[1, 4, 16][r(0, 2)],
        heads=1 if mla else r(1, 8),
        head_size=[3, 64, 80, 128, 576][r(0, 4)] if mla else [3, 8, 64, 96, 128][r(0, 4)],
        generator=g,
    )
    cap = rk.kv.num_pages * rk.kv.page_size
    slots = random_slots(r(1, min(cap, 600)), cap, generator=g)
    slots[r(0, slots.numel() - 1)] = cap + r(0, 3)
    offsets = random_chunks(slots.numel(), generator=g)
    at = r(0, len(offsets) - 1)
    return rk, slots.to(DEV), [*offsets[:at], offsets[at], *offsets[at:]]


def _run(
    call: Any, rk: RandomKV, slots: torch.Tensor, offsets: list[int], layers: range, full: bool,
    sums: bool,
) -> tuple[RandomKV, torch.Tensor, torch.Tensor | None]:  # fmt: skip
    rk = rk.clone()
    kv = rk.kv
    stage_layers = kv.num_layers if full else len(layers)
    staging = torch.empty(slots.numel() * stage_layers * kv.kv_width, dtype=kv.dtype, device=DEV)
    poison_(staging, torch.Generator().manual_seed(11))
    g = torch.Generator().manual_seed(5)
    checksums = None
    if sums:
        checksums = torch.randint(-(2**62), 2**62, (len(offsets) - 1,), generator=g).to(DEV)
    k, v = list(kv.k[layers.start : layers.stop]), list(kv.v[layers.start : layers.stop])
    offs = torch.tensor(offsets, device=DEV)
    torch.cuda.synchronize()
    call(k, v, slots, offs, staging, checksums, layers.start, kv.num_layers, full, 0)
    torch.cuda.synchronize()
    return rk, staging, checksums


def _same(a: Any, b: Any, what: str) -> None:
    for i, (x, y) in enumerate(zip(a[0].buffers, b[0].buffers, strict=True)):
        assert torch.equal(bits(x), bits(y)), f"{what}: engine buffer {i} differs"
    assert torch.equal(bits(a[1]), bits(b[1])), f"{what}: staging differs"
    assert (a[2] is None and b[2] is None) or torch.equal(a[2], b[2]), f"{what}: checksums"


def _no_sync(fn: Any) -> Any:
    """``fn`` run with host waits turned into errors (after one warm-up run: compiles)."""

    def run(*args: Any) -> None:
        torch.cuda.set_sync_debug_mode("error")
        try:
            fn(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    return run


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fallback_matches_reference_and_kernels(impl: str, layout: str, dtype: torch.dtype) -> None:
    module = _impl(impl)
    kernels = _cext.load().loaded
    for seed in (1, 2, 3):
        rk, slots, offsets = _case(layout, dtype, seed)
        nl = rk.kv.num_layers
        whole = rk.kv.kv_width * rk.kv.k[0].element_size() % 8 == 0
        configs = [(range(nl), False), (range(nl - 1, nl), True), (range(nl - 1), True)]
        for op, (layers, full) in itertools.product(("gather_kv", "scatter_kv"), configs):
            if not len(layers):
                continue
            sums = whole or len(layers) == nl
            what = f"{impl} {op} {layout} {dtype} seed {seed} {layers} full={full}"
            want = _run(getattr(_ref, op), rk, slots, offsets, layers, full, sums)
            _run(getattr(module, op), rk, slots, offsets, layers, full, sums)  # warm-up
            got = _run(_no_sync(getattr(module, op)), rk, slots, offsets, layers, full, sums)
            _same(want, got, what)
            if kernels:
                cuda = getattr(torch.ops.lmcache, op).default
                _same(_run(cuda, rk, slots, offsets, layers, full, sums), got, what + " vs CUDA")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("unit", [1, 3, 8, 256])
@pytest.mark.parametrize("shift", [0, 3])
def test_checksum_chunks_fallback(impl: str, unit: int, shift: int) -> None:
    module = _impl(impl)
    data = poison_(torch.empty(1 << 16, dtype=torch.uint8, device=DEV))[shift:]
    last = data.numel() // unit
    offsets = torch.tensor([0, 1, 1, 9, last // 3, last - 1, last], device=DEV)
    want = torch.empty(offsets.numel() - 1, dtype=torch.int64, device=DEV)
    _ref.checksum_chunks(data, offsets, unit, want)
    got = torch.full_like(want, 77)
    module.checksum_chunks(data, offsets, unit, got)
    _no_sync(module.checksum_chunks)(data, offsets, unit, got)
    assert torch.equal(got, want)
    if _cext.load().loaded:
        cuda = torch.full_like(want, 5)
        torch.ops.lmcache.checksum_chunks.default(data, offsets, unit, cuda)
        assert torch.equal(cuda, want)


@pytest.mark.skipif(INTERPRETED, reason="TRITON_INTERPRET=1: run tests/gpu apart from tests/unit")
def test_dispatch_on_cuda() -> None:
    name = gpu_ops.implementation(DEV)
    if _cext.load().loaded:
        assert name == "cuda-kernels" and gpu_ops.one_launch_ops(DEV)
    elif importlib.util.find_spec("triton") is not None and not INTERPRETED:
        assert _dispatch._probe_triton(DEV) == ""
        assert name == "triton" and gpu_ops.one_launch_ops(DEV)
    else:
        assert name == "torch-vectorized" and not gpu_ops.one_launch_ops(DEV)
