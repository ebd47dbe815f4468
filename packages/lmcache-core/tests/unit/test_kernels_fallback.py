# SPDX-License-Identifier: Apache-2.0
"""The fallbacks of the CUDA kernels against the pure-torch reference, bit for bit, on the CPU.

The vectorized torch ops (:mod:`lmcache.gpu_ops._vectorized`) and the Triton port
(:mod:`lmcache.gpu_ops._triton`, run by Triton's interpreter on CPU tensors:
``TRITON_INTERPRET=1`` is set before Triton is imported) are held to :mod:`lmcache.gpu_ops._ref`
in every layout and storage dtype, with skipped and out-of-range slots, uneven and empty chunks,
layer ranges with and without ``staging_full``, accumulated checksums and rows that are not whole
64-bit words. Outputs are poisoned first and whole engine buffers compared. Checksums are also
held to the plain-Python definition, so a bug shared with the reference's torch mix64 fails.
Also: malformed chunk offsets raise in every implementation before anything is written, the
dispatch, and its one WARNING.
"""

from __future__ import annotations

import os
import shutil

# Triton's interpreter runs the kernels on CPU tensors; set before Triton is imported. Never on a
# GPU machine: the variable would reach the GPU tests collected in the same pytest process
# (``nox -s gpu``), where Triton must compile for the device (tests/gpu checks it there).
os.environ.setdefault(
    "TRITON_INTERPRET",
    "0" if shutil.which("nvidia-smi") or os.path.exists("/dev/nvidia0") else "1",
)

import importlib.util
import itertools
import logging
from types import ModuleType

import pytest
import torch

from lmcache import gpu_ops
from lmcache.gpu_ops import _cext, _dispatch, _ref, _vectorized
from lmcache.gpu_ops.mix64sum import chunk_checksum_py, unsigned64
from lmcache.gpu_ops.testing import (
    DTYPES,
    LAYOUTS,
    RandomKV,
    bits,
    poison_,
    random_chunks,
    random_kv,
    random_slots,
)

HAS_TRITON = importlib.util.find_spec("triton") is not None
ON_GPU_MACHINE = shutil.which("nvidia-smi") is not None or os.path.exists("/dev/nvidia0")
IMPLS = [
    "vectorized",
    pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="pip install triton")),
]


def _impl(name: str) -> ModuleType:
    if name == "vectorized":
        return _vectorized
    if name == "reference":
        return _ref
    from lmcache.gpu_ops import _triton

    if ON_GPU_MACHINE:
        pytest.skip("a GPU machine: the Triton port is checked on the device (tests/gpu)")
    if type(_triton._copy_kernel).__name__ != "InterpretedFunction":
        pytest.skip("lmcache.gpu_ops._triton was imported before TRITON_INTERPRET=1 was set")
    return _triton


def _case(layout: str, dtype: torch.dtype, seed: int) -> tuple[RandomKV, torch.Tensor, list[int]]:
    """Random KV (some rows not whole words), slots with skips and out-of-range entries, and
    uneven chunks with an empty one."""
    g = torch.Generator().manual_seed(seed)
    r = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    mla = layout.endswith("mla")
    rk = random_kv(
        layout,
        dtype,
        "cpu",
        num_layers=r(2, 4),
        num_pages=r(3, 7),
        page_size=r(1, 5),
        heads=1 if mla else r(1, 3),
        head_size=r(1, 12) * (1 if seed % 2 else 4),
        generator=g,
    )
    cap = rk.kv.num_pages * rk.kv.page_size
    slots = random_slots(r(2, cap), cap, generator=g)
    slots[r(0, slots.numel() - 1)] = cap + r(0, 3)  # out of range: skipped like -1
    offsets = random_chunks(slots.numel(), generator=g)
    at = r(0, len(offsets) - 1)
    return rk, slots, [*offsets[:at], offsets[at], *offsets[at:]]  # an empty chunk


