# SPDX-License-Identifier: Apache-2.0
"""CPUTier: LRU within the pool budget, leased chunks never evicted, checksums verified."""

from __future__ import annotations

import pytest
import torch
import xxhash

from lmcache.memory import HostMemoryPool, MemoryLease
from lmcache.metrics import LMCacheMetrics
from lmcache.tiers import CPUTier, tensor_checksum

SHAPE = (2, 4, 32)  # [num_layers, num_tokens, kv_width] float32 -> 1024 bytes
CHUNK_BYTES = 2 * 4 * 32 * 4


def _tier(chunks: int) -> tuple[CPUTier, LMCacheMetrics]:
    metrics = LMCacheMetrics()
    pool = HostMemoryPool(chunks * CHUNK_BYTES, pin=False, slab_bytes=chunks * CHUNK_BYTES)
    return CPUTier(pool, metrics), metrics


def _put(tier: CPUTier, key: bytes, value: float, *, checksum: bool = True) -> None:
    lease = tier.allocate(SHAPE, torch.float32)
    assert lease is not None
    with lease:
        lease.tensor.fill_(value)
        tier.put(key, lease, tensor_checksum(lease.tensor) if checksum else None)


def _get(tier: CPUTier, key: bytes) -> MemoryLease:
    lease = tier.get(key)
    assert lease is not None, f"{key!r} missing"
    return lease


def test_tensor_checksum_is_xxh3_of_the_bytes() -> None:
    t = torch.randn(3, 5, 7).to(torch.bfloat16)
    expected = xxhash.xxh3_64_intdigest(t.view(torch.int16).numpy().tobytes())
    assert tensor_checksum(t) == expected
    with pytest.raises(ValueError, match="contiguous"):
        tensor_checksum(t.transpose(0, 1))


def test_put_get_roundtrip_and_ownership() -> None:
    tier, _ = _tier(4)
    _put(tier, b"a", 1.5)
    assert tier.contains(b"a") and len(tier) == 1 and not tier.contains(b"b")
    assert tier.missing([b"b", b"a", b"c"]) == [0, 2]
    assert tier.get(b"b") is None
    lease = _get(tier, b"a")
    assert torch.equal(lease.tensor, torch.full(SHAPE, 1.5))
    assert lease.ref_count == 2  # the tier's and ours
    lease.release()
    assert tier.pool.used_bytes == CHUNK_BYTES


def test_put_replaces_existing_entry() -> None:
    tier, _ = _tier(4)
    _put(tier, b"a", 1.0)
    _put(tier, b"a", 2.0)
    assert len(tier) == 1 and tier.pool.used_bytes == CHUNK_BYTES
    with _get(tier, b"a") as lease:
        assert float(lease.tensor[0, 0, 0]) == 2.0


def test_lru_eviction_under_small_budget() -> None:
    tier, metrics = _tier(3)
    for i, key in enumerate((b"a", b"b", b"c")):
        _put(tier, key, float(i))
    _get(tier, b"a").release()  # a is now most recently used; b is the LRU
    _put(tier, b"d", 3.0)
    assert not tier.contains(b"b")
    assert all(tier.contains(k) for k in (b"a", b"c", b"d"))
    assert metrics.value("evicted_chunks") == 1
    assert tier.touch(b"c") and not tier.touch(b"b")  # c most recent: a is next to go
    _put(tier, b"e", 4.0)
    assert not tier.contains(b"a") and tier.contains(b"c")
    assert tier.pool.used_bytes == 3 * CHUNK_BYTES


def test_leased_chunks_survive_eviction() -> None:
    tier, metrics = _tier(2)
    _put(tier, b"a", 1.0)
    _put(tier, b"b", 2.0)
    held = _get(tier, b"a")  # a retrieve is reading a
    tier.touch(b"b")  # a is the LRU, but leased
    _put(tier, b"c", 3.0)
    assert tier.contains(b"a") and not tier.contains(b"b") and tier.contains(b"c")
    held_c = _get(tier, b"c")
    assert tier.allocate(SHAPE, torch.float32) is None  # everything leased: no room, no wait
    assert torch.equal(held.tensor, torch.full(SHAPE, 1.0))  # bytes intact
    assert metrics.value("evicted_chunks") == 1
    held.release()
    held_c.release()
    lease = tier.allocate(SHAPE, torch.float32)
    assert lease is not None
    lease.release()


