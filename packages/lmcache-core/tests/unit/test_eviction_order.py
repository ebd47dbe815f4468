# SPDX-License-Identifier: Apache-2.0
"""Eviction that keeps prefixes usable: tail first within a request, orphans first, a store never
evicts its own prefix, the same in the CPU and disk tiers (issue 25, "hit rate under pressure").

A lookup stops at its first missing chunk, so a chunk whose predecessor is gone is worthless.
The engine tests replay what a serving engine does with one prompt (lookup, retrieve the hit,
store the rest with the hit masked) and compare the loaded bits with the source cache; the
:class:`PrefixLRU` test compares every victim with a naive reference model of the policy.
"""

from __future__ import annotations

import random
import struct
from pathlib import Path

import pytest
import torch
import xxhash

from lmcache.cache_engine import LMCacheEngine
from lmcache.config import LMCacheConfig
from lmcache.gpu_connector.interface import EngineInfo, TransferSpec
from lmcache.keys import chunk_keys
from lmcache.memory import HostMemoryPool, MemoryLease
from lmcache.metadata import LMCacheMetadata
from lmcache.metrics import LMCacheMetrics
from lmcache.testing import PagedCPUConnector
from lmcache.tiers import CPUTier, LowerTier, ReadRequest, chunk_format, tensor_checksum
from lmcache.tiers.chunk_format import HEADER_BYTES, ChunkHeader, CorruptChunk, fingerprint_digest
from lmcache.tiers.disk.tier import DiskTier
from lmcache.tiers.prefix_lru import PrefixLRU

CS = 4  # tokens per chunk
LAYERS, HEADS, HEAD = 2, 2, 4
WIDTH = HEADS * HEAD * 2
SLOTS = 256
DTYPE = torch.bfloat16
CHUNK_BYTES = LAYERS * CS * WIDTH * 2  # 256: a multiple of the pool alignment
SHAPE = (LAYERS, CS, WIDTH)


def _keys(n: int, seed: int = 0) -> list[bytes]:
    return [xxhash.xxh3_128_digest(f"{seed}/{i}".encode()) for i in range(n)]


def _cpu_tier(chunks: int) -> CPUTier:
    pool = HostMemoryPool(chunks * CHUNK_BYTES, pin=False, slab_bytes=chunks * CHUNK_BYTES)
    return CPUTier(pool, LMCacheMetrics())


def _put_chain(tier: CPUTier, keys: list[bytes], *, first_parent: bytes | None = None) -> None:
    """Store a run of one chain as the engine does: head first with parents, then touch it."""
    for i, key in enumerate(keys):
        lease = tier.allocate(SHAPE, DTYPE)
        assert lease is not None
        with lease:
            tier.put(key, lease, None, parent=keys[i - 1] if i else first_parent)
    tier.touch_many(keys)


def _eviction_order(tier: CPUTier, count: int) -> list[bytes]:
    """The keys ``count`` single allocations evict, in order, once the pool's free room is
    taken (the buffers are held meanwhile, then handed back)."""
    before = set(tier._entries)
    order: list[bytes] = []
    held: list[MemoryLease] = []
    try:
        while tier.pool.free_bytes >= CHUNK_BYTES:
            lease = tier.allocate(SHAPE, DTYPE)
            assert lease is not None and len(tier) == len(before)  # no eviction
            held.append(lease)
        for _ in range(count):
            lease = tier.allocate(SHAPE, DTYPE)
            assert lease is not None
            held.append(lease)
            gone = [k for k in before if not tier.contains(k) and k not in order]
            assert len(gone) == 1, gone
            order += gone
    finally:
        for lease in held:
            lease.release()
    return order


# ---------------------------------------------------------------------------- CPU tier orders


def test_tail_first_within_a_request() -> None:
    """A full tier evicts a request's chunks tail first, so what stays is always a prefix."""
    tier = _cpu_tier(6)
    a, b = _keys(3, seed=1), _keys(3, seed=2)
    _put_chain(tier, a)
    _put_chain(tier, b)  # b is more recent than a
    assert _eviction_order(tier, 6) == [a[2], a[1], a[0], b[2], b[1], b[0]]


