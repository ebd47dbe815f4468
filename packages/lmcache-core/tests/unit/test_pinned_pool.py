# SPDX-License-Identifier: Apache-2.0
"""HostMemoryPool and MemoryLease: budget, alignment, sharing, misuse, thread safety."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from lmcache.memory import ALIGNMENT, HostMemoryPool, LeaseError, MemoryLease


def _lease(pool: HostMemoryPool, shape: tuple[int, ...], dtype: torch.dtype) -> MemoryLease:
    lease = pool.allocate(shape, dtype)
    assert lease is not None, f"allocation of {shape} {dtype} failed in {pool}"
    return lease


def test_allocate_gives_shape_dtype_and_aligned_accounting() -> None:
    pool = HostMemoryPool(1 << 20, pin=False, slab_bytes=1 << 16)
    a = _lease(pool, (2, 3, 5), torch.bfloat16)  # 60 bytes -> one 256-byte unit
    b = _lease(pool, (7,), torch.float32)
    assert a.tensor.shape == (2, 3, 5) and a.tensor.dtype == torch.bfloat16
    assert a.nbytes == 60 and b.nbytes == 28
    assert pool.used_bytes == 2 * ALIGNMENT
    assert pool.free_bytes == pool.budget_bytes - 2 * ALIGNMENT
    assert (b.tensor.data_ptr() - a.tensor.data_ptr()) % ALIGNMENT == 0
    assert not pool.pinned
    a.release()
    b.release()
    assert pool.used_bytes == 0


def test_leases_do_not_overlap() -> None:
    pool = HostMemoryPool(1 << 16, pin=False, slab_bytes=4096)
    leases = [_lease(pool, (100 + i,), torch.int32) for i in range(20)]
    for i, lease in enumerate(leases):
        lease.tensor.fill_(i)
    for i, lease in enumerate(leases):
        assert torch.equal(lease.tensor, torch.full_like(lease.tensor, i))
        lease.release()
    assert pool.used_bytes == 0


def test_budget_is_respected_and_bytes_return_on_release() -> None:
    pool = HostMemoryPool(4 * ALIGNMENT, pin=False, slab_bytes=4 * ALIGNMENT)
    leases = [_lease(pool, (ALIGNMENT,), torch.uint8) for _ in range(4)]
    assert pool.allocate((1,), torch.uint8) is None
    assert pool.allocate((5 * ALIGNMENT,), torch.uint8) is None
    assert pool.reserved_bytes <= pool.budget_bytes
    leases[2].release()
    again = pool.allocate((ALIGNMENT,), torch.uint8)
    assert again is not None
    assert again.tensor.data_ptr() == leases[3].tensor.data_ptr() - ALIGNMENT  # reused hole
    for lease in [leases[0], leases[1], leases[3], again]:
        lease.release()
    assert pool.used_bytes == 0


def test_zero_budget_allocates_nothing() -> None:
    pool = HostMemoryPool(0, pin=False)
    assert pool.allocate((1,), torch.uint8) is None
    assert pool.reserved_bytes == 0


def test_slabs_are_lazy() -> None:
    pool = HostMemoryPool(1 << 30, pin=False, slab_bytes=1 << 20)
    assert pool.reserved_bytes == 0
    with _lease(pool, (10,), torch.uint8):
        assert pool.reserved_bytes == 1 << 20


def test_free_ranges_coalesce() -> None:
    pool = HostMemoryPool(4 * ALIGNMENT, pin=False, slab_bytes=4 * ALIGNMENT)
    a, b, c, d = (_lease(pool, (ALIGNMENT,), torch.uint8) for _ in range(4))
    c.release()
    b.release()  # b and c merge into one 2-unit hole
    big = pool.allocate((2 * ALIGNMENT,), torch.uint8)
    assert big is not None
    assert big.tensor.data_ptr() == a.tensor.data_ptr() + ALIGNMENT
    for lease in (a, d, big):
        lease.release()
    whole = pool.allocate((4 * ALIGNMENT,), torch.uint8)  # everything merged back
    assert whole is not None
    whole.release()


def test_large_allocation_gets_its_own_slab_within_budget() -> None:
    pool = HostMemoryPool(8 * ALIGNMENT, pin=False, slab_bytes=2 * ALIGNMENT)
    small = _lease(pool, (10,), torch.uint8)
    small.release()  # leaves an empty shared slab of 2 units
    big = pool.allocate((8 * ALIGNMENT,), torch.uint8)  # needs the empty slab dropped
    assert big is not None and big.tensor.shape == (8 * ALIGNMENT,)
    assert pool.reserved_bytes == 8 * ALIGNMENT
    assert pool.allocate((1,), torch.uint8) is None
    big.release()
    assert pool.reserved_bytes == 0 and pool.used_bytes == 0
    assert pool.allocate((9 * ALIGNMENT,), torch.uint8) is None


def test_share_keeps_bytes_until_last_release() -> None:
    pool = HostMemoryPool(1 << 16, pin=False)
    lease = _lease(pool, (4, 4), torch.float32)
    other = lease.share()
    assert lease.ref_count == 2 and other.tensor.data_ptr() == lease.tensor.data_ptr()
    lease.release()
    assert other.ref_count == 1 and pool.used_bytes == ALIGNMENT
    other.tensor.fill_(3.0)  # still valid
    other.release()
    assert pool.used_bytes == 0


def test_misuse_raises_lease_error() -> None:
    pool = HostMemoryPool(1 << 16, pin=False)
    lease = _lease(pool, (8,), torch.float16)
    lease.release()
    with pytest.raises(LeaseError, match="already released"):
        lease.release()
    with pytest.raises(LeaseError, match=r"lease\.tensor"):
        _ = lease.tensor
    with pytest.raises(LeaseError):
        lease.share()
    assert lease.released and pool.used_bytes == 0


def test_context_manager_releases() -> None:
    pool = HostMemoryPool(1 << 16, pin=False)
    with _lease(pool, (8,), torch.float16) as lease:
        assert pool.used_bytes == ALIGNMENT
    assert lease.released and pool.used_bytes == 0
    with pytest.raises(LeaseError):
        _ = lease.tensor


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="budget_bytes"):
        HostMemoryPool(-1)
    with pytest.raises(ValueError, match="slab_bytes"):
        HostMemoryPool(10, slab_bytes=0)
    with pytest.raises(ValueError, match="negative"):
        HostMemoryPool(1 << 10, pin=False).allocate((-1, 2), torch.uint8)


def test_pin_default_follows_cuda() -> None:
    assert HostMemoryPool(1 << 10).pinned == torch.cuda.is_available()


def test_two_threads_allocate_and_release() -> None:
    pool = HostMemoryPool(64 * ALIGNMENT, pin=False, slab_bytes=16 * ALIGNMENT)
    errors: list[str] = []

    def worker(tag: int) -> None:
        rng = random.Random(tag)
        held: list[tuple[MemoryLease, int]] = []
        for step in range(400):
            if held and (rng.random() < 0.5 or len(held) > 8):
                lease, value = held.pop(rng.randrange(len(held)))
                if not bool((lease.tensor == value).all()):
                    errors.append(f"thread {tag}: lease bytes overwritten by another lease")
                lease.release()
                continue
            new = pool.allocate((rng.randint(1, 3 * ALIGNMENT),), torch.uint8)
            if new is None:
                continue
            value = (tag * 100 + step) % 251
            new.tensor.fill_(value)
            held.append((new, value))
        for remaining, _ in held:
            remaining.release()

    threads = [threading.Thread(target=worker, args=(t,)) for t in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert pool.used_bytes == 0
    assert pool.reserved_bytes <= pool.budget_bytes
    whole = pool.allocate((16 * ALIGNMENT,), torch.uint8)  # free lists fully coalesced
    assert whole is not None
    whole.release()


def test_chunks_leased_under_inference_mode_are_writable_outside_it() -> None:
    """Engines run under torch.inference_mode(); leased buffers must stay ordinary tensors."""
    pool = HostMemoryPool(1 << 20, pin=False)
    with torch.inference_mode():
        lease = pool.allocate((4, 8), torch.float32)
    assert lease is not None
    assert not lease.tensor.is_inference()
    lease.tensor.fill_(3.0)  # would raise for an inference tensor or a view made in that mode
    assert torch.equal(lease.tensor, torch.full((4, 8), 3.0))
    lease.release()


def test_pinned_pools_pin_the_budget_ahead_of_need(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pinned pool reserves its whole budget on a background thread from construction on, so
    allocations find slabs waiting instead of pinning inside a store. (On this CPU-only machine
    the slab factory makes pageable slabs; the real pinning runs in the CUDA test below.)"""
    made: list[tuple[int, str]] = []
    real_new_slab = HostMemoryPool._new_slab

    def new_slab(self: HostMemoryPool, size: int, *, dedicated: bool) -> object:
        made.append((size, threading.current_thread().name))
        self._pin = False  # pageable stand-in for a pinned slab
        try:
            return real_new_slab(self, size, dedicated=dedicated)
        finally:
            self._pin = True

    monkeypatch.setattr(HostMemoryPool, "_new_slab", new_slab)
    pool = HostMemoryPool(5 << 20, pin=True, slab_bytes=2 << 20)
    assert pool.wait_prepinned(timeout=10)
    assert pool.reserved_bytes == 5 << 20  # slabs of 2, 2 and 1 MiB
    assert [size for size, _ in made] == [2 << 20, 2 << 20, 1 << 20]
    assert {name for _, name in made} == {"lmcache-prepin"}
    leases = [pool.allocate((1 << 20,), torch.uint8) for _ in range(5)]
    assert all(lease is not None for lease in leases)
    assert len(made) == 3  # no slab was made by an allocation
    lazy = HostMemoryPool(5 << 20, pin=True, slab_bytes=2 << 20, prepin=False)
    assert lazy.wait_prepinned(timeout=0) and lazy.reserved_bytes == 0  # control: lazy pinning