def test_allocation_larger_than_budget_evicts_nothing() -> None:
    tier, _ = _tier(2)
    _put(tier, b"a", 1.0)
    assert tier.allocate((5, 4, 32), torch.float32) is None
    assert tier.contains(b"a")


def test_checksum_mismatch_is_a_counted_miss() -> None:
    tier, metrics = _tier(4)
    _put(tier, b"a", 1.0)
    with _get(tier, b"a") as lease:
        lease.tensor.view(torch.uint8).reshape(-1)[17] ^= 0x40  # corrupt the stored bytes
    assert tier.get(b"a") is None
    assert metrics.value("checksum_failures") == 1
    assert not tier.contains(b"a")
    assert tier.pool.used_bytes == 0  # the dropped entry's bytes came back


def test_no_checksum_means_no_verification() -> None:
    tier, metrics = _tier(4)
    _put(tier, b"a", 1.0, checksum=False)
    with _get(tier, b"a") as lease:
        lease.tensor[0, 0, 0] = 9.0
    with _get(tier, b"a") as lease:
        assert float(lease.tensor[0, 0, 0]) == 9.0
    assert metrics.value("checksum_failures") == 0


def test_remove_and_clear_return_bytes() -> None:
    tier, _ = _tier(4)
    for i, key in enumerate((b"a", b"b", b"c")):
        _put(tier, key, float(i))
    assert tier.remove(b"b") and not tier.remove(b"b")
    held = _get(tier, b"a")
    tier.clear()
    assert len(tier) == 0 and not tier.contains(b"a")
    assert torch.equal(held.tensor, torch.zeros(SHAPE))  # still valid for its holder
    assert tier.pool.used_bytes == CHUNK_BYTES
    held.release()
    assert tier.pool.used_bytes == 0


def test_large_chunk_checksum_hashes_slice_digests_and_threads_agree() -> None:
    """Over CHECKSUM_SLICE_BYTES the checksum is xxh3-64 of the slices' xxh3-64 digests."""
    import struct

    from lmcache.tiers import CHECKSUM_SLICE_BYTES

    nbytes = 2 * CHECKSUM_SLICE_BYTES + 12_345  # three slices, the last one short
    t = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    raw = t.numpy().tobytes()
    digests = [
        xxhash.xxh3_64_intdigest(raw[i : i + CHECKSUM_SLICE_BYTES])
        for i in range(0, nbytes, CHECKSUM_SLICE_BYTES)
    ]
    expected = xxhash.xxh3_64_intdigest(struct.pack("<3Q", *digests))
    assert tensor_checksum(t) == expected
    tier, _ = _tier(1)
    small = torch.randn(SHAPE)
    assert tier.checksums([t, small, t]) == [expected, tensor_checksum(small), expected]


def test_corruption_in_the_last_slice_of_a_large_chunk_is_a_miss() -> None:
    from lmcache.tiers import CHECKSUM_SLICE_BYTES

    metrics = LMCacheMetrics()
    shape = (2, 1024, 1024 + 7)  # float32: a bit over 2 slices
    nbytes = 2 * 1024 * (1024 + 7) * 4
    assert nbytes > 2 * CHECKSUM_SLICE_BYTES
    tier = CPUTier(HostMemoryPool(2 * nbytes, pin=False), metrics)
    lease = tier.allocate(shape, torch.float32)
    assert lease is not None
    with lease:
        lease.tensor.copy_(torch.randn(shape))
        tier.put(b"big", lease, tier.checksums([lease.tensor])[0])
    good = _get(tier, b"big")
    good.tensor.view(torch.uint8).reshape(-1)[-1] ^= 1  # flip one bit in the last slice
    good.release()
    assert tier.get(b"big") is None
    assert metrics.value("checksum_failures") == 1
    assert not tier.contains(b"big")