def _run(
    module: ModuleType,
    op: str,
    rk: RandomKV,
    slots: torch.Tensor,
    offsets: list[int],
    layers: range,
    staging_full: bool,
    sums: bool,
) -> tuple[RandomKV, torch.Tensor, torch.Tensor | None]:
    """Run ``op`` of ``module`` on copies; return the buffers, staging and sums after it."""
    rk = rk.clone()
    kv = rk.kv
    stage_layers = kv.num_layers if staging_full else len(layers)
    staging = torch.empty(slots.numel() * stage_layers * kv.kv_width, dtype=kv.dtype)
    poison_(staging, torch.Generator().manual_seed(11))
    checksums = None
    if sums:  # poisoned too: the ops add their terms to what is there (accumulate)
        shape = (len(offsets) - 1,)
        checksums = torch.randint(-(2**62), 2**62, shape, dtype=torch.int64, generator=_gen(5))
    k = list(kv.k[layers.start : layers.stop])
    v = list(kv.v[layers.start : layers.stop])
    args = (k, v, slots, torch.tensor(offsets), staging, checksums)
    getattr(module, op)(*args, layers.start, kv.num_layers, staging_full, 0)
    return rk, staging, checksums


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _same(a: tuple[RandomKV, torch.Tensor, torch.Tensor | None], b: object, what: str) -> None:
    assert isinstance(b, tuple)
    for i, (x, y) in enumerate(zip(a[0].buffers, b[0].buffers, strict=True)):
        assert torch.equal(bits(x), bits(y)), f"{what}: engine buffer {i} differs"
    assert torch.equal(bits(a[1]), bits(b[1])), f"{what}: staging differs"
    if a[2] is None:
        assert b[2] is None
    else:
        assert torch.equal(a[2], b[2]), f"{what}: checksums {a[2].tolist()} != {b[2].tolist()}"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_reference(impl: str, layout: str, dtype: torch.dtype) -> None:
    module = _impl(impl)
    for seed in (1, 2):
        rk, slots, offsets = _case(layout, dtype, seed)
        nl = rk.kv.num_layers
        whole_words = rk.kv.kv_width * rk.kv.k[0].element_size() % 8 == 0
        for op, (layers, full) in itertools.product(
            ("gather_kv", "scatter_kv"),
            [(range(nl), False), (range(1, nl), False), (range(1, 2), True), (range(nl - 1), True)],
        ):
            sums = whole_words or len(layers) == nl
            want = _run(_ref, op, rk, slots, offsets, layers, full, sums)
            got = _run(module, op, rk, slots, offsets, layers, full, sums)
            _same(want, got, f"{impl} {op} {layout} {dtype} seed {seed} {layers} full={full}")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", ["vllm_nhd", "vllm_hnd", "vllm_mla", "sglang_hnd"])
