# SPDX-License-Identifier: Apache-2.0
"""Each loaded chunk is verified once, and a load with checksums off takes the same kernels.

A hit copied to the device at lookup and verified there keeps the verdicts with the copy. Its
load scatters those bytes without summing them again, and says every chunk matched. A copy that
was not verified at lookup, or a chunk it found bad, is verified as it is scattered. With
checksums off, stores return no sums and loads scatter through the same one-launch kernel.
Every load is compared with the per-layer reference path, byte for byte. On the CPU the fused
path runs on a recording stand-in of a CUDA backend (streams and events); on a GPU on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from lmcache import gpu_ops
from lmcache.config import LMCacheConfig
from lmcache.gpu_connector import EngineInfo, TransferSpec
from lmcache_vllm.transfer.fused.store import FusedStore
from lmcache_vllm.transfer.fused.views import FusedViews
from lmcache_vllm.transfer.paged_connector import VLLMPagedConnector
from lmcache_vllm.transfer.token_transfer import TokenTransfer

from .test_gpu_connector_fastpath import BLOCK, CHUNK, DEVICES, _caches, _md
from .test_verified_scatter import (
    RANGES,
    _bits,
    _checked_conn,
    _on_stand_in_streams,
    _slots,
    _stored,
    chunk_buffers,
)

N = RANGES[-1][1]


@pytest.fixture
def sums_computed(monkeypatch) -> list[int]:
    """Counts the chunks summed by ``checksum_chunks`` (each verified scatter sums its chunks)."""
    counted: list[int] = []
    real = gpu_ops.checksum_chunks

    def _counting(data, offsets, *args, **kwargs):
        counted.append(int(offsets.numel()) - 1)
        return real(data, offsets, *args, **kwargs)

    monkeypatch.setattr(gpu_ops, "checksum_chunks", _counting)
    return counted


def _streams(conn, device: str) -> None:
    if device == "cpu":
        _on_stand_in_streams(conn)


def _reference(kind: str, device: str, seed: int, chunks, spec):
    """The per-layer token path's pages after loading ``chunks`` (no checks)."""
    _, ref = _checked_conn(kind, device, seed)
    ref.transfer = TokenTransfer(ref.cache, ref.backend, ref.device)
    ref.to_gpu(chunks, spec)
    ref.synchronize()
    return [_bits(t) for t in ref.cache.caches]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["lbnhc", "mla"])
@pytest.mark.parametrize("how", ["all", "layer groups"])
def test_a_hit_verified_at_lookup_is_not_summed_again(kind, device, how, sums_computed) -> None:
    md, src = _checked_conn(kind, device, 41)
    chunks = _stored(src, chunk_buffers(src, RANGES, "adjacent"), _slots(N, 42, "cpu"))
    slots = _slots(N, 44, "cpu")
    want = _reference(kind, device, 43, chunks, TransferSpec(slots))
    _, dst = _checked_conn(kind, device, 43)
    _streams(dst, device)
    sums_computed.clear()  # the store's, and the CUDA connectors' warm-ups
    stream = dst.backend.new_stream(dst.device)
    staged = dst.prefetch(chunks, stream)
    assert staged is not None
    assert dst.verify_chunks(chunks, stream, staged) == [True] * len(chunks)
    assert sums_computed == [len(chunks)]  # the lookup's one check
    spec = TransferSpec(slots, staged=staged)
    # the host bytes change after the lookup: the load moves the device copy it verified
    chunks[1].buffer.reshape(-1).view(torch.uint8)[3] ^= 0x40
    if how == "all":
        checks = [dst.to_gpu(chunks, spec)]
    else:
        checks = [
            dst.to_gpu_layers(range(0, 1), chunks, spec),
            dst.to_gpu_layers(range(1, md.num_layers), chunks, spec),
        ]
    dst.synchronize()
    assert sums_computed == [len(chunks)]  # nothing summed at load
    for c in checks:
        assert c is not None and c.verified and c.ok() == [True] * len(chunks)
    got = [_bits(t) for t in dst.cache.caches]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("device", DEVICES)