def _lru_order(tier: CPUTier, keys: list[bytes]) -> list[bytes]:
    """The order in which ``keys`` are evicted: fill the tier with fresh chunks, one at a time."""
    evicted: list[bytes] = []
    for i in range(len(keys)):
        _put(tier, b"filler-%d" % i, -1.0)
        evicted += [k for k in keys if not tier.contains(k) and k not in evicted]
    return evicted


def test_touch_many_orders_a_chain_head_last_to_go() -> None:
    tier, _ = _tier(4)
    chain = [b"c0", b"c1", b"c2", b"c3"]
    for i, key in enumerate(chain):  # put order: c0 is the LRU, c3 the MRU
        _put(tier, key, float(i))
    assert tier.touch_many(chain) == 4
    assert _lru_order(tier, chain) == [b"c3", b"c2", b"c1", b"c0"]  # tail first

    tier, _ = _tier(4)
    for i, key in enumerate((b"x", b"c0", b"c2", b"y")):
        _put(tier, key, float(i))
    # Absent keys are skipped; the touched ones end up most recent, c0 above c2.
    assert tier.touch_many([b"c0", b"c1", b"c2"]) == 2
    assert _lru_order(tier, [b"x", b"y", b"c0", b"c2"]) == [b"x", b"y", b"c2", b"c0"]
    assert tier.touch_many([]) == 0


def test_clear_by_owner_keeps_the_others() -> None:
    tier, _ = _tier(6)
    for key, owner in ((b"a1", b"model-a"), (b"a2", b"model-a"), (b"b1", b"model-b")):
        lease = tier.allocate(SHAPE, torch.float32)
        assert lease is not None
        with lease:
            lease.tensor.fill_(1.0)
            tier.put(key, lease, None, owner=owner)
    _put(tier, b"none", 2.0)  # default owner b""
    held = _get(tier, b"a1")
    tier.clear(owner=b"model-a")
    assert sorted(k for k in (b"a1", b"a2", b"b1", b"none") if tier.contains(k)) == [b"b1", b"none"]
    assert torch.equal(held.tensor, torch.full(SHAPE, 1.0))  # a holder's bytes stay valid
    held.release()
    assert tier.pool.used_bytes == 2 * CHUNK_BYTES
    tier.clear(owner=b"model-c")  # nobody's: nothing happens
    assert len(tier) == 2
    tier.clear(owner=b"")
    assert [k for k in (b"b1", b"none") if tier.contains(k)] == [b"b1"]
    tier.clear()
    assert len(tier) == 0 and tier.pool.used_bytes == 0


def test_replacing_an_entry_takes_the_new_owner() -> None:
    tier, _ = _tier(2)
    for owner in (b"first", b"second"):
        lease = tier.allocate(SHAPE, torch.float32)
        assert lease is not None
        with lease:
            tier.put(b"k", lease, None, owner=owner)
    tier.clear(owner=b"first")
    assert tier.contains(b"k")
    tier.clear(owner=b"second")
    assert not tier.contains(b"k")


def test_callers_metrics_count_evictions_and_checksum_failures() -> None:
    tier, own = _tier(2)
    caller = LMCacheMetrics()
    _put(tier, b"a", 1.0)
    _put(tier, b"b", 2.0)
    lease = tier.allocate(SHAPE, torch.float32, metrics=caller)  # evicts a
    assert lease is not None
    lease.release()
    assert caller.value("evicted_chunks") == 1 and own.value("evicted_chunks") == 0
    with _get(tier, b"b") as held:
        held.tensor.view(torch.uint8).reshape(-1)[5] ^= 1
    assert tier.get(b"b", metrics=caller) is None
    assert caller.value("checksum_failures") == 1 and own.value("checksum_failures") == 0
    _put(tier, b"c", 3.0)
    _put(tier, b"d", 4.0)
    _put(tier, b"e", 5.0)  # no metrics passed: the tier's own count
    assert own.value("evicted_chunks") == 1 and caller.value("evicted_chunks") == 1


