# SPDX-License-Identifier: Apache-2.0
"""CPUTier.get_many: a run of keys leased under one lock and verified in one batch of checksums,
with get()'s semantics; batch checksums equal to tensor_checksum bit for bit."""

from __future__ import annotations

import pytest
import torch
import xxhash

from lmcache.memory import HostMemoryPool, MemoryLease
from lmcache.metrics import LMCacheMetrics
from lmcache.tiers import CHECKSUM_SLICE_BYTES, CPUTier, tensor_checksum
from lmcache.tiers.checksum import batch_checksums

SHAPE = (2, 4, 32)  # float32: 1024 bytes
CHUNK_BYTES = 2 * 4 * 32 * 4


def _tier(chunks: int) -> tuple[CPUTier, LMCacheMetrics]:
    metrics = LMCacheMetrics()
    pool = HostMemoryPool(chunks * CHUNK_BYTES, pin=False, slab_bytes=chunks * CHUNK_BYTES)
    return CPUTier(pool, metrics), metrics


def _fill(tier: CPUTier, keys: list[bytes], *, checksum: bool = True) -> None:
    """Store ``keys`` as one back-to-back allocation, chunk ``i`` filled with ``i``."""
    leases = tier.allocate_many(SHAPE, torch.float32, len(keys))
    assert len(leases) == len(keys)
    for i, (key, lease) in enumerate(zip(keys, leases, strict=True)):
        with lease:
            lease.tensor.fill_(float(i))
            tier.put(key, lease, tensor_checksum(lease.tensor) if checksum else None)


def _corrupt(tier: CPUTier, key: bytes) -> None:
    lease = tier.get(key)
    assert lease is not None
    with lease:
        lease.tensor.view(torch.uint8).reshape(-1)[5] ^= 0x10


def _release(leases: list[MemoryLease]) -> None:
    for lease in leases:
        lease.release()


def test_get_many_leases_the_stored_run_verified_in_one_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tier, metrics = _tier(8)
    keys = [b"k%d" % i for i in range(5)]
    _fill(tier, keys)
    batches: list[int] = []
    real = tier.checksums
    monkeypatch.setattr(tier, "checksums", lambda ts: batches.append(len(ts)) or real(ts))
    leases = tier.get_many([*keys[:4], b"missing", keys[4]])
    assert batches == [4]  # one batch for the run, none for what follows the miss
    assert [float(x.tensor[0, 0, 0]) for x in leases] == [0.0, 1.0, 2.0, 3.0]
    assert all(x.ref_count == 2 for x in leases)  # the tier's and ours
    _release(leases)
    assert tier.get_many([]) == [] and tier.get_many([b"missing", keys[0]]) == []
    assert metrics.value("checksum_failures") == 0


def test_a_corrupt_chunk_ends_the_run_is_counted_and_dropped() -> None:
    tier, metrics = _tier(8)
    keys = [b"k%d" % i for i in range(5)]
    _fill(tier, keys)
    _corrupt(tier, keys[2])
    caller = LMCacheMetrics()
    leases = tier.get_many(keys, metrics=caller)
    assert [float(x.tensor[0, 0, 0]) for x in leases] == [0.0, 1.0]  # the run before it
    assert caller.value("checksum_failures") == 1 and metrics.value("checksum_failures") == 0
    assert not tier.contains(keys[2])  # dropped, as get() drops it
    for key in keys[3:]:  # after it: still stored, our shares released
        assert tier.contains(key)
        with tier.get(key) as lease:  # type: ignore[union-attr]
            assert lease.ref_count == 2
    _release(leases)
    assert tier.pool.used_bytes == 4 * CHUNK_BYTES


def test_chunks_stored_without_a_checksum_are_not_verified() -> None:
    tier, metrics = _tier(4)
    _fill(tier, [b"a", b"b"], checksum=False)
    _corrupt(tier, b"a")
    leases = tier.get_many([b"a", b"b"])
    assert len(leases) == 2 and metrics.value("checksum_failures") == 0
    _release(leases)


def test_get_many_marks_the_run_used_head_most_recent() -> None:
    tier, _ = _tier(4)
    _fill(tier, [b"a", b"b", b"c", b"d"])
    _release(tier.get_many([b"c", b"d"]))  # c, d now more recent than a, b; c the most recent
    evicted = []
    for i in range(4):
        lease = tier.allocate(SHAPE, torch.float32)
        assert lease is not None
        tier.put(b"new%d" % i, lease, None)
        lease.release()
        evicted += [
            k for k in (b"a", b"b", b"c", b"d") if not tier.contains(k) and k not in evicted
        ]
    assert evicted == [b"a", b"b", b"d", b"c"]


def test_a_subclass_with_its_own_get_gets_a_loop_of_it() -> None:
    class Counting(CPUTier):
        calls = 0

        def get(self, key: bytes, *, metrics: LMCacheMetrics | None = None) -> MemoryLease | None:
            Counting.calls += 1
            return super().get(key, metrics=metrics)

    metrics = LMCacheMetrics()
    tier = Counting(HostMemoryPool(4 * CHUNK_BYTES, pin=False), metrics)
    _fill(tier, [b"a", b"b"])
    Counting.calls = 0
    leases = tier.get_many([b"a", b"b", b"c", b"a"])
    assert len(leases) == 2 and Counting.calls == 3
    _release(leases)


def test_batch_checksums_equal_tensor_checksum() -> None:
    big = torch.randint(0, 256, (2 * CHECKSUM_SLICE_BYTES + 3,), dtype=torch.uint8)
    base = torch.randn(64, 33)
    tensors = [
        torch.randn(SHAPE).to(torch.bfloat16),
        base[5:9],  # a contiguous view at an offset of its storage
        torch.empty(0, 4),
        big,
        torch.arange(7, dtype=torch.int16),
    ]
    expected = [tensor_checksum(t) for t in tensors]
    assert batch_checksums(tensors) == expected
    assert batch_checksums(tensors[:3]) == expected[:3]
    assert expected[1] == xxhash.xxh3_64_intdigest(base[5:9].numpy().tobytes())
    assert expected[2] == xxhash.xxh3_64_intdigest(b"")
    with pytest.raises(ValueError, match="contiguous"):
        batch_checksums([tensors[0], base.t()])
