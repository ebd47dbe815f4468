# SPDX-License-Identifier: Apache-2.0
"""The cache engine with a connector that sums chunks "on the device" and verifies loads.

The connector here is a reference model of that contract over a flat CPU cache: a store
returns each chunk's ``lmcache-mix64-sum`` (the reference :func:`chunk_checksum`), and a
load scatters only the chunks whose bytes match the sum they carry. The tests check what the
engine does with it: sums kept with the bytes, no host hashing of those chunks, a bad chunk
reported as not loaded, counted and dropped, and the host backstop for unchecked chunks.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from lmcache.cache_engine import LMCacheEngine
from lmcache.config import LMCacheConfig
from lmcache.gpu_connector.checksums import LoadChecks, StoreChecksums
from lmcache.gpu_connector.interface import (
    ChunkTransfer,
    EngineInfo,
    GPUConnectorInterface,
    SupportsLayerwise,
    TransferSpec,
)
from lmcache.gpu_ops import _ref, chunk_checksum
from lmcache.gpu_ops.mix64sum import signed64
from lmcache.metadata import LMCacheMetadata
from lmcache.tiers import CPUTier

CS, LAYERS, HEADS, HEAD, SLOTS = 16, 2, 2, 4, 256
WIDTH = HEADS * HEAD * 2


class SummingConnector(GPUConnectorInterface, SupportsLayerwise):
    """Flat ``[layers, slots, width]`` cache; sums and verifies chunks like a device would.

    ``mode``: ``"verify"`` (verdicts before the scatter), ``"partial"`` (sums of the layers
    moved, checked by the engine) or ``"none"`` (a load that checked nothing, as when a
    device runs out of staging memory: the engine's host backstop).
    """

    def __init__(self, kv: torch.Tensor, mode: str = "verify") -> None:
        md = LMCacheMetadata(
            "test/model", 1, 0, 0, 1, kv.dtype, LAYERS, HEADS, HEAD, HEAD, chunk_size=CS
        )
        super().__init__(LMCacheConfig(chunk_size=CS), md, EngineInfo("mock", "cuda", [kv]))
        self.kv = kv
        self.mode = mode
        self.host_hashes = 0

    @property
    def verifies_checksums(self) -> bool:
        return True

    @property
    def num_layers(self) -> int:
        return LAYERS

    @property
    def dtype(self) -> torch.dtype:
        return self.kv.dtype

    def from_gpu(
        self, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> StoreChecksums | None:
        for c in chunks:
            c.buffer.copy_(self.kv[:, transfer.slot_mapping[c.start : c.end]])
        sums = [signed64(chunk_checksum(c.buffer)) for c in chunks]
        return StoreChecksums(torch.tensor(sums, dtype=torch.int64))

    def _scatter(self, layers: range, c: ChunkTransfer, t: TransferSpec) -> None:
        lo = max(c.start, t.skip_tokens)
        if lo < c.end:
            src = c.buffer[layers.start : layers.stop, lo - c.start :]
            self.kv[layers.start : layers.stop, t.slot_mapping[lo : c.end]] = src

    def _load(
        self, layers: range, chunks: Sequence[ChunkTransfer], t: TransferSpec
    ) -> LoadChecks | None:
        if self.mode == "verify" and len(layers) == LAYERS:
            ok = [c.checksum is None or chunk_checksum(c.buffer) == c.checksum for c in chunks]
            for c, good in zip(chunks, ok, strict=True):
                if good:
                    self._scatter(layers, c, t)
            return LoadChecks(range(len(chunks)), ok=torch.tensor(ok))
        for c in chunks:
            self._scatter(layers, c, t)
        if self.mode == "none":
            return None
        sums = [signed64(_layers_sum(c.buffer, layers)) for c in chunks]
        return LoadChecks(range(len(chunks)), sums=torch.tensor(sums), layers=layers)

    def to_gpu(self, chunks: Sequence[ChunkTransfer], transfer: TransferSpec) -> LoadChecks | None:
        return self._load(range(LAYERS), chunks, transfer)

    layer_sums = False
    """Whether a layerwise store returns the sums of each layer's bytes."""

    def from_gpu_layer(
        self, layer: int, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> StoreChecksums | None:
        for c in chunks:
            c.buffer[layer] = self.kv[layer, transfer.slot_mapping[c.start : c.end]]
        if not self.layer_sums:
            return None
        sums = [signed64(_layers_sum(c.buffer, range(layer, layer + 1))) for c in chunks]
        return StoreChecksums(torch.tensor(sums, dtype=torch.int64))

    def to_gpu_layer(
        self, layer: int, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> LoadChecks | None:
        return self._load(range(layer, layer + 1), chunks, transfer)


def _layers_sum(buf: torch.Tensor, layers: range) -> int:
    """The terms of the sum that ``layers`` of ``buf`` contribute (the length term with layer
    0), as the kernels split it: the definition's words keep their place in the chunk."""
    data = buf.reshape(-1).view(torch.uint8)
    per_layer = data.numel() // buf.shape[0]
    lo, hi = layers.start * per_layer, layers.stop * per_layer
    part = _ref._word_sum(data[lo:hi], lo // 8 + 1)
    if layers.start == 0:
        part += _ref.mix64(data.numel())
    return part % (1 << 64)


def _engine(connector: SummingConnector) -> LMCacheEngine:
    return LMCacheEngine(LMCacheConfig(chunk_size=CS), connector.metadata, connector)


def _kv(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYERS, SLOTS, WIDTH, generator=g).to(torch.bfloat16)


def _entries(engine: LMCacheEngine) -> list:
    assert isinstance(engine.tier, CPUTier)
    return list(engine.tier._entries.values())


@pytest.mark.parametrize("mode", ["verify", "partial", "none"])
def test_stored_sums_travel_with_the_bytes_and_catch_a_flipped_bit(mode: str) -> None:
    src = SummingConnector(_kv(0), mode)
    engine = _engine(src)
    tokens = list(range(3 * CS))
    slots = torch.arange(3 * CS) * 2
    assert engine.store(tokens, None, TransferSpec(slots)) == 3 * CS
    entries = _entries(engine)
    assert len(entries) == 3
    for e in entries:  # the device's sum is kept; the host computed none of its own
        assert e.checksum is None
        assert e.lease.checksum == chunk_checksum(e.lease.tensor)
    bad = entries[1].lease
    bad.tensor.view(-1).view(torch.uint8)[5] ^= 0x04  # one bit of chunk 1

    dst = torch.full_like(src.kv, 7.0)
    src.kv = dst
    out_slots = torch.arange(3 * CS) + 100
    if mode == "verify" or mode == "none":
        mask = engine.retrieve(tokens, None, TransferSpec(out_slots))
    else:
        r = engine.retrieve_layerwise(tokens, None, TransferSpec(out_slots))
        for layer in range(LAYERS):
            r.load_layer(layer)
        mask = r.finish()
    expected = torch.ones(3 * CS, dtype=torch.bool)
    expected[CS : 2 * CS] = False
    assert torch.equal(mask, expected)
    assert engine.metrics.value("checksum_failures") == 1
    assert len(_entries(engine)) == 2  # the bad chunk is dropped
    src_kv = _kv(0)
    for t in (0, 2 * CS):  # good chunks are loaded bit for bit
        got = dst[:, out_slots[t : t + CS]]
        assert torch.equal(got, src_kv[:, slots[t : t + CS]])
    if mode == "verify":  # the bad one never reached the pages
        assert torch.all(dst[:, out_slots[CS : 2 * CS]] == 7.0)


def test_checksum_false_keeps_no_sums() -> None:
    src = SummingConnector(_kv(1))
    md = src.metadata
    engine = LMCacheEngine(LMCacheConfig(chunk_size=CS, checksum=False), md, src)
    engine.store(list(range(CS)), None, TransferSpec(torch.arange(CS)))
    (entry,) = _entries(engine)
    assert entry.checksum is None and entry.lease.checksum is None


def test_default_is_on_for_a_connector_that_sums_on_the_device() -> None:
    cfg = LMCacheConfig()
    assert cfg.checksum_for("cuda", True) is True
    assert cfg.checksum_for("cuda", False) is False
    assert cfg.checksum_for("cpu", False) is True


def test_a_hit_verified_at_lookup_is_cut_before_its_first_bad_chunk() -> None:
    src = SummingConnector(_kv(2))
    engine = _engine(src)
    tokens = list(range(4 * CS))
    engine.store(tokens, None, TransferSpec(torch.arange(4 * CS)))
    hit = engine.lookup_and_lease(tokens)
    assert hit.num_tokens == 4 * CS
    sums = hit.checksums()
    tensors = hit.tensors()
    assert sums == [chunk_checksum(t) for t in tensors]
    tensors[2].view(-1).view(torch.uint8)[0] ^= 1
    ok = [chunk_checksum(t) == s for t, s in zip(tensors, sums, strict=True)]
    assert ok == [True, True, False, True]
    engine.cut_held_hit(hit, ok)
    assert (hit.num_tokens, len(hit)) == (2 * CS, 2)
    assert engine.metrics.value("checksum_failures") == 1
    assert len(_entries(engine)) == 3  # the bad chunk left the tier; the one after it stays
    hit.release()
    assert engine.lookup(tokens) == 2 * CS


@pytest.mark.parametrize("layer_sums", [True, False])
def test_a_layerwise_store_adds_up_the_layers_sums(layer_sums: bool) -> None:
    """A layerwise store whose every layer came with its sums keeps their total as each
    chunk's checksum (equal to the sum of its bytes) and hashes nothing on the host; without
    them the engine hashes the chunks itself. Either way a flipped bit is caught at load."""
    src = SummingConnector(_kv(4))
    src.layer_sums = layer_sums
    engine = _engine(src)
    tokens = list(range(2 * CS))
    slots = torch.arange(2 * CS) * 3
    store = engine.store_layerwise(tokens, None, TransferSpec(slots))
    for layer in range(LAYERS):
        store.store_layer(layer)
    assert store.finish() == 2 * CS
    entries = _entries(engine)
    assert len(entries) == 2
    for e in entries:
        if layer_sums:
            assert e.checksum is None
            assert e.lease.checksum == chunk_checksum(e.lease.tensor)
        else:
            assert e.lease.checksum is None and e.checksum is not None
    entries[0].lease.tensor.view(-1).view(torch.uint8)[3] ^= 0x01
    src.kv = torch.zeros_like(src.kv)
    mask = engine.retrieve(tokens, None, TransferSpec(torch.arange(2 * CS)))
    assert not bool(mask[:CS].any())  # the bad chunk is not loaded
    assert torch.all(src.kv[:, :CS] == 0)
    assert engine.metrics.value("checksum_failures") == 1


def test_a_packed_index_splits_back_into_its_parts() -> None:
    from lmcache.gpu_connector.checksums import expected_sums, pack_index, split_index

    counts, slots = [3, 1, 2], torch.tensor([7, 8, 9, -1, 4, 5])
    sums = [5, None, (1 << 64) - 1]
    packed = pack_index(counts, slots, sums)
    assert packed.dtype == torch.int64
    offsets, got_slots, chunk_of, expected = split_index(packed, 3, 6)
    assert offsets.tolist() == [0, 3, 4, 6]
    assert torch.equal(got_slots, slots)
    assert chunk_of.tolist() == [0, 0, 0, 1, 2, 2]
    assert expected.tolist() == expected_sums(sums) == [5, 0, -1, 1, 0, 1]