def _reference_checksum(t: torch.Tensor) -> int:
    """The checksum's definition, hashed at once: xxh3-64 of each 4 MiB slice, then of the
    slices' digests (little-endian uint64) when there are several."""
    import struct

    import xxhash

    from lmcache.tiers.cpu_tier import CHECKSUM_SLICE_BYTES

    data = t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
    step = CHECKSUM_SLICE_BYTES
    digests = [xxhash.xxh3_64_intdigest(data[i : i + step]) for i in range(0, len(data), step)]
    if len(digests) <= 1:
        return xxhash.xxh3_64_intdigest(data)
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(digests)}Q", *digests))


def test_tensor_checksum_equals_its_definition() -> None:
    """Hashed in pieces that keep the GIL, the sum is the same as hashing each slice at once
    (sums stored in disk and remote entries stay valid)."""
    from lmcache.tiers.checksum import CHECKSUM_SLICE_BYTES, GIL_PIECE_BYTES

    for nbytes in (
        0,
        1,
        GIL_PIECE_BYTES,
        GIL_PIECE_BYTES + 1,
        2 * 1024 * 1024,
        CHECKSUM_SLICE_BYTES,
        3 * CHECKSUM_SLICE_BYTES + 5,
    ):
        t = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        assert tensor_checksum(t) == _reference_checksum(t), nbytes
    t = torch.randint(0, 256, (2 * CHECKSUM_SLICE_BYTES,), dtype=torch.uint8)
    before = tensor_checksum(t)
    t[CHECKSUM_SLICE_BYTES + GIL_PIECE_BYTES + 7] ^= 1
    assert tensor_checksum(t) != before


def test_allocate_many_evicts_lru_first_and_stops_at_leased_chunks() -> None:
    """``allocate_many`` evicts least recently used entries until the run fits, like that many
    ``allocate`` calls; with only leased entries left it returns what fits."""
    tier, metrics = _tier(4)
    for i, key in enumerate((b"a", b"b", b"c")):
        _put(tier, key, float(i))
    _get(tier, b"a").release()  # b, then c are the LRU
    leases = tier.allocate_many(SHAPE, torch.float32, 2, metrics=metrics)
    assert len(leases) == 2 and metrics.value("evicted_chunks") == 1
    assert not tier.contains(b"b") and tier.contains(b"a") and tier.contains(b"c")
    held = _get(tier, b"a")
    more = tier.allocate_many(SHAPE, torch.float32, 3)  # c goes; a is leased: one fits
    assert len(more) == 1 and not tier.contains(b"c") and tier.contains(b"a")
    assert torch.equal(held.tensor, torch.full(SHAPE, 0.0))  # a's bytes intact
    assert tier.allocate_many((5, 4, 32), torch.float32, 1) == []  # larger than the budget
    for lease in [held, *leases, *more]:
        lease.release()


def test_allocate_many_at_budget_evicts_as_many_single_evictions_would() -> None:
    """A full tier asked for k buffers evicts exactly the k least recently used entries nobody
    else leases (a leased one is skipped, not evicted), counts each, and keeps the rest intact;
    half-size entries count by their bytes: two go for one full-size buffer."""
    tier, metrics = _tier(8)
    keys = [bytes([i]) for i in range(8)]
    for i, key in enumerate(keys):
        _put(tier, key, float(i))
    held = _get(tier, keys[1])  # leased: the second oldest must survive
    leases = tier.allocate_many(SHAPE, torch.float32, 3, metrics=metrics)
    assert len(leases) == 3 and metrics.value("evicted_chunks") == 3
    gone = [k for k in keys if not tier.contains(k)]
    assert gone == [keys[0], keys[2], keys[3]]
    for i in (1, 4, 5, 6, 7):
        lease = _get(tier, keys[i])
        assert torch.equal(lease.tensor, torch.full(SHAPE, float(i)))
        lease.release()
    for lease in [held, *leases]:
        lease.release()

    half = (1, 4, 32)  # 512 bytes: two fill one full-size slot
    small, small_metrics = _tier(2)
    for i, key in enumerate((b"x", b"y", b"z", b"w")):
        lease = small.allocate(half, torch.float32)
        assert lease is not None
        with lease:
            lease.tensor.fill_(float(i))
            small.put(key, lease, None)
    (full,) = small.allocate_many(SHAPE, torch.float32, 1, metrics=small_metrics)
    assert small_metrics.value("evicted_chunks") == 2
    assert not small.contains(b"x") and not small.contains(b"y")
    assert small.contains(b"z") and small.contains(b"w")
    full.release()


