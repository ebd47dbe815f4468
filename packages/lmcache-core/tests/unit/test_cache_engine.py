# SPDX-License-Identifier: Apache-2.0
"""LMCacheEngine against a reference paged CPU connector (torch index ops).

The test connector's "engine cache" is a flat ``[num_layers, num_slots, kv_width]`` tensor; a
request's token ``t`` lives in slot ``slot_mapping[t]``. Stores gather from one cache, retrieves
scatter into a second, poisoned cache with different slots, and the tests compare bits.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

import pytest
import torch

from lmcache.cache_engine import LMCacheEngine
from lmcache.config import LMCacheConfig
from lmcache.gpu_connector.interface import (
    ChunkTransfer,
    EngineInfo,
    GPUConnectorInterface,
    SupportsLayerwise,
    TransferSpec,
)
from lmcache.keys import chunk_keys
from lmcache.metadata import LMCacheMetadata
from lmcache.metrics import LMCacheMetrics

CS = 16  # chunk size
LAYERS, HEADS, HEAD = 2, 2, 4
WIDTH = HEADS * HEAD * 2
SLOTS = 512
DTYPE = torch.bfloat16
CHUNK_BYTES = LAYERS * CS * WIDTH * 2


class FlatConnector(GPUConnectorInterface):
    """Reference connector over a flat ``[num_layers, num_slots, kv_width]`` CPU cache."""

    def __init__(self, config: LMCacheConfig, metadata: LMCacheMetadata, kv: torch.Tensor) -> None:
        super().__init__(config, metadata, EngineInfo("mock", "cpu", [kv]))
        self.kv = kv
        self.calls: Counter[str] = Counter()
        self.chunks_seen: list[int] = []
        self.fail_next: str | None = None

    @property
    def num_layers(self) -> int:
        return int(self.kv.shape[0])

    @property
    def kv_width(self) -> int:
        return int(self.kv.shape[2])

    @property
    def dtype(self) -> torch.dtype:
        return self.kv.dtype

    def _record(self, name: str, chunks: Sequence[ChunkTransfer]) -> None:
        self.calls[name] += 1
        self.chunks_seen.append(len(chunks))
        if self.fail_next == name:
            self.fail_next = None
            raise RuntimeError(f"injected {name} failure")

    def _gather(self, layers: slice, chunks: Sequence[ChunkTransfer], t: TransferSpec) -> None:
        for c in chunks:
            assert c.buffer.shape == self.chunk_shape(c.num_tokens)
            c.buffer[layers] = self.kv[layers][:, t.slot_mapping[c.start : c.end]]

    def _scatter(self, layers: slice, chunks: Sequence[ChunkTransfer], t: TransferSpec) -> None:
        for c in chunks:
            lo = max(c.start, t.skip_tokens)
            if lo < c.end:
                dst = self.kv[layers]
                dst[:, t.slot_mapping[lo : c.end]] = c.buffer[layers][:, lo - c.start :]

    def from_gpu(self, chunks: Sequence[ChunkTransfer], transfer: TransferSpec) -> None:
        self._record("from_gpu", chunks)
        self._gather(slice(None), chunks, transfer)

    def to_gpu(self, chunks: Sequence[ChunkTransfer], transfer: TransferSpec) -> None:
        self._record("to_gpu", chunks)
        self._scatter(slice(None), chunks, transfer)

    def synchronize(self) -> None:
        self.calls["synchronize"] += 1


class LayerwiseFlatConnector(FlatConnector, SupportsLayerwise):
    def from_gpu_layer(
        self, layer: int, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> None:
        self._record("from_gpu_layer", chunks)
        self._gather(slice(layer, layer + 1), chunks, transfer)

    def to_gpu_layer(
        self, layer: int, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> None:
        self._record("to_gpu_layer", chunks)
        self._scatter(slice(layer, layer + 1), chunks, transfer)


def _metadata() -> LMCacheMetadata:
    return LMCacheMetadata(
        "test/model", 1, 0, 0, 1, DTYPE, LAYERS, HEADS, HEAD, HEAD, chunk_size=CS
    )


def _poisoned() -> torch.Tensor:
    return torch.full((LAYERS, SLOTS, WIDTH), float("nan"), dtype=DTYPE)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


class Setup:
    """An engine, a random source cache and a poisoned destination cache."""

    def __init__(self, seed: int = 0, *, layerwise: bool = False, **config: object) -> None:
        torch.manual_seed(seed)
        self.config = LMCacheConfig(chunk_size=CS, **config)  # type: ignore[arg-type]
        self.src = torch.randn(LAYERS, SLOTS, WIDTH).to(DTYPE)
        self.dst = _poisoned()
        cls = LayerwiseFlatConnector if layerwise else FlatConnector
        self.conn = cls(self.config, _metadata(), self.src)
        self.engine = LMCacheEngine(self.config, _metadata(), self.conn)

    def request(self, n: int, seed: int = 1) -> tuple[torch.Tensor, TransferSpec, TransferSpec]:
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, 50_000, (n,), generator=g)
        src_slots = torch.randperm(SLOTS, generator=g)[:n]
        dst_slots = torch.randperm(SLOTS, generator=g)[:n]
        return tokens, TransferSpec(src_slots), TransferSpec(dst_slots)

    def to_dst(self) -> None:
        self.conn.kv = self.dst

    def check_loaded(self, src: TransferSpec, dst: TransferSpec, loaded: torch.Tensor) -> None:
        """dst holds src's bits exactly for ``loaded`` tokens; every other slot is still NaN."""
        want = _poisoned()
        idx = loaded.nonzero().flatten()
        want[:, dst.slot_mapping[idx]] = self.src[:, src.slot_mapping[idx]]
        assert torch.equal(_bits(self.dst), _bits(want))