def test_tail_first_after_a_lookup_reorders_the_chain() -> None:
    """A lookup (touch_many of the hit prefix) makes that prefix the most recent, head last to
    go; the chunks after it in the same chain stay older than everything touched."""
    tier = _cpu_tier(6)
    a, b = _keys(4, seed=1), _keys(2, seed=2)
    _put_chain(tier, a)
    _put_chain(tier, b)
    tier.touch_many(a[:2])  # a lookup that hit a's first two chunks
    assert _eviction_order(tier, 6) == [a[3], a[2], b[1], b[0], a[1], a[0]]


def test_orphans_go_first_least_recently_used_first() -> None:
    """Chunks whose parent is gone are evicted before any other entry, even more recent ones,
    the least recently used orphan first; a parent stored again adopts its children back."""
    tier = _cpu_tier(8)
    old = _keys(2, seed=9)
    _put_chain(tier, old)  # the least recently used entries
    a, b = _keys(3, seed=1), _keys(3, seed=2)
    _put_chain(tier, a)
    _put_chain(tier, b)
    assert tier.remove(a[0]) and tier.remove(b[1])  # e.g. checksum failures
    assert [tier.is_orphan(k) for k in a + b] == [False, True, False, False, False, True]
    assert not tier.is_orphan(a[2])  # its parent a[1] is there (an orphan itself)
    tier.touch(a[1])  # a[1] is now the most recent orphan: b[2] goes first
    # Orphans (b[2], then a[1] taking its child a[2]) before the LRU entries (old, tail first).
    assert _eviction_order(tier, 4) == [b[2], a[1], a[2], old[1]]

    # A parent arriving again adopts its present children: they stop being orphans.
    tier2 = _cpu_tier(8)
    c = _keys(3, seed=3)
    _put_chain(tier2, c)
    tier2.remove(c[0])
    assert tier2.is_orphan(c[1])
    _put_chain(tier2, c[:1])
    assert not tier2.is_orphan(c[1]) and not tier2.is_orphan(c[2])


def test_a_leased_child_outliving_its_parent_is_evicted_next() -> None:
    """A child leased while its parent is evicted stays, as an orphan, and is the first to go
    once released, although it is more recent than everything else."""
    tier = _cpu_tier(4)
    a, b = _keys(2, seed=1), _keys(2, seed=2)
    _put_chain(tier, a)
    _put_chain(tier, b)
    tier.touch(a[1])  # a[1] more recent than its parent: a[0] is the LRU entry
    held = tier.get(a[1])
    assert held is not None
    assert _eviction_order(tier, 1) == [a[0]]
    assert tier.is_orphan(a[1])
    held.release()
    assert _eviction_order(tier, 1) == [a[1]]  # not b[1], the least recently used otherwise


def test_allocation_never_evicts_the_protected_prefix() -> None:
    tier = _cpu_tier(4)
    mine, other = _keys(3, seed=1), _keys(1, seed=2)
    _put_chain(tier, other)
    _put_chain(tier, mine)  # other is the least recently used
    leases = tier.allocate_many(SHAPE, DTYPE, 3, protect=frozenset(mine))
    assert len(leases) == 1  # only `other` could go: fewer buffers, not a broken prefix
    assert [tier.contains(k) for k in mine] == [True] * 3 and not tier.contains(other[0])
    for lease in leases:
        lease.release()


# ---------------------------------------------------------------------------- PrefixLRU model


class _Reference:
    """A naive model of the policy: orphans by last use, then everything by last use."""

    def __init__(self) -> None:
        self.used: dict[int, int] = {}  # key -> tick of last use
        self.parent: dict[int, int | None] = {}
        self.tick = 0

    def use(self, key: int) -> None:
        self.tick += 1
        self.used[key] = self.tick

    def victim(self, evictable: set[int], protect: set[int]) -> int | None:
        def orphan(k: int) -> bool:
            p = self.parent[k]
            return p is not None and p not in self.used

        pool = [k for k in self.used if k in evictable and k not in protect]
        orphans = [k for k in pool if orphan(k)]
        pick = orphans or pool
        return min(pick, key=self.used.__getitem__) if pick else None


