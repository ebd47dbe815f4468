# SPDX-License-Identifier: Apache-2.0
"""LMCacheEngine and its CPU tier: held hits, prefix-keeping eviction, owners, per-engine metrics.

Engines run the paged CPU connector (``lmcache.testing``) with one-token pages, so slot ``s`` is
row ``s`` of every layer. A store reads a random source cache; a retrieve writes a poisoned
(NaN) destination cache, and the tests compare bits against the source.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from prometheus_client import CollectorRegistry

from lmcache.cache_engine import ExtraKeys, HeldHit, LMCacheEngine
from lmcache.config import LMCacheConfig
from lmcache.gpu_connector.interface import EngineInfo, TransferSpec
from lmcache.keys import chunk_keys
from lmcache.memory import HostMemoryPool, LeaseError
from lmcache.metadata import LMCacheMetadata
from lmcache.metrics import LMCacheMetrics
from lmcache.testing import PagedCPUConnector
from lmcache.tiers import CPUTier

CS = 4  # chunk size
LAYERS, HEADS, HEAD = 2, 2, 4
WIDTH = HEADS * HEAD * 2
SLOTS = 256
DTYPE = torch.bfloat16
CHUNK_BYTES = LAYERS * CS * WIDTH * 2  # 256: a multiple of the pool alignment


def _metadata(model: str = "test/model") -> LMCacheMetadata:
    return LMCacheMetadata(model, 1, 0, 0, 1, DTYPE, LAYERS, HEADS, HEAD, HEAD, chunk_size=CS)


def _tier(chunks: int) -> CPUTier:
    pool = HostMemoryPool(chunks * CHUNK_BYTES, pin=False, slab_bytes=chunks * CHUNK_BYTES)
    return CPUTier(pool, LMCacheMetrics())


def _poisoned() -> list[torch.Tensor]:
    return [torch.full((SLOTS, 1, WIDTH), float("nan"), dtype=DTYPE) for _ in range(LAYERS)]


class Rig:
    """An engine over ``tier`` whose connector reads ``src`` until :meth:`load` swaps in a dst."""

    def __init__(
        self,
        tier: CPUTier,
        *,
        model: str = "test/model",
        metrics: LMCacheMetrics | None = None,
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.config = LMCacheConfig(chunk_size=CS)
        self.metadata = _metadata(model)
        self.src = [torch.randn(SLOTS, 1, WIDTH, generator=gen).to(DTYPE) for _ in range(LAYERS)]
        self.engine = LMCacheEngine(
            self.config, self.metadata, self._connector(self.src), metrics=metrics, tier=tier
        )

    def _connector(self, caches: list[torch.Tensor]) -> PagedCPUConnector:
        info = EngineInfo("mock", "cpu", caches, extra={"page_size": 1})
        return PagedCPUConnector(self.config, self.metadata, info)

    def store(self, prompt: int, chunks: int, *, extra_keys: ExtraKeys | None = None) -> int:
        tokens, slots = _prompt(prompt, chunks)
        return self.engine.store(tokens, None, TransferSpec(slots), extra_keys=extra_keys)

    def load(
        self,
        prompt: int,
        chunks: int,
        *,
        extra_keys: ExtraKeys | None = None,
        held: HeldHit | None = None,
    ) -> tuple[int, bool]:
        """Retrieve a prompt into a fresh poisoned cache: (tokens loaded, bits equal src's)."""
        tokens, slots = _prompt(prompt, chunks)
        dst = _poisoned()
        self.engine.set_gpu_connector(self._connector(dst))
        try:
            spec = TransferSpec(slots)
            loaded = self.engine.retrieve(tokens, None, spec, extra_keys=extra_keys, held=held)
        finally:
            self.engine.set_gpu_connector(self._connector(self.src))
        n = int(loaded.sum())
        assert bool(loaded[:n].all()), "loaded tokens must be a prefix"
        rows = slots[:n]
        exact = all(
            torch.equal(d[rows].view(torch.int16), s[rows].view(torch.int16))
            for d, s in zip(dst, self.src, strict=True)
        )
        untouched = all(bool(d[slots[n:]].isnan().all()) for d in dst)
        return n, exact and untouched

    def keys(self, prompt: int, chunks: int) -> list[bytes]:
        tokens, _ = _prompt(prompt, chunks)
        return chunk_keys(tokens, self.metadata.fingerprint(), CS, salt="\0")


def _prompt(prompt: int, chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens of prompt ``prompt`` (distinct per prompt) and its slots (disjoint per prompt)."""
    n = chunks * CS
    tokens = torch.randint(0, 50_000, (n,), generator=torch.Generator().manual_seed(100 + prompt))
    slots = torch.arange(prompt * 32, prompt * 32 + n)
    return tokens, slots


# ---------------------------------------------------------------------------- held hits


def test_lookup_and_lease_holds_chunks_against_eviction() -> None:
    tier = _tier(4)
    rig = Rig(tier)
    assert rig.store(0, 2) == 2 * CS
    assert rig.store(1, 2) == 2 * CS  # the tier is full: every new store must evict
    hit = rig.engine.lookup_and_lease(_prompt(0, 2)[0])
    assert isinstance(hit, HeldHit) and not hit.released
    assert hit.num_tokens == 2 * CS and hit.keys == rig.keys(0, 2) and len(hit) == 2
    rig.engine.lookup(_prompt(1, 2)[0])  # prompt 0 is now the LRU
    for prompt in (2, 3, 4):
        assert rig.store(prompt, 2) == 2 * CS
    assert all(tier.contains(k) for k in hit.keys)  # held: not evicted
    assert rig.engine.lookup(_prompt(1, 2)[0]) == 0  # the unheld ones were
    assert rig.engine.metrics.value("evicted_chunks") == 6
    assert rig.load(0, 2, held=hit) == (2 * CS, True)
    assert rig.load(0, 2) == (2 * CS, True)  # also through the tier, verified
    assert not hit.released  # retrieve never releases it
    with hit:
        pass
    assert hit.released
    hit.release()  # idempotent
    assert rig.store(5, 2) == 2 * CS  # evicts prompt 4 (the retrieves made prompt 0 recent)
    assert rig.store(6, 2) == 2 * CS  # released: now prompt 0 can go
    assert rig.engine.lookup(_prompt(0, 2)[0]) == 0


def test_a_held_hit_waits_for_its_device_copy_before_handing_leases_back() -> None:
    """A device copy started at lookup reads the leased buffers: ``truncate`` and ``release``
    call ``copy_done`` first, and hand the leases back even when it raises."""
    tier = _tier(4)
    rig = Rig(tier)
    assert rig.store(0, 3) == 3 * CS
    hit = rig.engine.lookup_and_lease(_prompt(0, 3)[0])
    leases = [hit._leases[key] for key in hit.keys]
    events: list[list[bool]] = []

    def done() -> None:
        events.append([lease.released for lease in leases])

    hit.copy_done = done
    hit.truncate(2, 2 * CS)
    assert events == [[False, False, False]]  # chunk 2's lease went only after the wait
    assert [lease.released for lease in leases] == [False, False, True]

    def broken() -> None:
        events.append([lease.released for lease in leases])
        raise RuntimeError("device lost")

    hit.copy_done = broken
    with pytest.raises(RuntimeError, match="device lost"):
        hit.release()
    assert events[-1] == [False, False, True] and hit.copy_done is None
    assert hit.released and all(lease.released for lease in leases)
    assert rig.store(1, 3) == 3 * CS and rig.store(2, 1) == CS  # every chunk can be evicted
    assert rig.engine.lookup(_prompt(0, 3)[0]) == 0


def test_held_chunks_are_not_hashed_again() -> None:
    tier = _tier(8)
    rig = Rig(tier)
    rig.store(0, 3)
    hashed: list[int] = []
    original = tier.checksums

    def counting(tensors: Sequence[torch.Tensor]) -> list[int]:
        hashed.append(len(tensors))
        return original(tensors)

    tier.checksums = counting  # type: ignore[method-assign]
    tokens = _prompt(0, 3)[0]
    with rig.engine.lookup_and_lease(tokens[: 2 * CS]) as hit:  # chunks 0 and 1, verified
        assert sum(hashed) == 2 and hit.num_tokens == 2 * CS  # each chunk hashed once
        assert rig.load(0, 3, held=hit) == (3 * CS, True)
        assert sum(hashed) == 3  # only chunk 2, which came from the tier
    hashed.clear()
    assert rig.load(0, 3) == (3 * CS, True)
    assert sum(hashed) == 3  # a run of leases is verified in batches: each chunk once


def test_held_lease_survives_removal_and_replacement() -> None:
    tier = _tier(8)
    rig = Rig(tier)
    rig.store(0, 2)
    hit = rig.engine.lookup_and_lease(_prompt(0, 2)[0])
    keys = rig.keys(0, 2)
    rig.engine.clear()
    assert len(tier) == 0
    assert rig.load(0, 2, held=hit) == (2 * CS, True)  # the held bytes are still the chunks
    assert rig.load(0, 2) == (0, True)  # the tier has nothing
    # A new entry under the same key (other bytes) does not change what the hit loads.
    lease = tier.allocate((LAYERS, CS, WIDTH), DTYPE)
    assert lease is not None
    with lease:
        lease.tensor.fill_(7.0)
        tier.put(keys[0], lease, None)
    assert rig.load(0, 2, held=hit) == (2 * CS, True)
    hit.release()
    tier.clear()
    assert tier.pool.used_bytes == 0  # no lease leaked


def test_held_hit_metrics_partial_chunk_and_misuse() -> None:
    tier = _tier(8)
    config = LMCacheConfig(chunk_size=CS, save_unfull_chunk=True)
    md = _metadata()
    engine = LMCacheEngine(config, md, tier=tier)
    src = [torch.randn(SLOTS, 1, WIDTH).to(DTYPE) for _ in range(LAYERS)]
    engine.set_gpu_connector(
        PagedCPUConnector(config, md, EngineInfo("mock", "cpu", src, extra={"page_size": 1}))
    )
    tokens = list(range(1000, 1000 + 2 * CS + 1))  # two chunks and a partial one
    engine.store(tokens, None, TransferSpec(torch.arange(len(tokens))))
    with engine.lookup_and_lease(tokens) as hit:
        assert hit.num_tokens == 2 * CS + 1 == engine.lookup(tokens)
    with engine.lookup_and_lease([*tokens[: 2 * CS], 5, 6]) as hit:
        assert hit.num_tokens == 2 * CS and len(hit.keys) == 2
    m = engine.metrics
    assert m.value("lookup_requests") == 3
    assert m.value("lookup_tokens") == 2 * (2 * CS + 1) + (2 * CS + 2)
    assert m.value("hit_tokens") == 2 * (2 * CS + 1) + 2 * CS
    with pytest.raises(LeaseError, match="was released"):
        engine.retrieve(tokens, None, TransferSpec(torch.arange(len(tokens))), held=hit)
    assert tier.pool.used_bytes == 3 * CHUNK_BYTES  # only the tier's own leases remain


def test_layerwise_retrieve_uses_the_held_hit() -> None:
    tier = _tier(8)
    rig = Rig(tier)
    rig.store(0, 3)
    tokens, slots = _prompt(0, 3)
    hit = rig.engine.lookup_and_lease(tokens)
    rig.engine.clear()  # only the hit has the chunks now
    dst = _poisoned()
    rig.engine.set_gpu_connector(rig._connector(dst))
    op = rig.engine.retrieve_layerwise(tokens, None, TransferSpec(slots), held=hit)
    hit.release()  # the retrieve holds its own shares
    assert op.num_hit_tokens == 3 * CS
    for layer in range(LAYERS):
        op.load_layer(layer)
    assert bool(op.finish().all())
    for d, s in zip(dst, rig.src, strict=True):
        assert torch.equal(d[slots].view(torch.int16), s[slots].view(torch.int16))
    assert tier.pool.used_bytes == 0


# ---------------------------------------------------------------------------- eviction order


def test_eviction_leaves_a_prefix_of_each_prompt() -> None:
    tier = _tier(5)
    rig = Rig(tier)
    assert rig.store(0, 3) == 3 * CS
    assert rig.store(1, 3) == 3 * CS  # one free chunk: evicts two of prompt 0
    remaining = [sum(tier.contains(k) for k in rig.keys(p, 3)) for p in (0, 1)]
    assert remaining == [2, 3]
    assert not tier.contains(rig.keys(0, 3)[2])  # the tail went, the head stayed
    for prompt, chunks in ((0, remaining[0]), (1, remaining[1])):
        assert rig.engine.lookup(_prompt(prompt, 3)[0]) == chunks * CS
    # A longer run of evictions: every prompt still holds exactly a prefix.
    for prompt in (2, 3, 4):
        rig.store(prompt, 2 + prompt % 2)
        for p in range(prompt + 1):
            n = 2 + p % 2 if p >= 2 else 3
            present = [tier.contains(k) for k in rig.keys(p, n)]
            kept = sum(present)
            assert present == [True] * kept + [False] * (n - kept), (p, present)
            assert rig.engine.lookup(_prompt(p, n)[0]) == kept * CS
    assert rig.load(0, 3)[1] and rig.load(4, 2) == (2 * CS, True)


def test_lru_evicts_the_tail_of_the_older_prompt_first() -> None:
    tier = _tier(4)
    rig = Rig(tier)
    rig.store(0, 2)  # A
    rig.store(1, 2)  # B
    assert rig.engine.lookup(_prompt(0, 2)[0]) == 2 * CS  # A used: B is older
    rig.store(2, 1)  # C: one eviction
    a, b = rig.keys(0, 2), rig.keys(1, 2)
    assert [tier.contains(k) for k in a + b] == [True, True, True, False]  # B's tail went
    rig.store(3, 2)  # two more: B's head, then A's tail (A's head is more recent than both)
    assert [tier.contains(k) for k in a + b] == [True, False, False, False]
    assert rig.load(0, 2) == (CS, True)


def test_retrieve_refreshes_a_chain_in_order() -> None:
    tier = _tier(4)
    rig = Rig(tier)
    rig.store(0, 2)
    rig.store(1, 2)
    assert rig.load(0, 2) == (2 * CS, True)  # A retrieved: B is older
    rig.store(2, 3)
    assert [tier.contains(k) for k in rig.keys(0, 2)] == [True, False]
    assert rig.engine.lookup(_prompt(1, 2)[0]) == 0


# ---------------------------------------------------------------------------- shared tier


def test_clear_drops_only_the_engines_own_chunks() -> None:
    tier = _tier(8)
    a = Rig(tier, model="model-a")
    b = Rig(tier, model="model-b")
    a.store(0, 2)
    b.store(0, 3)
    assert len(tier) == 5
    a.engine.clear()
    assert a.engine.lookup(_prompt(0, 2)[0]) == 0
    assert b.engine.lookup(_prompt(0, 3)[0]) == 3 * CS
    assert b.load(0, 3) == (3 * CS, True)
    assert len(tier) == 3
    a.engine.close()  # a shared tier is not emptied by close
    assert len(tier) == 3


def test_each_engine_counts_its_own_tier_events() -> None:
    tier = _tier(4)
    reg = CollectorRegistry()
    a = Rig(tier, model="model-a", metrics=LMCacheMetrics(reg, labels={"engine": "a"}))
    b = Rig(tier, model="model-b", metrics=LMCacheMetrics(reg, labels={"engine": "b"}), seed=1)
    a.store(0, 3)
    b.store(0, 3)  # evicts two of a's chunks
    ma, mb = a.engine.metrics, b.engine.metrics
    assert (ma.value("evicted_chunks"), mb.value("evicted_chunks")) == (0, 2)
    assert tier.metrics.value("evicted_chunks") == 0
    lease = tier.get(b.keys(0, 3)[1])
    assert lease is not None
    with lease:  # corrupt b's chunk 1
        lease.tensor.view(torch.uint8).reshape(-1)[3] ^= 1
    assert b.load(0, 3) == (CS, True)
    assert (ma.value("checksum_failures"), mb.value("checksum_failures")) == (0, 1)
    assert (ma.value("stored_chunks"), mb.value("stored_chunks")) == (3, 3)
    assert (ma.value("loaded_chunks"), mb.value("loaded_chunks")) == (0, 1)
    assert reg.get_sample_value("lmcache_evicted_chunks_total", {"engine": "b"}) == 2
    assert reg.get_sample_value("lmcache_evicted_chunks_total", {"engine": "a"}) == 0


def test_extra_keys_reach_every_engine_call() -> None:
    tier = _tier(16)
    rig = Rig(tier)
    tokens, slots = _prompt(0, 4)
    image = {1: bytes.fromhex("3dd3f8d1db39a536c4f48318eda8e4a8")}
    other = {1: bytes.fromhex("0cf457e24a479f02fd4d34540389f720")}
    assert rig.engine.store(tokens, None, TransferSpec(slots), extra_keys=image) == 4 * CS
    assert rig.engine.lookup(tokens, extra_keys=image) == 4 * CS
    # The extra is on chunk 1: chunk 0's key is the plain one, chunks 1.. differ.
    assert rig.engine.lookup(tokens) == CS
    assert rig.engine.lookup(tokens, extra_keys=other) == CS
    expected = chunk_keys(tokens, rig.metadata.fingerprint(), CS, salt="\0", extra_keys=image)
    with rig.engine.lookup_and_lease(tokens, extra_keys=image) as hit:
        assert hit.num_tokens == 4 * CS and hit.keys == expected
        assert rig.load(0, 4, extra_keys=image, held=hit) == (4 * CS, True)
    assert rig.load(0, 4, extra_keys=other) == (CS, True)
    assert rig.store(0, 4, extra_keys=other) == 3 * CS  # chunk 0 is there already
    assert rig.engine.lookup(tokens, extra_keys=other) == 4 * CS
    with pytest.raises(ValueError, match=r"index 4 .* 4 chunk\(s\)"):
        rig.engine.lookup(tokens, extra_keys={4: b"x"})
    with pytest.raises(ValueError, match="index 4"):
        rig.engine.store(tokens, None, TransferSpec(slots), extra_keys={4: b"x"})