def _mask(n: int, masked: int) -> torch.Tensor:
    mask = torch.ones(n, dtype=torch.bool)
    mask[:masked] = False
    return mask


def _expected_mask(n: int, lo: int, hi: int) -> torch.Tensor:
    mask = torch.zeros(n, dtype=torch.bool)
    mask[lo:hi] = True
    return mask


@pytest.mark.parametrize("seed", range(6))
def test_store_retrieve_bit_exact_random(seed: int) -> None:
    rng = random.Random(seed)
    unfull = rng.random() < 0.5
    s = Setup(seed, save_unfull_chunk=unfull)
    n = rng.randint(1, 120)
    tokens, src, dst = s.request(n, seed)
    stored_end = n if unfull else n // CS * CS
    assert s.engine.store(tokens, None, src) == stored_end
    assert s.engine.lookup(tokens) == stored_end
    s.to_dst()
    masked = rng.randint(0, n // CS) * CS
    loaded = s.engine.retrieve(tokens, _mask(n, masked), dst)
    assert torch.equal(loaded, _expected_mask(n, masked, stored_end))
    s.check_loaded(src, dst, loaded)


def test_store_with_masked_prefix_then_fill_the_gap() -> None:
    s = Setup()
    tokens, src, dst = s.request(4 * CS)
    assert s.engine.store(tokens, _mask(4 * CS, CS), src) == 3 * CS
    assert s.engine.lookup(tokens) == 0  # chunk 0 missing: no prefix
    assert s.conn.chunks_seen == [3]
    s.to_dst()
    loaded = s.engine.retrieve(tokens, _mask(4 * CS, CS), dst)  # chunk 0 masked: not needed
    assert torch.equal(loaded, _expected_mask(4 * CS, CS, 4 * CS))
    s.check_loaded(src, dst, loaded)
    s.conn.kv = s.src
    assert s.engine.store(tokens, None, src) == CS  # only chunk 0 is new
    assert s.conn.chunks_seen == [3, 3, 1]
    assert s.engine.lookup(tokens) == 4 * CS
    s.dst = _poisoned()
    s.to_dst()
    loaded = s.engine.retrieve(tokens, None, dst)
    assert bool(loaded.all())
    s.check_loaded(src, dst, loaded)


def test_already_present_chunks_are_not_restored() -> None:
    s = Setup()
    tokens, src, _ = s.request(3 * CS)
    assert s.engine.store(tokens, None, src) == 3 * CS
    assert s.engine.store(tokens, None, src) == 0
    assert s.conn.calls["from_gpu"] == 1
    assert len(s.engine.tier) == 3


def test_partial_chunk_only_with_save_unfull_chunk() -> None:
    n = 2 * CS + 5
    for unfull, end in ((False, 2 * CS), (True, n)):
        s = Setup(save_unfull_chunk=unfull)
        tokens, src, dst = s.request(n)
        assert s.engine.store(tokens, None, src) == end
        assert s.engine.lookup(tokens) == end
        assert s.engine.lookup(tokens[: 2 * CS]) == 2 * CS
        s.to_dst()
        loaded = s.engine.retrieve(tokens, None, dst)
        assert torch.equal(loaded, _expected_mask(n, 0, end))
        s.check_loaded(src, dst, loaded)


def test_a_gap_ends_the_prefix() -> None:
    s = Setup(cache_salt="tenant")
    tokens, src, dst = s.request(4 * CS)
    s.engine.store(tokens, None, src, salt="req")
    keys = chunk_keys(tokens, _metadata().fingerprint(), CS, salt="tenant\0req")
    assert all(s.engine.tier.contains(k) for k in keys)
    assert s.engine.tier.remove(keys[2])
    assert s.engine.lookup(tokens, salt="req") == 2 * CS
    s.to_dst()
    loaded = s.engine.retrieve(tokens, None, dst, salt="req")
    assert torch.equal(loaded, _expected_mask(4 * CS, 0, 2 * CS))
    s.check_loaded(src, dst, loaded)


def test_salts_isolate() -> None:
    s = Setup()
    tokens, src, _ = s.request(2 * CS)
    s.engine.store(tokens, None, src, salt="a")
    assert s.engine.lookup(tokens, salt="a") == 2 * CS
    assert s.engine.lookup(tokens, salt="b") == 0
    assert s.engine.lookup(tokens) == 0
    other = LMCacheEngine(LMCacheConfig(chunk_size=CS, cache_salt="x"), _metadata())
    other.tier = s.engine.tier  # same chunks, different config salt
    assert other.lookup(tokens, salt="a") == 0


def test_skip_tokens_are_left_untouched() -> None:
    s = Setup()
    tokens, src, dst = s.request(3 * CS)
    s.engine.store(tokens, None, src)
    s.to_dst()
    skip = CS + 5
    spec = TransferSpec(dst.slot_mapping, skip_tokens=skip)
    loaded = s.engine.retrieve(tokens, _mask(3 * CS, CS), spec)
    assert torch.equal(loaded, _expected_mask(3 * CS, CS, 3 * CS))
    written = loaded.clone()
    written[:skip] = False
    s.check_loaded(src, dst, written)  # the skipped tokens' slots are still NaN


def test_out_of_memory_stores_leading_chunks_only() -> None:
    budget = 2 * CHUNK_BYTES + CHUNK_BYTES // 2
    s = Setup(max_local_cpu_size=budget / 1024**3)
    assert s.engine.pool.budget_bytes == budget
    tokens, src, dst = s.request(4 * CS)
    assert s.engine.store(tokens, None, src) == 2 * CS
    assert s.engine.metrics.value("failed_allocations") == 1
    assert s.conn.chunks_seen == [2]
    assert s.engine.lookup(tokens) == 2 * CS
    s.to_dst()
    loaded = s.engine.retrieve(tokens, None, dst)
    assert torch.equal(loaded, _expected_mask(4 * CS, 0, 2 * CS))
    s.check_loaded(src, dst, loaded)


def test_store_evicts_older_requests_not_its_own_prefix() -> None:
    s = Setup(max_local_cpu_size=3 * CHUNK_BYTES / 1024**3)
    old, old_src, _ = s.request(2 * CS, seed=1)
    new, new_src, _ = s.request(3 * CS, seed=2)
    s.engine.store(old, None, old_src)
    s.engine.store(new[:CS], None, TransferSpec(new_src.slot_mapping[:CS]))  # new's chunk 0
    s.engine.lookup(old)  # touches old's chunks: new's chunk 0 is the LRU
    assert s.engine.store(new, None, new_src) == 2 * CS
    assert s.engine.lookup(new) == 3 * CS  # its own present chunk 0 was kept
    assert s.engine.lookup(old) == 0
    assert s.engine.metrics.value("evicted_chunks") == 2


def test_corrupted_chunk_is_a_miss_and_never_loaded() -> None:
    s = Setup()
    tokens, src, dst = s.request(3 * CS)
    s.engine.store(tokens, None, src)
    keys = chunk_keys(tokens, _metadata().fingerprint(), CS, salt="\0")
    lease = s.engine.tier.get(keys[1])
    assert lease is not None
    with lease:
        lease.tensor.view(torch.uint8).reshape(-1)[123] ^= 0x01
    s.to_dst()
    loaded = s.engine.retrieve(tokens, None, dst)
    assert torch.equal(loaded, _expected_mask(3 * CS, 0, CS))
    s.check_loaded(src, dst, loaded)
    assert s.engine.metrics.value("checksum_failures") == 1
    assert s.engine.lookup(tokens) == CS  # the corrupted entry was dropped


def test_one_batched_transfer_per_store_and_retrieve() -> None:
    s = Setup()
    tokens, src, dst = s.request(5 * CS + 3)
    s.engine.store(tokens, None, src)
    s.to_dst()
    s.engine.retrieve(tokens, None, dst)
    assert s.conn.calls == Counter(from_gpu=1, to_gpu=1, synchronize=1)
    assert s.conn.chunks_seen == [5, 5]
    s.engine.retrieve(tokens[: CS - 1], None, TransferSpec(dst.slot_mapping[: CS - 1]))
    assert s.conn.calls["to_gpu"] == 1  # nothing to load: no call


def test_layerwise_matches_non_layerwise() -> None:
    n = 4 * CS + 7
    s = Setup(layerwise=True, save_unfull_chunk=True)
    tokens, src, dst = s.request(n)
    op = s.engine.store_layerwise(tokens, _mask(n, CS), src)
    assert op.num_tokens == n - CS
    assert s.engine.lookup(tokens[CS:]) == 0  # nothing visible before finish
    for layer in range(LAYERS):
        op.store_layer(layer)
    assert op.finish() == n - CS
    assert s.engine.store(tokens, None, src) == CS
    assert s.conn.calls["from_gpu_layer"] == LAYERS and s.conn.calls["from_gpu"] == 1

    s.to_dst()
    ret = s.engine.retrieve_layerwise(tokens, _mask(n, CS), dst)
    assert ret.num_hit_tokens == n - CS
    for layer in range(LAYERS):
        ret.load_layer(layer)
    loaded = ret.finish()
    assert torch.equal(loaded, _expected_mask(n, CS, n))
    assert s.conn.calls["to_gpu_layer"] == LAYERS
    s.check_loaded(src, dst, loaded)
    layerwise_dst = s.dst.clone()

    s.dst = _poisoned()
    s.to_dst()
    assert torch.equal(s.engine.retrieve(tokens, _mask(n, CS), dst), loaded)
    assert torch.equal(_bits(s.dst), _bits(layerwise_dst))
    partial_bytes = -(-LAYERS * 7 * WIDTH * 2 // 256) * 256  # rounded up to the pool alignment
    assert s.engine.pool.used_bytes == 4 * CHUNK_BYTES + partial_bytes  # only the tier's leases


def test_layerwise_misuse() -> None:
    s = Setup(layerwise=True)
    tokens, src, _ = s.request(2 * CS)
    op = s.engine.store_layerwise(tokens, None, src)
    with pytest.raises(ValueError, match="expected layer 0, found 1"):
        op.store_layer(1)
    op.store_layer(0)
    with pytest.raises(RuntimeError, match="1 of 2 layers"):
        op.finish()
    assert s.engine.pool.used_bytes == 0 and s.engine.lookup(tokens) == 0
    with pytest.raises(RuntimeError, match="aborted"):
        op.store_layer(1)

    plain = Setup()
    with pytest.raises(TypeError, match="SupportsLayerwise"):
        plain.engine.retrieve_layerwise(tokens, None, src)


def test_validation_errors() -> None:
    s = Setup()
    tokens, src, _ = s.request(3 * CS)
    bad_masks = {
        "prefix": torch.tensor([True] * CS + [False] * CS + [True] * CS),
        "multiple of": _mask(3 * CS, 5),
        "bool tensor": torch.ones(3 * CS, dtype=torch.int64),
        r"\[num_tokens=48\]": _mask(2 * CS, 0),
    }
    for match, mask in bad_masks.items():
        with pytest.raises(ValueError, match=match):
            s.engine.store(tokens, mask, src)
        with pytest.raises(ValueError, match=match):
            s.engine.retrieve(tokens, mask, src)
    with pytest.raises(ValueError, match="slot_mapping"):
        s.engine.store(tokens, None, TransferSpec(src.slot_mapping[:-1]))
    assert s.engine.store(tokens, _mask(3 * CS, 3 * CS), src) == 0  # all masked: fine
    assert s.conn.calls["from_gpu"] == 0


def test_construction_errors_and_missing_connector() -> None:
    config = LMCacheConfig(chunk_size=CS)
    with pytest.raises(ValueError, match="chunk_size"):
        LMCacheEngine(LMCacheConfig(chunk_size=2 * CS), _metadata())
    wrong = FlatConnector(config, _metadata(), torch.zeros(LAYERS + 1, 8, WIDTH, dtype=DTYPE))
    with pytest.raises(ValueError, match="num_layers, kv_width, dtype"):
        LMCacheEngine(config, _metadata(), wrong)
    engine = LMCacheEngine(config, _metadata())
    tokens = list(range(2 * CS))
    spec = TransferSpec(torch.arange(2 * CS))
    assert engine.lookup(tokens) == 0
    with pytest.raises(RuntimeError, match="needs a GPU connector"):
        engine.retrieve(tokens, None, spec)
    with pytest.raises(RuntimeError, match="needs a GPU connector"):
        engine.store(tokens, None, spec)


def test_connector_errors_raise_and_leak_nothing() -> None:
    s = Setup()
    tokens, src, dst = s.request(3 * CS)
    s.conn.fail_next = "from_gpu"
    with pytest.raises(RuntimeError, match="injected from_gpu"):
        s.engine.store(tokens, None, src)
    assert s.engine.pool.used_bytes == 0 and len(s.engine.tier) == 0
    s.engine.store(tokens, None, src)
    s.to_dst()
    s.conn.fail_next = "to_gpu"
    with pytest.raises(RuntimeError, match="injected to_gpu"):
        s.engine.retrieve(tokens, None, dst)
    assert s.conn.calls["synchronize"] == 1  # waited before releasing the buffers
    assert s.engine.pool.used_bytes == 3 * CHUNK_BYTES
    s.engine.clear()
    assert s.engine.pool.used_bytes == 0  # no lease outlived the failed retrieve


def test_failing_tier_is_a_counted_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    s = Setup()
    tokens, src, dst = s.request(2 * CS)
    s.engine.store(tokens, None, src)

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError("tier down")

    for method in ("get", "get_many", "contains", "missing", "touch", "touch_many"):
        monkeypatch.setattr(s.engine.tier, method, broken)
    assert s.engine.lookup(tokens) == 0
    with s.engine.lookup_and_lease(tokens) as hit:
        assert hit.num_tokens == 0 and hit.keys == []
    s.to_dst()
    assert not bool(s.engine.retrieve(tokens, None, dst).any())
    assert s.engine.metrics.value("tier_errors") == 3  # one per call: each stops at chunk 0
    assert s.conn.calls["to_gpu"] == 0


def test_metrics_and_close() -> None:
    s = Setup()
    tokens, src, dst = s.request(3 * CS)
    s.engine.store(tokens, None, src)
    assert s.engine.lookup(tokens) == 3 * CS
    assert s.engine.lookup(tokens[: 2 * CS]) == 2 * CS
    s.to_dst()
    s.engine.retrieve(tokens, None, dst)
    m = s.engine.metrics
    assert m.value("lookup_requests") == 2
    assert m.value("lookup_tokens") == 5 * CS
    assert m.value("hit_tokens") == 5 * CS
    assert m.value("stored_chunks") == 3 and m.value("loaded_chunks") == 3
    assert m.value("stored_bytes") == 3 * CHUNK_BYTES == m.value("loaded_bytes")
    assert m.value("store_seconds") == 1 and m.value("retrieve_seconds") == 1
    s.engine.close()
    s.engine.close()
    assert s.engine.pool.used_bytes == 0
    with pytest.raises(RuntimeError, match="closed"):
        s.engine.retrieve(tokens, None, dst)


def test_process_tier_is_shared_by_a_fresh_engine_and_survives_close() -> None:
    from lmcache.tiers import process_cpu_tier, reset_process_cpu_tiers

    reset_process_cpu_tiers()
    try:
        config = LMCacheConfig(chunk_size=CS, max_local_cpu_size=0.01)
        src = torch.randn(LAYERS, SLOTS, WIDTH).to(DTYPE)
        first = LMCacheEngine(
            config,
            _metadata(),
            FlatConnector(config, _metadata(), src),
            tier=process_cpu_tier(config, LMCacheMetrics()),
        )
        tokens = torch.randint(0, 50_000, (3 * CS,))
        slots = torch.randperm(SLOTS)[: 3 * CS]
        assert first.store(tokens, None, TransferSpec(slots)) == 3 * CS
        first.close()  # the engine goes away; the process tier keeps its chunks

        dst = _poisoned()
        second = LMCacheEngine(
            config,
            _metadata(),
            FlatConnector(config, _metadata(), dst),
            tier=process_cpu_tier(config, LMCacheMetrics()),
        )
        assert second.tier is first.tier
        assert second.lookup(tokens) == 3 * CS
        dst_slots = torch.randperm(SLOTS)[: 3 * CS]
        loaded = second.retrieve(tokens, None, TransferSpec(dst_slots))
        assert bool(loaded.all())
        assert torch.equal(_bits(dst[:, dst_slots]), _bits(src[:, slots]))
        # A private engine does not see the shared chunks.
        private = LMCacheEngine(config, _metadata(), FlatConnector(config, _metadata(), dst))
        assert private.lookup(tokens) == 0
    finally:
        reset_process_cpu_tiers()


def test_copy_out_then_commit_in_two_halves() -> None:
    """copy_out copies the pages (which may be overwritten right after) and publishes nothing;
    commit publishes exactly the bytes copied; abort publishes nothing and frees the buffers."""
    s = Setup(3)
    tokens, src, dst = s.request(64)
    expected = s.src.clone()
    staged = s.engine.copy_out(tokens, None, src)
    assert staged.num_tokens == 64
    assert s.engine.lookup(tokens) == 0  # not visible before commit
    s.src.fill_(7)  # the engine reuses its pages as soon as copy_out returned
    assert staged.commit() == 64
    with pytest.raises(RuntimeError, match="already"):
        staged.commit()
    assert s.engine.lookup(tokens) == 64
    s.src.copy_(expected)  # check_loaded compares against the original source bytes
    s.to_dst()
    s.check_loaded(src, dst, s.engine.retrieve(tokens, None, dst))

    other, src2, _ = s.request(32, seed=9)
    used = s.engine.pool.used_bytes
    aborted = s.engine.copy_out(other, None, src2)
    assert s.engine.pool.used_bytes == used + 2 * CHUNK_BYTES
    aborted.abort()
    assert s.engine.pool.used_bytes == used and s.engine.lookup(other) == 0


class PreparingConnector(FlatConnector):
    """A connector with ``prepare_store``: records what it prepared and what ``from_gpu`` got."""

    def __init__(self, config: LMCacheConfig, metadata: LMCacheMetadata, kv: torch.Tensor) -> None:
        super().__init__(config, metadata, kv)
        self.prepared: list[tuple[list[ChunkTransfer], torch.Tensor]] = []
        self.copied: list[tuple[list[ChunkTransfer], object]] = []

    def prepare_store(self, chunks: Sequence[ChunkTransfer], transfer: TransferSpec) -> object:
        self.prepared.append((list(chunks), transfer.slot_mapping))
        return ("plan", len(self.prepared))

    def from_gpu(self, chunks: Sequence[ChunkTransfer], transfer: TransferSpec) -> None:
        self.copied.append((list(chunks), transfer.prepared))
        super().from_gpu(chunks, transfer)


def test_plan_store_then_copy_out_reads_the_engine_at_copy_time() -> None:
    """plan_store leases buffers and lets the connector prepare before the KV exists; the bytes
    stored are the engine's at copy_out (the forward wrote them after the plan), the connector
    gets its own prepared object back with the same chunks, and nothing is visible before
    commit. A wrong slot mapping, a second copy and abort behave as documented."""
    s = Setup(11)
    s.conn = PreparingConnector(s.config, _metadata(), s.src)
    s.engine = LMCacheEngine(s.config, _metadata(), s.conn)
    tokens, src, dst = s.request(80)  # full chunks + a partial one
    written = s.src.clone()
    s.src.fill_(3.0)  # the pages before the forward wrote this request's KV
    planned = s.engine.plan_store(tokens, None, src)
    assert planned.num_tokens == 80 and s.engine.lookup(tokens) == 0
    assert len(s.conn.prepared) == 1 and s.conn.prepared[0][1] is src.slot_mapping
    assert s.conn.calls["from_gpu"] == 0  # nothing read from the engine yet
    with pytest.raises(ValueError, match="slot mapping"):
        planned.copy_out(TransferSpec(src.slot_mapping.clone()))
    s.src.copy_(written)  # the forward wrote the KV
    staged = planned.copy_out(src)
    chunks, prepared = s.conn.copied[0]
    assert prepared == ("plan", 1)
    assert [(c.start, c.end) for c in chunks] == [(i, min(i + CS, 80)) for i in range(0, 80, CS)]
    assert [c.buffer.data_ptr() for c in chunks] == [
        c.buffer.data_ptr() for c in s.conn.prepared[0][0]
    ]
    with pytest.raises(RuntimeError, match="already"):
        planned.copy_out(src)
    assert s.engine.lookup(tokens) == 0
    assert staged.commit() == 80 and s.engine.lookup(tokens) == 80
    s.to_dst()
    s.check_loaded(src, dst, s.engine.retrieve(tokens, None, dst))

    other, src2, _ = s.request(64, seed=21)
    used = s.engine.pool.used_bytes
    dropped = s.engine.plan_store(other, None, src2)
    assert s.engine.pool.used_bytes == used + 4 * CHUNK_BYTES
    dropped.abort()
    dropped.abort()  # idempotent
    assert s.engine.pool.used_bytes == used and s.engine.lookup(other) == 0
    with pytest.raises(RuntimeError, match="aborted"):
        dropped.copy_out()


def test_plan_store_copy_failure_releases_the_buffers() -> None:
    """A connector error in copy_out is raised and the planned buffers go back to the pool."""
    s = Setup(12)
    tokens, src, _ = s.request(64)
    used = s.engine.pool.used_bytes
    planned = s.engine.plan_store(tokens, None, src)
    s.conn.fail_next = "from_gpu"
    with pytest.raises(RuntimeError, match="injected from_gpu"):
        planned.copy_out()
    assert s.engine.pool.used_bytes == used and s.engine.lookup(tokens) == 0


def test_a_store_batch_copies_several_requests_in_one_connector_call() -> None:
    """batch_stores lays the chunks of several planned stores over one slot mapping: the
    connector prepares once and copies once, and every request loads back bit for bit (one
    with a masked prefix, one already stored: nothing to copy, one whose partial last chunk is not saved)."""
    s = Setup(13)
    s.conn = PreparingConnector(s.config, _metadata(), s.src)
    s.engine = LMCacheEngine(s.config, _metadata(), s.conn)
    t1, src1, dst1 = s.request(64, seed=31)
    t2, src2, dst2 = s.request(72, seed=32)
    t3, src3, _ = s.request(32, seed=33)
    s.engine.store(t3, None, src3)  # already stored: its planned store leases nothing
    calls = s.conn.calls["from_gpu"]
    s.conn.prepared.clear()
    planned = [
        s.engine.plan_store(t1, _mask(64, CS), src1, prepare=False),
        s.engine.plan_store(t3, None, src3, prepare=False),
        s.engine.plan_store(t2, None, src2, prepare=False),
    ]
    assert [p.num_tokens for p in planned] == [64 - CS, 0, 64] and s.conn.prepared == []
    batch = s.engine.batch_stores(planned)
    assert batch.num_tokens == 64 - CS + 64
    ((chunks, slots),) = s.conn.prepared
    assert slots.numel() == 64 - CS + 64  # each store's slots over its chunks
    assert [(c.start, c.end) for c in chunks] == [(i, i + CS) for i in range(0, 64 - CS + 64, CS)]
    assert torch.equal(slots[: 64 - CS], src1.slot_mapping[CS:64])
    assert torch.equal(slots[64 - CS :], src2.slot_mapping[:64])
    with pytest.raises(ValueError, match="prepare=False"):
        s.engine.batch_stores([s.engine.plan_store(t2, None, src2)])
    staged = batch.copy_out(TransferSpec(torch.empty(0, dtype=torch.long)))
    assert s.conn.calls["from_gpu"] == calls + 1
    assert s.conn.copied[-1][1] == ("plan", 1)
    with pytest.raises(RuntimeError, match="already"):
        batch.copy_out(TransferSpec(slots))
    with pytest.raises(RuntimeError, match="already"):
        planned[0].copy_out()
    assert [st.commit() for st in staged] == [64 - CS, 0, 64]
    s.to_dst()
    loaded = s.engine.retrieve(t2, None, dst2)
    s.check_loaded(src2, dst2, loaded)
    s.conn.kv = s.src
    assert s.engine.lookup(t1) == 0  # its first chunk was masked: not stored
    s.engine.store(t1, None, src1)  # stores the first chunk only; the rest was batched
    s.to_dst()
    s.dst.copy_(_poisoned())
    s.check_loaded(src1, dst1, s.engine.retrieve(t1, None, dst1))

    used = s.engine.pool.used_bytes
    t4, src4, _ = s.request(48, seed=34)
    dropped = s.engine.batch_stores([s.engine.plan_store(t4, None, src4, prepare=False)])
    assert s.engine.pool.used_bytes == used + 3 * CHUNK_BYTES
    dropped.abort()
    assert s.engine.pool.used_bytes == used and s.engine.lookup(t4) == 0


def test_layerwise_load_layers_in_groups_matches_per_layer() -> None:
    """load_layers(stop) moves a range of layers in one to_gpu_layers call (the default loops
    to_gpu_layer); the result is bit-identical to a plain retrieve."""
    s = Setup(5, layerwise=True)
    tokens, src, dst = s.request(48)
    s.engine.store(tokens, None, src)
    s.to_dst()
    retriever = s.engine.retrieve_layerwise(tokens, None, dst)
    with pytest.raises(ValueError, match="expected 0 < stop"):
        retriever.load_layers(LAYERS + 1)
    retriever.load_layers(1)
    with pytest.raises(ValueError, match="the next layer is 1"):
        retriever.load_layers(1)
    retriever.load_layers(LAYERS)
    loaded = retriever.finish()
    assert s.conn.calls["to_gpu_layer"] == LAYERS  # the default: one call per layer
    s.check_loaded(src, dst, loaded)


def test_lookups_read_tokens_only_up_to_the_first_missing_chunk() -> None:
    """A lookup hashes (and checks) its tokens as far as the stored prefix goes plus the first
    missing chunk; the answer is the same as with every key computed (a recompute by
    ``chunk_keys`` against the tier), and a bad token inside that span is still an error."""
    s = Setup()
    tokens, src, _ = s.request(3 * CS)
    assert (
        s.engine.store(tokens[: 2 * CS], None, TransferSpec(src.slot_mapping[: 2 * CS])) == 2 * CS
    )
    longer = tokens.tolist() + [7] * CS
    keys = chunk_keys(longer, s.engine._fingerprint, CS, salt=s.config.cache_salt + "\0")
    assert [s.engine.tier.contains(k) for k in keys] == [True, True, False, False]
    assert s.engine.lookup(longer) == 2 * CS
    with s.engine.lookup_and_lease(longer) as hit:
        assert hit.num_tokens == 2 * CS
    bad_late = [*tokens.tolist(), 2**40]  # in chunk 3: after the first missing chunk (2)
    assert s.engine.lookup(bad_late) == 2 * CS
    with s.engine.lookup_and_lease(bad_late) as hit:
        assert hit.num_tokens == 2 * CS
    bad_next = tokens[: 2 * CS].tolist() + [-1] * 3  # in chunk 2: the one the lookup reads
    with pytest.raises(ValueError, match=rf"token_ids\[{2 * CS}\] = -1"):
        s.engine.lookup(bad_next)
    with pytest.raises(ValueError, match=rf"token_ids\[{2 * CS}\] = -1"):
        s.engine.lookup_and_lease(bad_next)
    s.engine.clear()
    assert s.engine.pool.used_bytes == 0  # the failed lookup's leases were released
