# SPDX-License-Identifier: Apache-2.0
"""The pure-torch reference of the lmcache kernels (CPU): its semantics against a per-token
oracle, the chunk checksum against its plain-Python definition and pinned vectors, the op
schemas of ``csrc/torch_bindings.cpp`` under ``torch.library.opcheck`` (with the reference as
their CPU kernel), and the ``LMCACHE_REQUIRE_CEXT`` / ``LMCACHE_DISABLE_CEXT`` switches."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Sequence

import pytest
import torch

from lmcache.gpu_ops import (
    CHECKSUM_NAME,
    CHECKSUM_VERSION,
    PagedKV,
    _cext,
    _ref,
    checksum_chunks,
    chunk_checksum,
    gather_kv,
    gather_kv_layer,
    scatter_kv,
    scatter_kv_layer,
    uses_cext,
)
from lmcache.gpu_ops._ref import chunk_checksum_py, mix64
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

BINDINGS = _cext.sources_dir() / "torch_bindings.cpp"
MASK = (1 << 64) - 1


# -- oracle: one token of one layer at a time --------------------------------------------------


def _rows_of(kv: PagedKV, layer: int, page: int, off: int) -> torch.Tensor:
    parts = [bits(kv.k[layer])[page, off].reshape(-1)]
    if kv.v:
        parts.append(bits(kv.v[layer])[page, off].reshape(-1))
    return torch.cat(parts)


def _walk(
    kv: PagedKV, slots: torch.Tensor, offsets: Sequence[int], layers: range, staging_full: bool
) -> Iterator[tuple[int, int, int, int]]:
    """``(layer, staging row, page, offset)`` of every moved token."""
    stage_layers = kv.num_layers if staging_full else len(layers)
    s0 = layers.start if staging_full else 0
    cap = kv.num_pages * kv.page_size
    for a, b in itertools.pairwise(offsets):
        n = b - a
        for i, layer in enumerate(layers):
            for t in range(n):
                s = int(slots[a + t])
                if 0 <= s < cap:
                    page, off = divmod(s, kv.page_size)
                    yield layer, a * stage_layers + (s0 + i) * n + t, page, off


def oracle_gather(
    kv: PagedKV,
    slots: torch.Tensor,
    offsets: Sequence[int],
    staging: torch.Tensor,
    layers: range,
    staging_full: bool,
) -> torch.Tensor:
    out = bits(staging).view(-1, kv.kv_width).clone()
    for layer, row, page, off in _walk(kv, slots, offsets, layers, staging_full):
        out[row] = _rows_of(kv, layer, page, off)
    return out.view(-1)


def oracle_scatter(
    kv: PagedKV,
    slots: torch.Tensor,
    offsets: Sequence[int],
    staging: torch.Tensor,
    layers: range,
    staging_full: bool,
) -> None:
    rows = bits(staging).view(-1, kv.kv_width)
    hk = kv.heads * kv.head_size_k
    for layer, row, page, off in _walk(kv, slots, offsets, layers, staging_full):
        bits(kv.k[layer])[page, off] = rows[row, :hk].view(kv.heads, kv.head_size_k)
        if kv.v:
            bits(kv.v[layer])[page, off] = rows[row, hk:].view(kv.heads, kv.head_size_v)


def _case(layout: str, dtype: torch.dtype, seed: int) -> tuple[RandomKV, torch.Tensor, list[int]]:
    g = torch.Generator().manual_seed(seed)
    r = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    mla = layout.endswith("mla")
    heads = 1 if mla else r(1, 3)
    head = r(4, 24) * (4 if dtype == torch.float8_e4m3fn else 2)
    rk = random_kv(
        layout,
        dtype,
        "cpu",
        num_layers=r(1, 3),
        num_pages=r(3, 7),
        page_size=r(1, 5),
        heads=heads,
        head_size=head,
        generator=g,
    )
    cap = rk.kv.num_pages * rk.kv.page_size
    slots = random_slots(r(1, cap), cap, generator=g)
    return rk, slots, random_chunks(slots.numel(), generator=g)


def _staging(kv: PagedKV, tokens: int, layers: int, seed: int) -> torch.Tensor:
    s = torch.empty(tokens * layers * kv.kv_width, dtype=kv.dtype)
    return poison_(s, torch.Generator().manual_seed(seed))


# -- gather / scatter semantics -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gather_matches_oracle(layout: str, dtype: torch.dtype) -> None:
    for seed in range(3):
        rk, slots, offsets = _case(layout, dtype, seed)
        kv = rk.kv
        staging = _staging(kv, slots.numel(), kv.num_layers, seed + 100)
        expected = oracle_gather(kv, slots, offsets, staging, range(kv.num_layers), False)
        before = [b.clone() for b in rk.buffers]
        sums = torch.empty(len(offsets) - 1, dtype=torch.int64)
        gather_kv(kv, slots, torch.tensor(offsets), staging, checksums=sums)
        assert torch.equal(bits(staging), expected)  # skipped rows keep their poison
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(before, rk.buffers, strict=True))
        width = kv.num_layers * kv.kv_width
        for c, (a, b) in enumerate(itertools.pairwise(offsets)):
            chunk = staging[a * width : b * width]
            assert (
                int(sums[c]) & MASK
                == chunk_checksum(chunk)
                == chunk_checksum_py(bits(chunk).numpy().tobytes())
            )


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_scatter_matches_oracle(layout: str, dtype: torch.dtype) -> None:
    for seed in range(3):
        rk, slots, offsets = _case(layout, dtype, seed)
        staging = _staging(rk.kv, slots.numel(), rk.kv.num_layers, seed + 200)
        expected = rk.clone()
        oracle_scatter(expected.kv, slots, offsets, staging, range(rk.kv.num_layers), False)
        snapshot = staging.clone()
        sums = torch.empty(len(offsets) - 1, dtype=torch.int64)
        scatter_kv(rk.kv, slots, offsets, staging, checksums=sums)
        # every byte of every buffer: written slots and untouched ones
        for got, want in zip(rk.buffers, expected.buffers, strict=True):
            assert torch.equal(bits(got), bits(want))
        assert torch.equal(bits(staging), bits(snapshot))
        width = rk.kv.num_layers * rk.kv.kv_width
        for c, (a, b) in enumerate(itertools.pairwise(offsets)):
            assert int(sums[c]) & MASK == chunk_checksum(staging[a * width : b * width])


@pytest.mark.parametrize("layout", ["vllm_nhd", "sglang_nhd", "vllm_mla"])
def test_layerwise_calls_add_up_to_the_whole(layout: str) -> None:
    """One layer at a time (staging of one layer, or of all layers) gives the bytes and the
    checksums of one all-layer call, and a scatter of one layer touches that layer only."""
    rk, slots, offsets = _case(layout, torch.bfloat16, 7)
    kv = rk.kv
    nl, width = kv.num_layers, kv.kv_width
    whole = _staging(kv, slots.numel(), nl, 1)
    whole_sums = torch.empty(len(offsets) - 1, dtype=torch.int64)
    gather_kv(kv, slots, offsets, whole, checksums=whole_sums)

    full = _staging(kv, slots.numel(), nl, 1)  # the same poison
    sums = torch.empty_like(whole_sums)
    per_layer_sums = torch.empty_like(whole_sums)
    ones = []
    for layer in range(nl):
        gather_kv_layer(
            kv,
            layer,
            slots,
            offsets,
            full,
            checksums=sums,
            staging_full=True,
            accumulate=layer > 0,
        )
        one = _staging(kv, slots.numel(), 1, 50 + layer)
        expected = oracle_gather(kv, slots, offsets, one, range(layer, layer + 1), False)
        gather_kv_layer(
            kv, layer, slots, offsets, one, checksums=per_layer_sums, accumulate=layer > 0
        )
        assert torch.equal(bits(one), expected)
        ones.append(one)
    assert torch.equal(bits(full), bits(whole))
    assert torch.equal(sums, whole_sums)
    for c, (a, b) in enumerate(itertools.pairwise(offsets)):  # layer slices of
        chunk = torch.cat([one[a * width : b * width] for one in ones])  # each chunk, in order
        assert int(per_layer_sums[c]) & MASK == chunk_checksum(chunk)

    target = rk.clone()
    expected_kv = rk.clone()
    scatter_kv_layer(target.kv, nl - 1, slots, offsets, whole, staging_full=True)
    oracle_scatter(expected_kv.kv, slots, offsets, whole, range(nl - 1, nl), True)
    for got, want in zip(target.buffers, expected_kv.buffers, strict=True):
        assert torch.equal(bits(got), bits(want))
    assert width > 0


def test_out_of_range_slots_are_skipped() -> None:
    rk, _, _ = _case("vllm_hnd", torch.float16, 3)
    kv = rk.kv
    cap = kv.num_pages * kv.page_size
    slots = torch.tensor([cap, 0, cap + 5, 1, -7])
    staging = _staging(kv, 5, kv.num_layers, 9)
    expected = oracle_gather(kv, slots, [0, 5], staging, range(kv.num_layers), False)
    gather_kv(kv, slots, [0, 5], staging)
    assert torch.equal(bits(staging), expected)


def test_input_errors_say_expected_and_found() -> None:
    rk, slots, offsets = _case("vllm_nhd", torch.bfloat16, 1)
    kv = rk.kv
    staging = _staging(kv, slots.numel(), kv.num_layers, 2)
    with pytest.raises(ValueError, match=r"expected staging of num_tokens \* layers"):
        gather_kv(kv, slots, offsets, staging[1:])
    with pytest.raises(ValueError, match="expected slots as a 1-D int64 tensor, found"):
        gather_kv(kv, slots.int(), offsets, staging)
    with pytest.raises(ValueError, match="chunk_offsets non-decreasing from 0"):
        gather_kv(kv, slots, [0, slots.numel() + 1], staging)
    with pytest.raises(ValueError, match="num_chunks = "):
        gather_kv(kv, slots, offsets, staging, checksums=torch.empty(99, dtype=torch.int64))
    with pytest.raises(ValueError, match="non-empty range"):
        gather_kv(kv, slots, offsets, staging, layers=range(0, kv.num_layers + 1))
    odd = random_kv(
        "sglang_nhd",
        torch.float16,
        "cpu",
        num_layers=2,
        num_pages=2,
        page_size=2,
        heads=1,
        head_size=3,
    )
    s = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="multiple of 8 bytes"):
        gather_kv_layer(
            odd.kv,
            1,
            s,
            [0, 2],
            torch.empty(2 * 6, dtype=torch.float16),
            checksums=torch.empty(1, dtype=torch.int64),
        )


def test_odd_rows_checksum_whole_chunks() -> None:
    """Rows that are not whole words (fp16 head of 3): the checksum of all layers still works."""
    rk = random_kv(
        "sglang_nhd",
        torch.float16,
        "cpu",
        num_layers=3,
        num_pages=4,
        page_size=2,
        heads=1,
        head_size=3,
        generator=torch.Generator().manual_seed(4),
    )
    slots = torch.tensor([3, -1, 5, 0, 7])
    staging = _staging(rk.kv, 5, 3, 5)
    sums = torch.empty(2, dtype=torch.int64)
    gather_kv(rk.kv, slots, [0, 2, 5], staging, checksums=sums)
    w = 3 * rk.kv.kv_width
    assert [int(x) & MASK for x in sums] == [
        chunk_checksum(staging[: 2 * w]),
        chunk_checksum(staging[2 * w :]),
    ]


# -- the checksum -------------------------------------------------------------------------------

VECTORS = {
    b"": 0x0,
    b"\x00": 0x38B2BE568B28D394,
    bytes(range(8)): 0x5E837A0C6A84B2EB,
    bytes(range(16)): 0x05EB0B8E2D0277F8,
    b"lmcache": 0x0530C386EF87FC99,
    bytes(range(256)) * 4: 0x8FCA7E72C48D99D9,
}
"""Pinned values of the checksum (:data:`CHECKSUM_NAME` version 1): a change is a new version."""


def test_checksum_name_and_vectors() -> None:
    assert (CHECKSUM_NAME, CHECKSUM_VERSION) == ("lmcache-mix64-sum", 1)
    assert mix64(0) == 0 and mix64(1) == 0x5692161D100B05E5
    for data, value in VECTORS.items():
        assert chunk_checksum_py(data) == value, data
        assert chunk_checksum(torch.tensor(list(data), dtype=torch.uint8)) == value


@pytest.mark.parametrize("dtype", [*DTYPES, torch.uint8, torch.int64])
def test_checksum_matches_definition(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(11)
    for n in (0, 1, 3, 8, 9, 63, 1000):
        t = poison_(torch.empty(n, dtype=dtype), g)
        assert chunk_checksum(t) == chunk_checksum_py(bits(t).numpy().tobytes())
    base = poison_(torch.empty(40, dtype=torch.uint8), g)
    for start in range(1, 8):  # unaligned slices
        assert chunk_checksum(base[start:]) == chunk_checksum_py(base[start:].numpy().tobytes())
    with pytest.raises(ValueError, match="contiguous"):
        chunk_checksum(torch.zeros(4, 4, dtype=dtype).t())


def test_checksum_detects_flips_swaps_and_moves() -> None:
    g = torch.Generator().manual_seed(3)
    a = poison_(torch.empty(4, 64, 32, dtype=torch.bfloat16), g)
    b = poison_(torch.empty(4, 64, 32, dtype=torch.bfloat16), g)
    ref = chunk_checksum(a)
    raw = bits(a).view(-1).view(torch.uint8)
    for pos in torch.randint(0, raw.numel(), (200,), generator=g).tolist():
        for bit in (0, 7):
            raw[pos] ^= 1 << bit
            assert chunk_checksum(a) != ref
            raw[pos] ^= 1 << bit
    assert chunk_checksum(a) == ref
    assert chunk_checksum(b) != ref  # another chunk's bytes
    words = bits(a).view(-1).view(torch.int64)
    w0, w9 = int(words[0]), int(words[9])
    words[0], words[9] = w9, w0  # two words change places
    assert chunk_checksum(a) != ref
    words[0], words[9] = w0, w9
    layers = a.clone()
    layers[[0, 1]] = a[[1, 0]]  # two layers change places
    assert chunk_checksum(layers) != ref
    longer = torch.cat((bits(a).view(-1).view(torch.uint8), torch.zeros(8, dtype=torch.uint8)))
    assert chunk_checksum(longer) != ref  # zero-extended


def test_checksum_chunks_reference() -> None:
    g = torch.Generator().manual_seed(5)
    data = poison_(torch.empty(1000, dtype=torch.uint8), g)
    offsets = [0, 3, 3, 50, 101, 200]
    out = checksum_chunks(data, offsets, unit_bytes=4)
    assert [int(x) & MASK for x in out] == [
        chunk_checksum(data[a * 4 : b * 4]) for a, b in itertools.pairwise(offsets)
    ]
    with pytest.raises(ValueError, match="within the data"):
        checksum_chunks(data, [0, 300], unit_bytes=4)


# -- the schemas, under opcheck, with the reference as CPU kernel -------------------------------


def _schemas() -> dict[str, str]:
    text = BINDINGS.read_text()
    assert "STABLE_TORCH_LIBRARY(lmcache, m)" in text  # torch's stable ABI, our namespace
    assert "STABLE_TORCH_LIBRARY_IMPL(lmcache, CUDA, m)" in text
    assert "(_C" not in text and "<torch/library.h>" not in text
    found = dict(
        (m.group(1).split("(")[0], m.group(1)) for m in re.finditer(r'm\.def\("([^"]+)"\);', text)
    )
    impls = set(re.findall(r'm\.impl\("(\w+)", TORCH_BOX\(&lmcache::\1\)\)', text))
    assert set(found) == impls == {"gather_kv", "scatter_kv", "checksum_chunks"}
    return found


_LIB: torch.library.Library | None = None
NS = "lmcache_reftest"


def _ref_library() -> str:
    """Define the extension's schemas in a test namespace with the reference as CPU kernel."""
    global _LIB
    if _LIB is None:
        _LIB = torch.library.Library(NS, "DEF")
        for name, schema in _schemas().items():
            _LIB.define(schema)
            _LIB.impl(name, getattr(_ref, name), "CPU")
            torch.library.register_fake(f"{NS}::{name}", lib=_LIB)(_cext._no_outputs)
    return NS