def test_full_tier_hands_evicted_buffers_over_in_address_order() -> None:
    """At budget, the buffers of evicted entries of the same shape become the new buffers
    (the same bytes, no pool pass), lowest address first, so a prompt stored over an evicted
    one gets back-to-back buffers; a leased entry keeps its bytes, an entry of another shape
    goes back to the pool, and the pool's accounting is that of release + allocate."""
    tier, metrics = _tier(8)
    keys = [bytes([i]) for i in range(8)]
    for i, key in enumerate(keys):
        _put(tier, key, float(i))
    ptrs = {k: _get_ptr(tier, k) for k in keys}
    tier.touch_many(keys)  # one chain: keys[7] is the least recently used, keys[0] the most
    held = _get(tier, keys[6])  # leased: skipped, its bytes must survive
    leases = tier.allocate_many(SHAPE, torch.float32, 3, metrics=metrics)
    assert [k for k in keys if not tier.contains(k)] == [keys[4], keys[5], keys[7]]
    evicted = sorted(ptrs[k] for k in (keys[4], keys[5], keys[7]))
    assert [lease.tensor.data_ptr() for lease in leases] == evicted  # not LRU order: 7, 5, 4
    assert metrics.value("evicted_chunks") == 3
    assert tier.pool.used_bytes == 8 * CHUNK_BYTES
    for n, lease in enumerate(leases):
        assert lease.ref_count == 1 and tuple(lease.tensor.shape) == SHAPE
        lease.tensor.fill_(100.0 + n)
        tier.put(bytes([100 + n]), lease, tensor_checksum(lease.tensor))
        lease.release()
    assert torch.equal(held.tensor, torch.full(SHAPE, 6.0))
    for i in (0, 1, 2, 3, 6):
        lease = _get(tier, keys[i])
        assert torch.equal(lease.tensor, torch.full(SHAPE, float(i)))
        lease.release()
    for n in range(3):
        lease = _get(tier, bytes([100 + n]))
        assert torch.equal(lease.tensor, torch.full(SHAPE, 100.0 + n)) and lease.ref_count == 2
        lease.release()
    held.release()

    # another shape: the victims' bytes go back to the pool and are allocated anew
    half = (1, 4, 32)
    (small,) = tier.allocate_many(half, torch.float32, 1, metrics=metrics)
    assert metrics.value("evicted_chunks") == 4 and len(tier) == 7
    assert tier.pool.used_bytes == 7 * CHUNK_BYTES + half[0] * half[1] * half[2] * 4
    small.release()
    tier.clear()
    assert tier.pool.used_bytes == 0


def _get_ptr(tier: CPUTier, key: bytes) -> int:
    lease = _get(tier, key)
    try:
        return lease.tensor.data_ptr()
    finally:
        lease.release()


def test_a_failing_pool_pass_loses_no_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool raising after evicted buffers were taken over: the error propagates and those
    buffers go back to the pool (the budget is not lost for the life of the process)."""
    tier, _ = _tier(4)
    for i in range(4):
        _put(tier, bytes([i]), float(i))
    held = _get(tier, bytes([3]))  # not evicted: one buffer stays in use

    def broken(*args: object) -> list[MemoryLease]:
        raise RuntimeError("pool broke")

    monkeypatch.setattr(tier.pool, "allocate_many", broken)
    with pytest.raises(RuntimeError, match="pool broke"):
        tier.allocate_many(SHAPE, torch.float32, 4)  # 3 taken over, the 4th needs the pool
    assert tier.pool.used_bytes == CHUNK_BYTES and len(tier) == 1
    held.release()