def test_layerwise_sums_add_up_to_the_checksum_definition(
    impl: str, layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Layer-by-layer gathers through the wrapper (``accumulate``) then a whole-chunk
    ``checksum_chunks``: each chunk's sum equals the plain-Python definition of its bytes."""
    module = _impl(impl)
    monkeypatch.setattr(_dispatch, "resolve", lambda device: _name(module))
    rk, slots, offsets = _case(layout, torch.bfloat16, 4)
    kv = rk.kv
    width = kv.num_layers * kv.kv_width
    staging = poison_(torch.empty(slots.numel() * width, dtype=kv.dtype), _gen(3))
    sums = torch.full((len(offsets) - 1,), 99, dtype=torch.int64)
    for layer in range(kv.num_layers):  # the first call overwrites, later ones add
        gpu_ops.gather_kv_layer(
            kv,
            layer,
            slots,
            offsets,
            staging,
            checksums=sums,
            staging_full=True,
            accumulate=layer > 0,
        )
    unit = width * kv.k[0].element_size()
    raw = staging.view(torch.uint8)
    want = [
        chunk_checksum_py(raw[a * unit : b * unit].numpy().tobytes()) for a, b in _pairs(offsets)
    ]
    assert [unsigned64(int(x)) for x in sums] == want
    whole = gpu_ops.checksum_chunks(staging, offsets, unit_bytes=unit)
    assert [unsigned64(int(x)) for x in whole] == want


def _pairs(offsets: list[int]) -> list[tuple[int, int]]:
    return list(itertools.pairwise(offsets))


def _name(module: ModuleType) -> str:
    return {"_vectorized": "torch-vectorized", "_triton": "triton", "_ref": "torch-reference"}[
        module.__name__.rsplit(".", 1)[-1]
    ]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("unit", [1, 3, 8, 16])
@pytest.mark.parametrize("shift", [0, 1, 5])
def test_checksum_chunks_matches(impl: str, unit: int, shift: int) -> None:
    """Byte ranges at any alignment (``shift`` bytes into the buffer), empty chunks included."""
    module = _impl(impl)
    data = poison_(torch.empty(1 << 11, dtype=torch.uint8), _gen(unit + shift))[shift:]
    last = data.numel() // unit
    offsets = torch.tensor([0, 1, 1, 9, last // 2, last - 1, last])
    want = torch.empty(offsets.numel() - 1, dtype=torch.int64)
    got = torch.full_like(want, 77)
    _ref.checksum_chunks(data, offsets, unit, want)
    module.checksum_chunks(data, offsets, unit, got)
    assert torch.equal(got, want)
    bounds = [(a * unit, b * unit) for a, b in _pairs(offsets.tolist())]
    py = [chunk_checksum_py(data[a:b].numpy().tobytes()) for a, b in bounds]
    assert [unsigned64(int(x)) for x in got] == py


# -- malformed chunk offsets: every implementation raises before it writes ---------------------

MALFORMED = {
    "not from 0": [1, 3, 5],
    "decreasing": [0, 4, 2, 5],
    "short of num_tokens": [0, 2, 4],
    "past num_tokens": [0, 3, 6],
}


@pytest.mark.parametrize("impl", ["reference", *IMPLS])
@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_offsets_raise_before_writing(
    impl: str, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = _impl(impl)
    rk, _, _ = _case("vllm_nhd", torch.float16, 3)
    slots = torch.arange(5)
    before = rk.clone()
    kv = rk.kv
    staging = poison_(torch.empty(5 * kv.num_layers * kv.kv_width, dtype=kv.dtype), _gen(1))
    kept = staging.clone()
    sums = torch.zeros(len(MALFORMED[case]) - 1, dtype=torch.int64)
    offsets = torch.tensor(MALFORMED[case])
    monkeypatch.setattr(_dispatch, "resolve", lambda device: _name(module))
    for op in ("gather_kv", "scatter_kv"):
        args = (list(kv.k), list(kv.v), slots, offsets, staging, sums, 0, kv.num_layers, False, 0)
        with pytest.raises(ValueError, match="chunk_offsets non-decreasing from 0 to num_tokens=5"):
            getattr(module, op)(*args)
        for given in (MALFORMED[case], offsets):  # the wrapper: a list, a CPU tensor
            with pytest.raises(ValueError, match="Fix: build them as"):
                getattr(gpu_ops, op)(kv, slots, given, staging, checksums=sums)
    for x, y in zip(rk.buffers, before.buffers, strict=True):
        assert torch.equal(bits(x), bits(y))
    assert torch.equal(bits(staging), bits(kept)) and not sums.any()
    data = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="within the data"):
        module.checksum_chunks(data, torch.tensor([0, 9]), 8, torch.empty(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="non-decreasing"):
        gpu_ops.checksum_chunks(data, [0, 5, 4])


def test_index_builders_check_offsets() -> None:
    from lmcache.gpu_connector.checksums import pack_index

    assert gpu_ops.build_chunk_offsets([2, 0, 3]) == [0, 2, 2, 5]
    with pytest.raises(ValueError, match="malformed chunk offsets"):
        gpu_ops.build_chunk_offsets([2, -1, 3])
    with pytest.raises(ValueError, match="num_tokens=4"):
        gpu_ops.build_chunk_offsets([2, 3], num_tokens=4)
    with pytest.raises(ValueError, match="pack_index: malformed chunk offsets"):
        pack_index([2, 3], torch.arange(4), [None, None])


# -- dispatch and its WARNING ------------------------------------------------------------------


def test_cpu_and_other_devices() -> None:
    assert gpu_ops.implementation("cpu") == "torch-vectorized"
    assert gpu_ops.implementation("meta") == "torch-reference"
    assert not gpu_ops.one_launch_ops("cpu")
    assert gpu_ops.IMPLEMENTATIONS == (
        "cuda-kernels",
        "triton",
        "torch-vectorized",
        "torch-reference",
    )


@pytest.mark.parametrize("mode", ["unavailable", "disabled"])
def test_one_warning_with_cause_fallback_and_fix(
    mode: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    impl = "triton" if mode == "unavailable" else "torch-vectorized"
    detail = "no CUDA toolkit: nvcc not found" if mode == "unavailable" else "set on purpose"
    monkeypatch.setattr(_cext, "status", lambda: _cext.CextStatus(False, mode, detail))
    monkeypatch.setattr(_dispatch, "implementation", lambda device: impl)
    monkeypatch.setattr(_dispatch, "_warned", False)
    monkeypatch.setattr(_dispatch, "_triton_why", "Triton is not installed (no module)")
    with caplog.at_level(logging.WARNING, logger="lmcache.gpu_ops"):
        for _ in range(3):
            assert _dispatch.resolve("cuda:0") == impl
        assert _dispatch.resolve("cpu") == impl  # not a CUDA device: no warning of its own
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    text = warnings[0]
    assert "nox -s build" in text and "LMCACHE_JIT=1 with nvcc and a C++ compiler" in text
    assert "sm_75 to sm_120" in text and "cuda:0" in text
    if mode == "unavailable":
        assert detail in text and "Triton port" in text
    else:
        assert "disabled on purpose (LMCACHE_DISABLE_CEXT=1 is set)" in text
        assert "vectorized torch ops" in text and "Triton is not installed" in text


@pytest.mark.skipif(not HAS_TRITON, reason="pip install triton")
def test_triton_probe_runs_in_the_interpreter() -> None:
    _impl("triton")
    assert _dispatch._probe_triton(torch.device("cpu")) == ""


@pytest.mark.skipif(not HAS_TRITON, reason="pip install triton")
def test_a_failing_triton_kernel_falls_back_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    triton_ops = _impl("triton")

    def broken(*args: object) -> None:
        raise RuntimeError("no C compiler found")

    monkeypatch.setattr(triton_ops, "gather_kv", broken)
    monkeypatch.setattr(_dispatch, "resolve", lambda device: "triton")
    monkeypatch.setattr(_dispatch, "_triton_why", "")
    rk, slots, offsets = _case("vllm_hnd", torch.float16, 6)
    want = _run(_ref, "gather_kv", rk, slots, offsets, range(rk.kv.num_layers), False, False)
    staging = torch.empty_like(want[1])
    poison_(staging, _gen(11))
    with caplog.at_level(logging.WARNING, logger="lmcache.gpu_ops"):
        gpu_ops.gather_kv(rk.kv, slots, offsets, staging)
    assert torch.equal(bits(staging), bits(want[1]))
    assert "a Triton kernel failed (RuntimeError: no C compiler found)" in caplog.text
    assert "vectorized torch ops from now on" in caplog.text