@pytest.mark.gpu
def test_prepinned_slabs_are_page_locked() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (page-locked host memory)")
    pool = HostMemoryPool(64 << 20, slab_bytes=16 << 20)
    assert pool.pinned and pool.wait_prepinned(timeout=60)
    assert pool.reserved_bytes == 64 << 20
    assert all(slab.tensor.is_pinned() for slab in pool._slabs)
    lease = pool.allocate((1 << 20,), torch.uint8)
    assert lease is not None and lease.tensor.is_pinned()


def test_allocate_many_matches_allocate_and_packs_back_to_back() -> None:
    """``allocate_many`` gives leases like ``allocate`` (shape, dtype, aligned accounting,
    independent bytes, release), back to back where a free range holds several, across slabs
    when one fills, and stops at the budget with the leases it could make."""
    pool = HostMemoryPool(10 * ALIGNMENT, pin=False, slab_bytes=4 * ALIGNMENT)
    hole = _lease(pool, (1,), torch.uint8)  # offset 0 of the first slab
    many = pool.allocate_many((3, 50), torch.bfloat16, 3)  # 300 bytes: two units each
    assert [tuple(x.tensor.shape) for x in many] == [(3, 50)] * 3
    assert all(x.tensor.dtype == torch.bfloat16 and x.nbytes == 300 for x in many)
    # the first slab has 3 units left after the hole: one pair fits there, the rest in slab 2
    assert many[0].tensor.data_ptr() - hole.tensor.data_ptr() == ALIGNMENT
    assert many[2].tensor.data_ptr() - many[1].tensor.data_ptr() == 2 * ALIGNMENT
    assert pool.used_bytes == 7 * ALIGNMENT
    for i, x in enumerate(many):
        x.tensor.fill_(i)
    for i, x in enumerate(many):
        assert torch.equal(x.tensor, torch.full((3, 50), float(i), dtype=torch.bfloat16))
    more = pool.allocate_many((3, 50), torch.bfloat16, 5)  # 3 units left: one more fits
    assert len(more) == 1 and pool.used_bytes == 9 * ALIGNMENT
    for x in [hole, *many, *more]:
        x.release()
    assert pool.used_bytes == 0
    assert pool.allocate_many((0,), torch.float32, 2)[0].tensor.shape == (0,)
    with pytest.raises(ValueError, match="negative"):
        pool.allocate_many((2,), torch.uint8, -1)


def test_allocate_many_under_inference_mode_gives_writable_chunks() -> None:
    pool = HostMemoryPool(1 << 16, pin=False)
    with torch.inference_mode():
        leases = pool.allocate_many((4, 4), torch.float32, 3)
    for lease in leases:
        assert not lease.tensor.is_inference()
        lease.tensor.add_(1)
        lease.release()
