# SPDX-License-Identifier: Apache-2.0
"""``lmcache.tiers.cascade``: the CPU -> lower tiers cascade as functions over a TierStack.

Real tiers: a :class:`CPUTier` over an unpinned host pool and :class:`DiskTier` folders in
``tmp_path`` (a subclass counts the batched lookups it answers).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
import xxhash

from lmcache.memory import HostMemoryPool, MemoryLease
from lmcache.metrics import LMCacheMetrics
from lmcache.tiers import CPUTier, LowerTier, cascade
from lmcache.tiers.disk.tier import DiskTier

SHAPE = (2, 4, 16)
DTYPE = torch.bfloat16
CHUNK_BYTES = 2 * 4 * 16 * 2
FP = b"test-model-fingerprint"


class CountingDisk(DiskTier):
    """A real disk tier that counts the batched existence queries it answers."""

    def __init__(self, path: Path) -> None:
        super().__init__(str(path), 64 * (CHUNK_BYTES + 4096), fsync=False)
        self.exists_calls = 0

    def _exists(self, fingerprint: bytes, keys: Sequence[bytes]) -> list[bool]:
        self.exists_calls += 1
        return super()._exists(fingerprint, keys)


def _stack(lower: Sequence[LowerTier], *, local_cpu: bool = True) -> cascade.TierStack:
    metrics = LMCacheMetrics()
    pool = HostMemoryPool(32 * CHUNK_BYTES, pin=False, slab_bytes=32 * CHUNK_BYTES)
    return cascade.TierStack(CPUTier(pool, metrics), tuple(lower), FP, metrics, local_cpu=local_cpu)


def _keys(n: int, seed: int = 0) -> list[bytes]:
    return [xxhash.xxh3_128_digest(f"{seed}/{i}".encode()) for i in range(n)]


def _chunks(n: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=gen).to(DTYPE) for _ in range(n)]


def _store(stack: cascade.TierStack, keys: Sequence[bytes], data: Sequence[torch.Tensor]) -> int:
    todo = cascade.keys_to_store(stack, keys)
    leases: list[MemoryLease] = []
    try:
        for i in todo:
            lease = stack.cpu.allocate(SHAPE, DTYPE)
            assert lease is not None
            lease.tensor.copy_(data[i])
            leases.append(lease)
        done = cascade.publish(
            stack, [(keys[i], lease) for i, lease in zip(todo, leases, strict=True)]
        )
    finally:
        for lease in leases:
            lease.release()
    assert cascade.flush(stack, 30)
    return done


def _hit(stack: cascade.TierStack, keys: Sequence[bytes]) -> list[torch.Tensor]:
    leases = cascade.hit_run(stack, keys, [SHAPE] * len(keys), DTYPE)
    out = [lease.tensor.clone() for lease in leases]
    for lease in leases:
        lease.release()
    return out


def _bits_equal(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(a, b, strict=True)
    )


def test_lookup_spans_tiers_with_one_batched_query_per_lower_tier(tmp_path: Path) -> None:
    first, second = CountingDisk(tmp_path / "a"), CountingDisk(tmp_path / "b")
    keys, data = _keys(6), _chunks(6)
    _store(_stack([first]), keys[:4], data[:4])  # chunks 0-3 in folder a
    _store(_stack([second]), keys[4:], data[4:])  # chunks 4-5 in folder b
    stack = _stack([first, second])
    first.exists_calls = second.exists_calls = 0
    assert cascade.stored_prefix(stack, keys) == 6
    assert (first.exists_calls, second.exists_calls) == (1, 1)
    assert cascade.stored_prefix(stack, [*keys[:3], _keys(1, seed=9)[0], keys[4]]) == 3
    got = _hit(stack, keys)
    assert _bits_equal(got, data)
    assert stack.metrics.value("disk_hit_chunks") == 6
    assert len(stack.cpu) == 6  # promoted
    assert _bits_equal(_hit(stack, keys), data)
    assert stack.metrics.value("disk_hit_chunks") == 6  # served from host memory now
    for tier in (first, second):
        tier.close()


def test_write_through_restart_and_corruption(tmp_path: Path) -> None:
    keys, data = _keys(4, seed=1), _chunks(4, seed=1)
    disk = DiskTier(str(tmp_path / "d"), 64 * (CHUNK_BYTES + 4096), fsync=False)
    writer = _stack([disk])
    assert _store(writer, keys, data) == 4
    assert len(writer.cpu) == 4 and writer.metrics.value("disk_stored_chunks") == 4
    disk.close()
    path = tmp_path / "d" / writer.fp_digest.hex() / f"{keys[2].hex()}.lmc"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x01
    path.write_bytes(bytes(raw))
    reopened = DiskTier(str(tmp_path / "d"), 64 * (CHUNK_BYTES + 4096), fsync=False)
    reader = _stack([reopened])
    assert cascade.stored_prefix(reader, keys) == 4  # a lookup reads no bytes
    assert _bits_equal(_hit(reader, keys), data[:2])
    assert reader.metrics.value("checksum_failures") == 1
    assert cascade.stored_prefix(reader, keys) == 2
    cascade.clear(reader)
    assert cascade.stored_prefix(reader, keys) == 0 and len(reader.cpu) == 0
    reopened.close()


def test_local_cpu_false_stages_only(tmp_path: Path) -> None:
    keys, data = _keys(3, seed=2), _chunks(3, seed=2)
    disk = DiskTier(str(tmp_path / "d"), 64 * (CHUNK_BYTES + 4096), fsync=False)
    stack = _stack([disk], local_cpu=False)
    assert _store(stack, keys, data) == 3
    assert len(stack.cpu) == 0 and stack.cpu.pool.used_bytes == 0
    assert cascade.keys_to_store(stack, keys) == []  # every lower tier holds them
    assert _bits_equal(_hit(stack, keys), data)
    assert len(stack.cpu) == 0 and stack.cpu.pool.used_bytes == 0
    assert cascade.keys_to_store(_stack([], local_cpu=False), keys) == []  # stores nothing
    disk.close()


def test_cpu_lease_callback_is_asked_first(tmp_path: Path) -> None:
    keys, data = _keys(2, seed=3), _chunks(2, seed=3)
    stack = _stack([])
    _store(stack, keys, data)
    asked: list[int] = []

    def lease(i: int) -> MemoryLease | None:
        asked.append(i)
        return cascade.cpu_get(stack, keys[i], SHAPE, DTYPE) if i == 0 else None

    leases = cascade.hit_run(stack, keys, [SHAPE, SHAPE], DTYPE, cpu_lease=lease)
    assert asked == [0, 1] and len(leases) == 1
    leases[0].release()
    assert cascade.cpu_get(stack, keys[0], (2, 2, 16), DTYPE) is None  # another shape: a miss


@pytest.mark.parametrize("local_cpu", [True, False])
def test_stores_anything(local_cpu: bool, tmp_path: Path) -> None:
    assert _stack([], local_cpu=local_cpu).stores_anything is local_cpu
    disk = DiskTier(str(tmp_path / "d"), 64 * (CHUNK_BYTES + 4096), fsync=False)
    assert _stack([disk], local_cpu=local_cpu).stores_anything
    disk.close()
