# SPDX-License-Identifier: Apache-2.0
"""``DeviceChecks``: the verified scatter that both kernel connectors use, on the CPU reference.

The reference is the pages themselves: chunks gathered from known pages, the pages poisoned,
then scattered back through the check. A chunk whose stored sum matches must come back bit for
bit; a chunk whose sum does not match must leave every one of its slots poisoned.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from lmcache import gpu_ops
from lmcache.devices import get_backend
from lmcache.gpu_connector.checksums import (
    expected_part,
    expected_sums,
    pack_index,
    split_index,
    staged_tokens,
)
from lmcache.gpu_connector.device_checks import DeviceChecks
from lmcache.gpu_ops import chunk_checksum

PAGES, PAGE, HEADS, HEAD, LAYERS = 12, 4, 2, 8, 3
COUNTS = [8, 8, 5]  # three chunks; the last one short


def _pages(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(PAGES, HEADS, PAGE, 2 * HEAD, generator=g) for _ in range(LAYERS)]


class Index(NamedTuple):
    positions: list[int]
    offsets: torch.Tensor
    slots: torch.Tensor
    chunk_of: torch.Tensor
    expected: torch.Tensor


def _setup(bad: set[int]) -> tuple[DeviceChecks, list[torch.Tensor], torch.Tensor, Index]:
    """Checks over fresh pages, the chunks gathered into staging with their true sums (those of
    the chunks in ``bad`` altered), and the packed index."""
    layers = _pages(0)
    paged = gpu_ops.PagedKV.from_vllm(layers, HEAD)
    checks = DeviceChecks(paged, get_backend("cpu"))
    total = sum(COUNTS)
    slots = torch.randperm(PAGES * PAGE, generator=torch.Generator().manual_seed(1))[:total]
    offsets = torch.tensor([0, 8, 16, 21])
    staging = torch.empty(total * LAYERS * paged.kv_width)
    sums = checks.new_sums(len(COUNTS))
    gpu_ops.gather_kv(paged, slots, offsets, staging, checksums=sums)
    stored = [int(s) for s in sums]
    for c in bad:
        stored[c] ^= 1
    parts = split_index(pack_index(COUNTS, slots, stored), len(COUNTS), total)
    return checks, layers, staging, Index([0, 1, 2], *parts)


@pytest.mark.parametrize("bad", [set(), {1}, {0, 2}])
def test_only_matching_chunks_reach_the_pages(bad: set[int]) -> None:
    checks, layers, staging, index = _setup(bad)
    offsets, slots = index.offsets, index.slots
    want = [t.clone() for t in layers]
    for t in layers:
        t.fill_(float("nan"))
    row = LAYERS * checks.paged.kv_width * 4
    got = checks.verified_scatter(index, staging, row)
    assert got.ok() == [c not in bad for c in range(len(COUNTS))]
    flat = [t.transpose(1, 2).reshape(PAGES * PAGE, -1) for t in layers]
    ref = [t.transpose(1, 2).reshape(PAGES * PAGE, -1) for t in want]
    for c in range(len(COUNTS)):
        mine = slots[offsets[c] : offsets[c + 1]]
        for f, r in zip(flat, ref, strict=True):
            if c in bad:
                assert torch.isnan(f[mine]).all()
            else:
                assert torch.equal(f[mine], r[mine])
    untouched = torch.ones(PAGES * PAGE, dtype=torch.bool)
    untouched[slots] = False
    assert all(torch.isnan(f[untouched]).all() for f in flat)


def test_pieces_check_like_the_whole() -> None:
    checks, _layers, staging, (_, offsets, slots, chunk_of, expected) = _setup({1})
    row = LAYERS * checks.paged.kv_width * 4
    whole = checks.scatter_matching(staging, offsets, slots, chunk_of, expected, row)
    a, b = 1, 3  # chunks 1 and 2, from their first staging token on
    ta, tb = int(offsets[a]), int(offsets[b])
    part = checks.scatter_matching(
        staging[ta * row // 4 : tb * row // 4],
        offsets[a : b + 1] - ta,
        slots[ta:tb],
        chunk_of[ta:tb] - a,
        expected_part(expected, a, b),
        row,
    )
    assert whole.tolist() == [True, False, True]
    assert part.tolist() == whole[a:b].tolist()
    assert expected_part(expected, a, b).tolist() == [
        *expected[a:b].tolist(),
        *expected[3 + a : 3 + b].tolist(),
    ]


def test_summed_scatters_add_up_to_each_chunks_checksum() -> None:
    checks, _layers, staging, index = _setup(set())
    offsets = index.offsets
    width = checks.paged.kv_width
    parts = [checks.summed_scatter(index, staging, r, True) for r in (range(0, 1), range(1, 3))]
    assert [p.layers for p in parts] == [range(0, 1), range(1, 3)]
    for c, n in enumerate(COUNTS):  # reference: the chunk's staged bytes, hashed on the host
        start = int(offsets[c]) * LAYERS * width
        chunk = staging[start : start + n * LAYERS * width]
        total = sum(p.sums()[c] for p in parts) % (1 << 64)
        assert total == chunk_checksum(chunk.view(LAYERS, n, width))


def test_expected_sums_without_a_stored_sum_always_match() -> None:
    checks, _layers, staging, (_, offsets, slots, chunk_of, _) = _setup(set())
    row = LAYERS * checks.paged.kv_width * 4
    none = torch.tensor(expected_sums([None, None, None]))
    ok = checks.scatter_matching(staging, offsets, slots, chunk_of, none, row)
    assert ok.all()


@pytest.mark.parametrize("skip", [0, 3, 8, 13, 21])
@pytest.mark.parametrize("gap", [False, True])
def test_staged_tokens_match_a_token_by_token_reference(skip: int, gap: bool) -> None:
    from types import SimpleNamespace

    bounds = [(0, 8), (8, 16), (16, 21)] if not gap else [(0, 8), (16, 24), (24, 29)]
    chunks = [SimpleNamespace(start=a, end=b) for a, b in bounds]
    mapping = torch.randperm(40, generator=torch.Generator().manual_seed(2))
    positions, counts, tokens, slots = staged_tokens(chunks, mapping, skip)
    want = [i for i, (a, b) in enumerate(bounds) if b > skip]
    ref_tokens = [t for i in want for t in range(*bounds[i])]
    assert positions == want
    assert counts.tolist() == [bounds[i][1] - bounds[i][0] for i in want]
    assert tokens.tolist() == ref_tokens
    assert slots.tolist() == [int(mapping[t]) if t >= skip else -1 for t in ref_tokens]
    assert sorted(mapping.tolist()) == list(range(40))  # the caller's mapping is not written
