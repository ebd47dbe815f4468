# SPDX-License-Identifier: Apache-2.0
"""The CUDA kernels (``torch.ops.lmcache``) against the pure-torch reference, bit for bit.

Every op, every layout the adapters use (:data:`lmcache.gpu_ops.testing.LAYOUTS`) and every
storage dtype (bf16, fp16, fp32, fp8 e4m3), with random shapes, chunkings and negative slots:
outputs are poisoned with random bytes beforehand, whole engine buffers are compared (so
untouched slots must be unchanged), checksums must equal the reference's and the host's, and
``torch.library.opcheck`` runs on each op. Needs a CUDA GPU and a toolkit to build the
extension (skips with a reason otherwise; ``LMCACHE_REQUIRE_CEXT=1`` turns a failed build into
an error).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from lmcache.gpu_ops import (  # noqa: E402
    PagedKV,
    _cext,
    _ref,
    checksum_chunks,
    chunk_checksum,
    gather_kv,
)
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
MASK = (1 << 64) - 1


@pytest.fixture(scope="module", autouse=True)
def cext() -> _cext.CextStatus:
    status = _cext.load()
    if not status.loaded:
        pytest.skip(f"lmcache's CUDA extension is not available: {status.detail}")
    return status


def _case(
    layout: str, dtype: torch.dtype, seed: int, *, tokens: int | None = None
) -> tuple[RandomKV, torch.Tensor, list[int]]:
    g = torch.Generator().manual_seed(seed)

    def pick(options: Sequence[int]) -> int:
        return options[int(torch.randint(0, len(options), (1,), generator=g))]

    mla = layout.endswith("mla")
    page_size = pick([1, 4, 16, 32])
    need = -(-(tokens or 0) // page_size) + 1  # pages for `tokens`
    rk = random_kv(
        layout,
        dtype,
        DEV,
        num_layers=pick([1, 2, 3, 5]),
        num_pages=max(pick([8, 24, 61]), need),
        page_size=page_size,
        heads=1 if mla else pick([1, 2, 4, 8]),
        head_size=pick([512, 576] if mla else [64, 80, 96, 128]),
        generator=g,
    )
    cap = rk.kv.num_pages * rk.kv.page_size
    n = (
        tokens
        if tokens is not None
        else int(torch.randint(1, min(cap, 700) + 1, (1,), generator=g))
    )
    slots = random_slots(n, cap, generator=g).to(DEV)
    return rk, slots, random_chunks(n, generator=g)


def _staging(kv: PagedKV, tokens: int, layers: int, seed: int) -> torch.Tensor:
    s = torch.empty(tokens * layers * kv.kv_width, dtype=kv.dtype, device=DEV)
    return poison_(s, torch.Generator().manual_seed(seed))


def _args(
    kv: PagedKV,
    slots: torch.Tensor,
    offsets: list[int],
    staging: torch.Tensor,
    sums: torch.Tensor | None,
    layers: range | None = None,
    staging_full: bool = False,
    max_sms: int = 0,
) -> tuple[object, ...]:
    r = layers or range(kv.num_layers)
    k = list(kv.k[r.start : r.stop])
    v = list(kv.v[r.start : r.stop]) if kv.v else []
    offs = torch.tensor(offsets, dtype=torch.int64, device=DEV)
    return (k, v, slots, offs, staging, sums, r.start, kv.num_layers, staging_full, max_sms)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(bits(a), bits(b))


def _host_checksums(staging: torch.Tensor, offsets: list[int], per_token: int) -> list[int]:
    host = staging.cpu()
    return [
        chunk_checksum(host[a * per_token : b * per_token]) for a, b in itertools.pairwise(offsets)
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gather_bit_exact(layout: str, dtype: torch.dtype) -> None:
    for seed in range(3):
        rk, slots, offsets = _case(layout, dtype, seed)
        kv = rk.kv
        got = _staging(kv, slots.numel(), kv.num_layers, seed)
        want = got.clone()
        before = [b.clone() for b in rk.buffers]
        sums = torch.full((len(offsets) - 1,), 12345, dtype=torch.int64, device=DEV)
        ref_sums = torch.zeros_like(sums)
        gather_kv(kv, slots, offsets, got, checksums=sums)  # the wrapper: zeroes, then the op
        _ref.gather_kv(*_args(kv, slots, offsets, want, ref_sums))
        torch.cuda.synchronize()
        assert _same(got, want), (layout, dtype, seed)
        assert torch.equal(sums, ref_sums)
        assert all(_same(a, b) for a, b in zip(before, rk.buffers, strict=True))
        assert [int(x) & MASK for x in sums.cpu()] == _host_checksums(
            got, offsets, kv.num_layers * kv.kv_width
        )


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_scatter_bit_exact(layout: str, dtype: torch.dtype) -> None:
    for seed in range(3):
        rk, slots, offsets = _case(layout, dtype, 100 + seed)
        expected = rk.clone()
        staging = _staging(rk.kv, slots.numel(), rk.kv.num_layers, seed)
        snapshot = staging.clone()
        sums = torch.zeros(len(offsets) - 1, dtype=torch.int64, device=DEV)
        ref_sums = torch.zeros_like(sums)
        torch.ops.lmcache.scatter_kv.default(*_args(rk.kv, slots, offsets, staging, sums))
        _ref.scatter_kv(*_args(expected.kv, slots, offsets, staging, ref_sums))
        torch.cuda.synchronize()
        for got, want in zip(rk.buffers, expected.buffers, strict=True):
            assert _same(got, want), (layout, dtype, seed)  # untouched slots unchanged too
        assert _same(staging, snapshot)
        assert torch.equal(sums, ref_sums)


@pytest.mark.parametrize("layout", ["vllm_nhd", "vllm_mla", "sglang_hnd"])
def test_layer_ranges(layout: str) -> None:
    """Single layers (layerwise) into a one-layer or an all-layer staging, checksums
    accumulated over the layers, and a one-layer scatter out of all-layer staging."""
    rk, slots, offsets = _case(layout, torch.bfloat16, 7, tokens=300)
    kv = rk.kv
    nl = kv.num_layers
    whole = _staging(kv, slots.numel(), nl, 1)
    whole_sums = torch.zeros(len(offsets) - 1, dtype=torch.int64, device=DEV)
    torch.ops.lmcache.gather_kv.default(*_args(kv, slots, offsets, whole, whole_sums))
    full = _staging(kv, slots.numel(), nl, 1)
    sums = torch.zeros_like(whole_sums)
    for layer in range(nl):
        one = _staging(kv, slots.numel(), 1, 10 + layer)
        one_ref = one.clone()
        one_sums, one_ref_sums = torch.zeros_like(sums), torch.zeros_like(sums)
        r = range(layer, layer + 1)
        torch.ops.lmcache.gather_kv.default(*_args(kv, slots, offsets, one, one_sums, r))
        _ref.gather_kv(*_args(kv, slots, offsets, one_ref, one_ref_sums, r))
        torch.cuda.synchronize()
        assert _same(one, one_ref) and torch.equal(one_sums, one_ref_sums)
        torch.ops.lmcache.gather_kv.default(*_args(kv, slots, offsets, full, sums, r, True))
    torch.cuda.synchronize()
    assert _same(full, whole) and torch.equal(sums, whole_sums)
    for layer in (0, nl - 1):
        got, want = rk.clone(), rk.clone()
        r = range(layer, layer + 1)
        torch.ops.lmcache.scatter_kv.default(*_args(got.kv, slots, offsets, whole, None, r, True))
        _ref.scatter_kv(*_args(want.kv, slots, offsets, whole, None, r, True))
        torch.cuda.synchronize()
        assert all(_same(a, b) for a, b in zip(got.buffers, want.buffers, strict=True))


def test_llama_geometry_many_chunks() -> None:
    """32 layers, 8 heads of 128, 16-token pages, 4096 tokens in 256-token chunks and a tail."""
    g = torch.Generator().manual_seed(3)
    rk = random_kv(
        "vllm_nhd",
        torch.bfloat16,
        DEV,
        num_layers=32,
        num_pages=400,
        page_size=16,
        heads=8,
        head_size=128,
        generator=g,
    )
    n = 4000
    slots = random_slots(n, 400 * 16, skip=0.05, generator=g).to(DEV)
    offsets = [*range(0, n, 256), n]
    kv = rk.kv
    got = _staging(kv, n, 32, 4)
    want = got.clone()
    sums = torch.zeros(len(offsets) - 1, dtype=torch.int64, device=DEV)
    ref_sums = torch.zeros_like(sums)
    torch.ops.lmcache.gather_kv.default(*_args(kv, slots, offsets, got, sums))
    _ref.gather_kv(*_args(kv, slots, offsets, want, ref_sums))
    torch.cuda.synchronize()
    assert _same(got, want) and torch.equal(sums, ref_sums)
    target, expected = rk.clone(), rk.clone()
    torch.ops.lmcache.scatter_kv.default(*_args(target.kv, slots, offsets, got, sums, max_sms=16))
    _ref.scatter_kv(*_args(expected.kv, slots, offsets, got, ref_sums))
    torch.cuda.synchronize()
    assert _same(target.buffers[0], expected.buffers[0]) and torch.equal(sums, ref_sums)


@pytest.mark.parametrize("max_sms", [1, 7, 10_000])
def test_sm_cap_gives_the_same_bytes(max_sms: int) -> None:
    rk, slots, offsets = _case("sglang_nhd", torch.float16, 21, tokens=500)
    got = _staging(rk.kv, 500, rk.kv.num_layers, 2)
    want = got.clone()
    sums, ref_sums = (torch.zeros(len(offsets) - 1, dtype=torch.int64, device=DEV) for _ in "ab")
    torch.ops.lmcache.gather_kv.default(*_args(rk.kv, slots, offsets, got, sums, max_sms=max_sms))
    _ref.gather_kv(*_args(rk.kv, slots, offsets, want, ref_sums))
    torch.cuda.synchronize()
    assert _same(got, want) and torch.equal(sums, ref_sums)


def test_more_layers_than_one_launch() -> None:
    rk = random_kv(
        "sglang_mla",
        torch.float16,
        DEV,
        num_layers=130,
        num_pages=6,
        page_size=4,
        heads=1,
        head_size=64,
        generator=torch.Generator().manual_seed(1),
    )
    slots = torch.tensor([3, -1, 20, 7, 0, 11], device=DEV)
    offsets = [0, 4, 6]
    got = _staging(rk.kv, 6, 130, 3)
    want = got.clone()
    sums, ref_sums = (torch.zeros(2, dtype=torch.int64, device=DEV) for _ in "ab")
    torch.ops.lmcache.gather_kv.default(*_args(rk.kv, slots, offsets, got, sums))
    _ref.gather_kv(*_args(rk.kv, slots, offsets, want, ref_sums))
    torch.cuda.synchronize()
    assert _same(got, want) and torch.equal(sums, ref_sums)


@pytest.mark.parametrize("case", ["misaligned_staging", "odd_rows", "fp32_head_1"])
def test_narrow_vectors(case: str) -> None:
    """Rows or addresses that allow only 2- or 4-byte vectors (checksums then take a second,
    byte-wise pass) give the same bytes and checksums."""
    g = torch.Generator().manual_seed(5)
    head, dtype = {
        "misaligned_staging": (64, torch.float16),
        "odd_rows": (3, torch.float16),
        "fp32_head_1": (1, torch.float32),
    }[case]
    rk = random_kv(
        "sglang_nhd",
        dtype,
        DEV,
        num_layers=3,
        num_pages=16,
        page_size=4,
        heads=3,
        head_size=head,
        generator=g,
    )
    kv = rk.kv
    slots = random_slots(40, 64, generator=g).to(DEV)
    offsets = [0, 9, 33, 40]
    size = 40 * 3 * kv.kv_width
    if case == "misaligned_staging":
        raw = poison_(torch.empty(size + 1, dtype=dtype, device=DEV), g)
        got = raw[1:]
    else:
        got = _staging(kv, 40, 3, 1)
    want = got.clone()
    sums, ref_sums = (torch.zeros(3, dtype=torch.int64, device=DEV) for _ in "ab")
    torch.ops.lmcache.gather_kv.default(*_args(kv, slots, offsets, got, sums))
    _ref.gather_kv(*_args(kv, slots, offsets, want, ref_sums))
    torch.cuda.synchronize()
    assert _same(got, want) and torch.equal(sums, ref_sums)
    target, expected = rk.clone(), rk.clone()
    torch.ops.lmcache.scatter_kv.default(*_args(target.kv, slots, offsets, got, sums))
    _ref.scatter_kv(*_args(expected.kv, slots, offsets, got, ref_sums))
    torch.cuda.synchronize()
    assert all(_same(a, b) for a, b in zip(target.buffers, expected.buffers, strict=True))
    assert torch.equal(sums, ref_sums)


@pytest.mark.parametrize("unit", [1, 3, 8, 4096])
def test_checksum_chunks_op(unit: int) -> None:
    g = torch.Generator().manual_seed(unit)
    data = poison_(torch.empty(64 * 4096 + 5, dtype=torch.uint8, device=DEV), g)
    for view in (data, data[5:]):  # aligned and not
        units = view.numel() // unit
        cuts = sorted(torch.randint(0, units + 1, (6,), generator=g).tolist())
        offsets = [0, *cuts, units]
        got = checksum_chunks(view, offsets, unit_bytes=unit)
        want = torch.empty_like(got)
        _ref.checksum_chunks(view, torch.tensor(offsets, device=DEV), unit, want)
        assert torch.equal(got, want)
        assert [int(x) & MASK for x in got.cpu()] == [
            chunk_checksum(view[a * unit : b * unit].cpu()) for a, b in itertools.pairwise(offsets)
        ]


@pytest.mark.parametrize("layout", ["vllm_nhd", "vllm_mla", "sglang_nhd", "hicache_page_first"])
def test_opcheck(layout: str) -> None:
    rk, slots, offsets = _case(layout, torch.bfloat16, 9, tokens=64)
    staging = _staging(rk.kv, 64, rk.kv.num_layers, 3)
    sums = torch.zeros(len(offsets) - 1, dtype=torch.int64, device=DEV)
    args = _args(rk.kv, slots, offsets, staging, sums)
    torch.library.opcheck(torch.ops.lmcache.gather_kv.default, args)
    torch.library.opcheck(torch.ops.lmcache.scatter_kv.default, args)
    offs = torch.tensor(offsets, dtype=torch.int64, device=DEV)
    torch.library.opcheck(torch.ops.lmcache.checksum_chunks.default, (staging, offs, 2, sums))


def test_input_checks_name_expected_and_found() -> None:
    rk, slots, offsets = _case("vllm_nhd", torch.float16, 4, tokens=32)
    kv = rk.kv
    staging = _staging(kv, 32, kv.num_layers, 1)
    op = torch.ops.lmcache.gather_kv.default
    host = torch.empty(staging.numel(), dtype=staging.dtype).pin_memory()
    with pytest.raises(RuntimeError, match="expected staging in CUDA device memory, found"):
        op(*_args(kv, slots, offsets, host, None))
    with pytest.raises(RuntimeError, match=r"expected staging of num_tokens \* layers \* kv_width"):
        op(*_args(kv, slots, offsets, staging[1:], None))
    with pytest.raises(RuntimeError, match="expected staging of dtype"):
        op(*_args(kv, slots, offsets, staging.view(torch.int16), None))
    with pytest.raises(RuntimeError, match="expected slots as a contiguous 1-D int64 tensor"):
        op(*_args(kv, slots.int(), offsets, staging, None))
    args = list(_args(kv, slots, offsets, staging, None))
    args[1] = [*args[1], args[1][0]]  # one V layer too many
    with pytest.raises(RuntimeError, match="expected v_caches"):
        op(*args)
    odd = random_kv(
        "sglang_nhd",
        torch.float16,
        DEV,
        num_layers=2,
        num_pages=2,
        page_size=2,
        heads=1,
        head_size=3,
    )
    s = torch.tensor([0, 1], device=DEV)
    sums = torch.zeros(1, dtype=torch.int64, device=DEV)
    with pytest.raises(RuntimeError, match="multiple of 8 bytes"):
        op(
            *_args(
                odd.kv,
                s,
                [0, 2],
                torch.empty(12, dtype=torch.float16, device=DEV),
                sums,
                range(1, 2),
            )
        )


def test_status_names_the_build(cext: _cext.CextStatus) -> None:
    assert cext.mode in ("wheel", "jit", "jit-cached", "already-registered")
    assert "sm_90" in cext.archs or cext.mode == "already-registered"
    assert _cext.status() == cext