@pytest.mark.parametrize("seed", range(6))
def test_prefix_lru_matches_a_reference_model(seed: int) -> None:
    """Random adds (with parents, some absent), touches, chain touches and removals; every
    single-victim choice equals the reference model's, protected and leased keys excepted."""
    rng = random.Random(seed)
    lru: PrefixLRU[int] = PrefixLRU()
    ref = _Reference()
    for step in range(1500):
        op = rng.random()
        key = rng.randrange(60)
        if op < 0.35:
            parent = None if key % 10 == 0 else key - 1  # chains 0-9, 10-19, ...
            if rng.random() < 0.1:
                parent = None  # unknown parent: never an orphan
            lru.add(key, parent)
            ref.use(key)
            ref.parent[key] = parent
        elif op < 0.5:
            assert lru.touch(key) == (key in ref.used)
            if key in ref.used:
                ref.use(key)
        elif op < 0.6:
            run = list(range(key, min(key + rng.randrange(1, 5), (key // 10 + 1) * 10)))
            assert lru.touch_chain(run) == sum(k in ref.used for k in run)
            for k in reversed(run):
                if k in ref.used:
                    ref.use(k)
        elif op < 0.72:
            assert lru.discard(key) == (key in ref.used)
            ref.used.pop(key, None)
        else:
            evictable = {k for k in ref.used if rng.random() < 0.85}
            protect = {k for k in ref.used if rng.random() < 0.1}
            got = lru.victims(1, lambda k, ev=evictable: 1 if k in ev else None, protect)
            want = ref.victim(evictable, protect)
            assert got == ([] if want is None else [want]), (step, got, want)
            if got:
                lru.discard(got[0])
                ref.used.pop(got[0])
        assert len(lru) == len(ref.used)
        orphans = {k for k in ref.used if (p := ref.parent[k]) is not None and p not in ref.used}
        assert {k for k in lru if lru.is_orphan(k)} == orphans
        assert lru.num_orphans == len(orphans)


def test_victims_take_descendants_with_their_ancestor() -> None:
    lru: PrefixLRU[str] = PrefixLRU()
    lru.add("x")
    for name, parent in (("a", None), ("b", "a"), ("c", "b"), ("d", "a")):
        lru.add(name, parent)
    lru.touch("x")
    lru.touch("a")  # the LRU entry is now b; its descendant c goes with it, before d
    assert lru.victims(2, lambda k: 1) == ["b", "c"]
    assert lru.ancestors("c") == {"a", "b", "c"}
    assert lru.victims(10, lambda k: 1, protect=lru.ancestors("b")) == ["c", "d", "x"]


# ---------------------------------------------------------------------------- through the engine


def _metadata() -> LMCacheMetadata:
    return LMCacheMetadata(
        "test/model", 1, 0, 0, 1, DTYPE, LAYERS, HEADS, HEAD, HEAD, chunk_size=CS
    )


class Rig:
    """An engine with a paged CPU connector (one-token pages) over ``src``; loads go into a
    NaN-poisoned cache and are compared bit for bit with ``src``."""

    def __init__(
        self,
        tier: CPUTier,
        lower: tuple[LowerTier, ...] = (),
        *,
        local_cpu: bool = True,
    ) -> None:
        self.config = LMCacheConfig(chunk_size=CS, local_cpu=local_cpu, max_local_cpu_size=1.0)
        self.metadata = _metadata()
        gen = torch.Generator().manual_seed(3)
        self.src = [torch.randn(SLOTS, 1, WIDTH, generator=gen).to(DTYPE) for _ in range(LAYERS)]
        self.engine = LMCacheEngine(
            self.config, self.metadata, self._connector(self.src), tier=tier, lower_tiers=lower
        )

    def _connector(self, caches: list[torch.Tensor]) -> PagedCPUConnector:
        info = EngineInfo("mock", "cpu", caches, extra={"page_size": 1})
        return PagedCPUConnector(self.config, self.metadata, info)

    def serve(self, tokens: torch.Tensor) -> int:
        """One request as a serving engine makes it: lookup, load the hit (checked bit for bit
        against ``src``), store the rest with the hit masked. Returns the tokens hit."""
        n = len(tokens)
        slots = torch.arange(n)
        hit = self.engine.lookup(tokens)
        if hit:
            dst = [torch.full((SLOTS, 1, WIDTH), float("nan"), dtype=DTYPE) for _ in self.src]
            self.engine.set_gpu_connector(self._connector(dst))
            try:
                loaded = self.engine.retrieve(tokens, None, TransferSpec(slots))
            finally:
                self.engine.set_gpu_connector(self._connector(self.src))
            assert int(loaded.sum()) == hit and bool(loaded[:hit].all())
            for d, s in zip(dst, self.src, strict=True):
                assert torch.equal(d[:hit].view(torch.int16), s[:hit].view(torch.int16))
                assert bool(d[hit:n].isnan().all())
        mask = torch.ones(n, dtype=torch.bool)
        mask[:hit] = False
        self.engine.store(tokens, mask, TransferSpec(slots))
        for lower in self.engine.lower_tiers:
            assert lower.flush(30)
        return hit

    def keys(self, tokens: torch.Tensor) -> list[bytes]:
        return chunk_keys(tokens, self.metadata.fingerprint(), CS, salt="\0")


def _prompt(chunks: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + seed)
    return torch.randint(0, 50_000, (chunks * CS,), generator=gen)


def test_a_prompt_larger_than_the_cpu_tier_hits_the_same_every_time() -> None:
    """7 chunks into room for 4, repeated: after the first run every run hits the 4 head
    chunks (the old LRU alternated 4 and 1 chunks: storing the tail evicted the head)."""
    rig = Rig(_cpu_tier(4))
    tokens = _prompt(7)
    hits = [rig.serve(tokens) for _ in range(6)]
    assert hits == [0] + [4 * CS] * 5
    keys = rig.keys(tokens)
    assert [rig.engine.tier.contains(k) for k in keys] == [True] * 4 + [False] * 3


def test_a_store_does_not_evict_its_own_prefix_but_evicts_others() -> None:
    """Room for 6: a 7-chunk prompt evicts another prompt's 2 chunks to store 6 of its own,
    then, repeated, never evicts its own head to store its 7th."""
    tier = _cpu_tier(6)
    rig = Rig(tier)
    other, mine = _prompt(2, seed=1), _prompt(7, seed=2)
    assert rig.serve(other) == 0
    assert rig.serve(mine) == 0
    assert [tier.contains(k) for k in rig.keys(mine)] == [True] * 6 + [False]
    assert not any(tier.contains(k) for k in rig.keys(other))
    assert rig.engine.metrics.value("evicted_chunks") == 2
    assert [rig.serve(mine) for _ in range(3)] == [6 * CS] * 3
    assert rig.engine.metrics.value("evicted_chunks") == 2  # never its own prefix
    assert rig.engine.metrics.value("failed_allocations") == 4  # the 7th chunk, each time


def test_a_prompt_larger_than_the_disk_quota_hits_the_same_every_time(tmp_path: Path) -> None:
    """The disk tier alone (host memory only stages): quota for 4 chunks, a 7-chunk prompt
    repeated. The writer declines the chunks that would evict their own prefix."""
    disk = DiskTier(str(tmp_path), 4 * (HEADER_BYTES + CHUNK_BYTES), fsync=False)
    try:
        rig = Rig(_cpu_tier(16), (disk,), local_cpu=False)
        tokens = _prompt(7)
        hits = [rig.serve(tokens) for _ in range(5)]
        assert hits == [0] + [4 * CS] * 4
        keys = rig.keys(tokens)
        assert disk.contains(rig.engine._tiers.fp_digest, keys, LMCacheMetrics()) == (
            [True] * 4 + [False] * 3
        )
        assert len(rig.engine.tier) == 0
    finally:
        disk.close()


# ---------------------------------------------------------------------------- disk tier orders


class _Lease:
    """What a lower tier needs of a lease: ``tensor``, ``nbytes``, ``share``/``release``."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.nbytes = tensor.numel() * tensor.element_size()

    def share(self) -> _Lease:
        return self

    def release(self) -> None:
        pass


FP = fingerprint_digest(b"eviction-order")


def _disk_chain(disk: DiskTier, keys: list[bytes], first_parent: bytes | None = None) -> None:
    chunks: list[tuple[bytes, MemoryLease, int | None]] = []
    for key in keys:
        data = torch.full(SHAPE, float(key[0]), dtype=DTYPE)
        chunks.append((key, _Lease(data), tensor_checksum(data)))  # type: ignore[arg-type]
    parents = [first_parent, *keys[:-1]]
    assert disk.submit_chain(FP, chunks, LMCacheMetrics(), parents=parents) == len(keys)
    assert disk.flush(30)


def _disk_order(disk: DiskTier, count: int) -> list[bytes]:
    """The first ``count`` keys that writes of fresh root chunks evict, in order."""
    before = [ident[1] for ident in disk._index]
    order: list[bytes] = []
    for key in _keys(count + len(before), seed=99):
        _disk_chain(disk, [key])
        gone = [k for k in before if k not in order and not _on_disk(disk, k)]
        assert len(gone) <= 1, gone
        order += gone
        if len(order) == count:
            break
    return order


def _on_disk(disk: DiskTier, key: bytes) -> bool:
    return disk.contains(FP, [key], LMCacheMetrics())[0]


def test_disk_tail_first_and_orphans_first_survive_a_restart(tmp_path: Path) -> None:
    quota = 6 * (HEADER_BYTES + CHUNK_BYTES)
    disk = DiskTier(str(tmp_path), quota, fsync=False)
    a, b = _keys(3, seed=1), _keys(3, seed=2)
    _disk_chain(disk, a)
    _disk_chain(disk, b)
    disk.close()
    (tmp_path / FP.hex() / f"{b[0].hex()}.lmc").unlink()  # b's head lost: b[1], b[2] orphans
    again = DiskTier(str(tmp_path), quota, fsync=False)  # parents come back from the headers
    try:
        assert [again._order.is_orphan((FP, k)) for k in a + b[1:]] == [False] * 3 + [True, False]
        # Orphans first (b[1] with its child b[2]), then a tail first: b is more recent than a.
        assert _disk_order(again, 5) == [b[1], b[2], a[2], a[1], a[0]]
    finally:
        again.close()


def test_disk_writer_never_evicts_the_prefix_it_extends(tmp_path: Path) -> None:
    disk = DiskTier(str(tmp_path), 4 * (HEADER_BYTES + CHUNK_BYTES), fsync=False)
    try:
        metrics = LMCacheMetrics()
        other, mine = _keys(1, seed=1), _keys(7, seed=2)
        _disk_chain(disk, other)
        chunks = []
        for key in mine:
            data = torch.full(SHAPE, 1.0, dtype=DTYPE)
            chunks.append((key, _Lease(data), tensor_checksum(data)))
        disk.submit_chain(FP, chunks, metrics, parents=[None, *mine[:-1]])  # type: ignore[arg-type]
        assert disk.flush(30)
        # 0-2 fit, 3 evicts `other`; 4 could only evict the prefix: declined, 5-6 dropped.
        assert [_on_disk(disk, k) for k in mine] == [True] * 4 + [False] * 3
        assert not _on_disk(disk, other[0])
        assert metrics.value("disk_stored_chunks") == 4 and metrics.value("dropped_writes") == 3
        assert disk.used_bytes <= disk.max_bytes
        out = [torch.empty(SHAPE, dtype=DTYPE) for _ in mine[:4]]
        reqs = [ReadRequest(k, o) for k, o in zip(mine[:4], out, strict=True)]
        assert disk.read_into(FP, reqs, metrics) == 4
        assert all(bool((o == 1.0).all()) for o in out)
    finally:
        disk.close()


# ---------------------------------------------------------------------------- chunk format


def _header(parent: bytes | None) -> ChunkHeader:
    return ChunkHeader(b"k" * 16, b"f" * 16, (2, 4, 16), torch.bfloat16, 256, 0x1234, parent)


def test_a_header_without_parent_is_version_1_byte_for_byte() -> None:
    """Without a parent the header is exactly the version-1 layout older readers know."""
    fields = struct.pack(
        "<4sHH16s16sIII16sQQ",
        b"LMCK",
        1,
        0,
        b"k" * 16,
        b"f" * 16,
        2,
        4,
        16,
        b"bfloat16",
        256,
        0x1234,
    )
    v1 = fields + struct.pack("<Q", xxhash.xxh3_64_intdigest(fields))
    assert _header(None).encode() == v1 + bytes(HEADER_BYTES - len(v1))


def test_a_parent_round_trips_and_a_version_1_reader_rejects_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parent = b"p" * 16
    data = _header(parent).encode()
    assert len(data) == HEADER_BYTES
    assert ChunkHeader.decode(data) == _header(parent)
    assert ChunkHeader.decode(_header(None).encode()).parent is None
    flipped = bytearray(data)
    flipped[90] ^= 1  # inside the parent field: the header checksum covers it
    with pytest.raises(CorruptChunk, match="header checksum"):
        ChunkHeader.decode(bytes(flipped))
    monkeypatch.setattr(chunk_format, "READ_VERSIONS", (1,))  # a reader of version 1 only
    with pytest.raises(CorruptChunk, match="format version 2"):
        ChunkHeader.decode(data)