def test_a_copy_not_verified_at_lookup_is_verified_as_it_is_scattered(
    device, sums_computed
) -> None:
    """A prefetch whose lookup did not verify it (or found a chunk bad: the hit was cut, and a
    load of the uncut chunks comes anyway) is checked in the scatter: the bad chunk is refused."""
    _, src = _checked_conn("lbnhc", device, 51)
    chunks = _stored(src, chunk_buffers(src, RANGES, "adjacent"), _slots(N, 52, "cpu"))
    chunks[0].buffer.reshape(-1).view(torch.uint8)[11] ^= 0x80
    for verify_first in (False, True):
        _, dst = _checked_conn("lbnhc", device, 53)
        _streams(dst, device)
        stream = dst.backend.new_stream(dst.device)
        staged = dst.prefetch(chunks, stream)
        assert staged is not None
        if verify_first:
            assert dst.verify_chunks(chunks, stream, staged) == [False, True, True, True]
        sums_computed.clear()
        spec = TransferSpec(_slots(N, 54, "cpu"), staged=staged)
        checks = dst.to_gpu(chunks, spec)
        dst.synchronize()
        assert sums_computed == [len(chunks)]  # summed in the scatter's pass
        assert checks is not None and checks.ok() == [False, True, True, True]
        want = _reference("lbnhc", device, 53, chunks[1:], spec)
        got = [_bits(t) for t in dst.cache.caches]
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def _conn_off(kind: str, device: str, seed: int) -> VLLMPagedConnector:
    """A fused connector whose configuration turned checksums off."""
    md = _md(kind)
    conn = VLLMPagedConnector(
        LMCacheConfig(chunk_size=CHUNK, checksum=False),
        md,
        EngineInfo("vllm", device, _caches(kind, md, device, seed), {"block_size": BLOCK}),
        {"kv_format": "mla" if kind == "mla" else "kv_concat"},
    )
    _streams(conn, device)
    return conn


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["lbnhc", "mla"])
@pytest.mark.parametrize("skip", [0, 9])
def test_checksums_off_store_no_sums_and_load_by_the_kernel(
    kind, device, skip, monkeypatch, sums_computed
) -> None:
    """``checksum: false`` is honoured by stores (no sums), and loads still take the one-launch
    scatter (as verified loads do), moving the reference's bytes."""
    monkeypatch.setattr(FusedStore, "_by_kernel", lambda self, transfer: True)
    monkeypatch.setattr(gpu_ops, "one_launch_ops", lambda device: True)
    scatters: list[int] = []
    real = gpu_ops.scatter_kv
    monkeypatch.setattr(gpu_ops, "scatter_kv", lambda *a, **k: scatters.append(1) or real(*a, **k))
    src = _conn_off(kind, device, 61)
    sums_computed.clear()  # a CUDA connector's warm-up
    chunks = chunk_buffers(src, RANGES, "scattered")
    assert src.from_gpu(chunks, TransferSpec(_slots(N, 62, "cpu"))) is None
    src.synchronize()
    assert sums_computed == [] and all(c.checksum is None for c in chunks)
    dst = _conn_off(kind, device, 63)
    scatters.clear()  # a CUDA connector's warm-up
    spec = TransferSpec(_slots(N, 64, "cpu"), skip_tokens=skip)
    assert dst.to_gpu(chunks, spec) is not False
    dst.synchronize()
    assert len(scatters) == 1 and sums_computed == []
    want = _reference(kind, device, 63, chunks, spec)
    got = [_bits(t) for t in dst.cache.caches]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("device", DEVICES)
def test_a_store_gathers_on_a_few_sms(device, monkeypatch) -> None:
    """The store's gather runs beside the next forward pass: it is capped to ``gather_sms``."""
    monkeypatch.setattr(FusedStore, "_by_kernel", lambda self, transfer: True)
    caps: list[int] = []
    real = gpu_ops.gather_kv
    monkeypatch.setattr(
        gpu_ops, "gather_kv", lambda *a, **k: caps.append(k.get("max_sms", 0)) or real(*a, **k)
    )
    _, src = _checked_conn("lbnhc", device, 71)
    _streams(src, device)
    _stored(src, chunk_buffers(src, RANGES, "adjacent"), _slots(N, 72, "cpu"))
    assert caps and all(0 < c <= 8 for c in caps)


@pytest.mark.parametrize("device", DEVICES)
def test_a_prefetch_in_pieces_is_checked_piece_by_piece(device, monkeypatch, sums_computed) -> None:
    """A hit copied in pieces of whole chunks is checked piece by piece, each after its own
    copy: the verdicts are those of one check of the whole copy."""
    monkeypatch.setattr(FusedViews, "min_piece_bytes", 1)
    monkeypatch.setattr(FusedViews, "kernel_pieces", 4)
    _, src = _checked_conn("lbnhc", device, 81)
    chunks = _stored(src, chunk_buffers(src, RANGES, "scattered"), _slots(N, 82, "cpu"))
    chunks[2].buffer.reshape(-1).view(torch.uint8)[1] ^= 0x02
    sums_computed.clear()
    _, dst = _checked_conn("lbnhc", device, 83)
    _streams(dst, device)
    sums_computed.clear()  # a CUDA connector's warm-up
    stream = dst.backend.new_stream(dst.device)
    staged = dst.prefetch(chunks, stream)
    assert staged is not None and [stop for stop, _ in staged.chunk_events] == [1, 2, 3, 4]
    assert dst.verify_chunks(chunks, stream, staged) == [True, True, False, True]
    assert sums_computed == [1, 1, 1, 1]
    assert dst.verify_chunks(chunks[:3], stream, staged) == [True, True, False]