@pytest.mark.parametrize("layout", ["vllm_nhd", "vllm_mla", "sglang_nhd", "hicache_page_first"])
def test_schemas_pass_opcheck(layout: str) -> None:
    ops = getattr(torch.ops, _ref_library())
    rk, slots, offsets = _case(layout, torch.float16, 2)
    kv = rk.kv
    staging = _staging(kv, slots.numel(), kv.num_layers, 3)
    sums = torch.zeros(len(offsets) - 1, dtype=torch.int64)
    offs = torch.tensor(offsets)
    args = (list(kv.k), list(kv.v), slots, offs, staging, sums, 0, kv.num_layers, False, 0)
    torch.library.opcheck(ops.gather_kv.default, args)
    torch.library.opcheck(ops.scatter_kv.default, args)
    torch.library.opcheck(ops.checksum_chunks.default, (staging, offs, 2, sums))


# -- packaging and the extension switches -------------------------------------------------------


def _run(code: str, **env: str) -> dict[str, object]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    full.update(env)
    out = subprocess.run(
        [sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


_PROBE = (
    "import json, torch\n"
    "from lmcache.gpu_ops import _cext\n"
    "from lmcache.gpu_ops import chunk_checksum, checksum_chunks\n"
    "r = {}\n"
    "try:\n"
    "    r['sum'] = int(checksum_chunks(torch.arange(16, dtype=torch.uint8), [0, 16])[0])\n"
    "except _cext.CextUnavailableError as exc:\n"
    "    r['error'] = str(exc)\n"
    "s = _cext.status()\n"
    "r['mode'] = s.mode\n"
    "r['detail'] = s.detail\n"
    "print(json.dumps(r))\n"
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU fallback")
def test_without_a_build_cpu_ops_use_the_reference() -> None:
    result = _run(_PROBE)
    assert result["sum"] == _ref._signed(0x05EB0B8E2D0277F8)
    assert result["mode"] == "not-tried"  # CPU tensors never load the extension
    assert not uses_cext("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU fallback")
def test_require_cext_without_a_build_fails_clearly() -> None:
    result = _run(_PROBE, LMCACHE_REQUIRE_CEXT="1")
    error = str(result["error"])
    assert error.startswith("LMCACHE_REQUIRE_CEXT=1 but lmcache's CUDA kernels are not loaded: ")
    assert "unset LMCACHE_REQUIRE_CEXT" in error
    if torch.version.cuda is None:
        assert f"torch {torch.__version__} is not a CUDA build" in error
    assert result["mode"] == "unavailable"


def test_disable_cext() -> None:
    result = _run(_PROBE + "print(json.dumps([_cext.load().mode]))\n", LMCACHE_DISABLE_CEXT="1")
    assert result == ["disabled"]
    both = _run(_PROBE, LMCACHE_DISABLE_CEXT="1", LMCACHE_REQUIRE_CEXT="true")
    assert "contradict each other" in str(both["error"])
