# SPDX-License-Identifier: Apache-2.0
"""Engine processes share chunks through a real node cache owner: what one stores, another reads
byte for byte (checksums verified), other salts and models see nothing, corrupted bytes are a
counted miss, and eviction keeps every chain a prefix whichever process stored it.

Each test runs an owner process (:class:`~lmcache.testing.node_owner.NodeOwner`) and one engine
process besides this one (:class:`~lmcache.testing.node_owner.TierChild`, or an
:class:`~lmcache.cache_engine.LMCacheEngine` in a child).
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lmcache.metrics import LMCacheMetrics
from lmcache.node.client import NodeClient
from lmcache.testing.node_owner import (
    CHUNK_SHAPE,
    NodeOwner,
    TierChild,
    check_chunks,
    chunk_bytes,
    chunk_keys,
    python_child,
    store_chunks,
)
from lmcache.tiers.node_tier import NodeTier

CHUNK = math.prod(CHUNK_SHAPE) * 2  # bytes of one test chunk (a multiple of 256)


@pytest.fixture
def owner(tmp_path: Path) -> Iterator[NodeOwner]:
    with NodeOwner(tmp_path / "node", 64 * CHUNK) as running:
        yield running


def _tier(folder: Path) -> NodeTier:
    tier = NodeTier(NodeClient(folder, budget_bytes=0, autostart=False), LMCacheMetrics())
    assert tier.client.connect(10.0)
    return tier


def test_a_second_process_reads_what_the_first_stored(owner: NodeOwner) -> None:
    child = TierChild(owner.folder)
    try:
        assert child.ask("store 1 8") == "8"
        tier = _tier(owner.folder)
        held: list = []
        assert check_chunks(tier, 1, 8, held) == 8  # verified and bit-identical
        assert tier.metrics.value("checksum_failures") == 0
        arena = tier.client._arena
        assert arena is not None
        lo, hi = arena.data.data_ptr(), arena.data.data_ptr() + arena.data.numel()
        assert all(lo <= lease.tensor.data_ptr() < hi for lease in held)  # the shared bytes
        for lease in held:
            lease.release()
        run = tier.get_many([*chunk_keys(1, 8), *chunk_keys(3, 1)])  # one request: the run
        assert [lease.tensor.view(torch.int16).tolist() for lease in run] == [
            chunk_bytes(1, i).view(torch.int16).tolist() for i in range(8)
        ]
        for lease in run:
            lease.release()
        assert store_chunks(tier, 2, 4) == 4  # and the other way round
        assert child.ask("check 2 4") == "4"
        assert tier.missing(chunk_keys(3, 2)) == [0, 1]
        stats = tier.stats()
        assert stats is not None and stats.entries == 12 and stats.used_bytes == 12 * CHUNK
    finally:
        child.kill()


def test_corrupted_bytes_are_a_counted_miss_and_dropped(owner: NodeOwner) -> None:
    child = TierChild(owner.folder)
    try:
        assert child.ask("store 4 2") == "2"
    finally:
        child.kill()
    tier = _tier(owner.folder)
    lease = tier.get(chunk_keys(4, 2)[1])
    assert lease is not None
    lease.tensor.reshape(-1).view(torch.uint8)[100] ^= 0xFF  # what a stray writer would do
    lease.release()
    run = tier.get_many(chunk_keys(4, 2))  # the run stops before the bad chunk
    assert len(run) == 1 and torch.equal(run[0].tensor, chunk_bytes(4, 0))
    run[0].release()
    assert tier.metrics.value("checksum_failures") == 1
    assert tier.missing(chunk_keys(4, 2)) == [1]  # dropped; its prefix stays
    assert store_chunks(tier, 4, 2) == 2  # stored again
    lease = tier.get(chunk_keys(4, 2)[1])
    assert lease is not None
    lease.tensor.reshape(-1).view(torch.uint8)[7] ^= 0x01
    lease.release()
    assert tier.get(chunk_keys(4, 2)[1]) is None  # a single get verifies too
    assert tier.metrics.value("checksum_failures") == 2


def test_eviction_keeps_prefixes_across_processes(owner: NodeOwner) -> None:
    """Budget 64 chunks: a child stores two 24-chunk chains, this process a 32-chunk one (16
    must go). The oldest chain loses its tail only: what is left of each is a prefix."""
    child = TierChild(owner.folder)
    try:
        assert child.ask("store 10 24") == "24"
        assert child.ask("store 11 24") == "24"
        tier = _tier(owner.folder)
        assert store_chunks(tier, 12, 32) == 32
        assert tier.metrics.value("evicted_chunks") == 16
        for seed, n in ((10, 24), (11, 24), (12, 32)):
            absent = tier.missing(chunk_keys(seed, n))
            assert absent == list(range(n - len(absent), n)), (seed, absent)  # a prefix stays
        assert len(tier.missing(chunk_keys(10, 24))) == 16  # the least recent chain paid
        assert tier.missing(chunk_keys(11, 24)) == []
        hold = child.ask("hold 11 24")  # the child leases chain 11: it cannot be evicted
        assert hold == "24"
        assert store_chunks(tier, 13, 24) == 24
        assert tier.missing(chunk_keys(11, 24)) == []  # held by the child: kept
        assert len(tier.missing(chunk_keys(10, 24))) == 24  # the LRU chain went first
        assert tier.missing(chunk_keys(12, 32)) == list(range(16, 32))  # then chain 12's tail
    finally:
        child.kill()


_ENGINE_CHILD = """
import sys, torch
from lmcache.cache_engine import LMCacheEngine
from lmcache.config import LMCacheConfig
from lmcache.gpu_connector.interface import EngineInfo, TransferSpec
from lmcache.metadata import LMCacheMetadata
from lmcache.metrics import LMCacheMetrics
from lmcache.testing import PagedCPUConnector
from lmcache.tiers import process_cpu_tier

folder, action, *runs = sys.argv[1:]
CS, LAYERS, HEADS, HEAD, SLOTS = 4, 2, 2, 4, 64
gen = torch.Generator().manual_seed(7)
src = [torch.randn(SLOTS, 1, HEADS * HEAD * 2, generator=gen).to(torch.bfloat16)
       for _ in range(LAYERS)]
tokens = torch.randint(0, 50_000, (40,), generator=torch.Generator().manual_seed(3))
slots = torch.arange(40)
for run in runs:  # one engine per "salt:model"
    salt, model = run.split(":")
    config = LMCacheConfig(chunk_size=CS, node_cache=True, node_cache_dir=folder,
                           node_cache_autostart=False, cache_salt=salt)
    metadata = LMCacheMetadata(model, 1, 0, 0, 1, torch.bfloat16, LAYERS, HEADS, HEAD, HEAD,
                               chunk_size=CS)
    dst = [torch.full_like(s, float("nan")) for s in src]
    caches = src if action == "store" else dst
    connector = PagedCPUConnector(config, metadata,
                                  EngineInfo("mock", "cpu", caches, extra={"page_size": 1}))
    metrics = LMCacheMetrics()
    engine = LMCacheEngine(config, metadata, connector, metrics=metrics,
                           tier=process_cpu_tier(config, metrics))
    if action == "store":
        print(engine.store(tokens, None, TransferSpec(slots)))
        continue
    hit = engine.lookup(tokens)
    loaded = int(engine.retrieve(tokens, None, TransferSpec(slots)).sum())
    same = all(torch.equal(d[:loaded].view(torch.int16), s[:loaded].view(torch.int16))
               for d, s in zip(dst, src))
    untouched = all(bool(d[loaded:40].isnan().all()) for d in dst)
    print(hit, loaded, same and untouched)
"""


def _engines(folder: Path, action: str, *runs: str) -> list[str]:
    child = python_child(_ENGINE_CHILD, str(folder), action, *runs)
    out, _ = child.communicate(timeout=120)
    assert child.returncode == 0, out
    return out.strip().splitlines()[-len(runs) :]


@pytest.mark.skipif(sys.platform != "linux", reason="the node cache needs Linux")
def test_engines_share_by_salt_and_model_only(owner: NodeOwner) -> None:
    assert _engines(owner.folder, "store", "tenant-a:test/model") == ["40"]
    # engines of another process: the same model and salt load all 40 tokens, bit-identical;
    # another salt or another model (fingerprint) hit nothing and leave the cache untouched
    runs = ("tenant-a:test/model", "tenant-b:test/model", "tenant-a:test/other-model")
    assert _engines(owner.folder, "load", *runs) == ["40 40 True", "0 0 True", "0 0 True"]


def test_clear_remove_and_orphans_across_processes(owner: NodeOwner) -> None:
    child = TierChild(owner.folder)
    try:
        assert child.ask("store 6 3") == "3"  # owner b"child"
    finally:
        child.kill()
    tier = _tier(owner.folder)
    assert store_chunks(tier, 7, 2, owner=b"mine") == 2
    assert len(tier) == 5
    six = chunk_keys(6, 3)
    assert tier.remove(six[1]) and not tier.remove(six[1])
    assert tier.is_orphan(six[2]) and not tier.is_orphan(six[0])  # its parent went
    tier.clear(owner=b"child")  # one engine's clear drops its own chunks only
    assert tier.missing(six) == [0, 1, 2] and tier.missing(chunk_keys(7, 2)) == []
    tier.clear()
    assert len(tier) == 0


def test_threads_of_one_process_share_a_client_safely(owner: NodeOwner) -> None:
    """An engine calls its tier from several threads (scheduler lookups, stores, loads): every
    chunk read is whole, and once they are done no lease is left behind."""
    tier = _tier(owner.folder)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            for _ in range(15):
                assert store_chunks(tier, seed, 4) == 4  # 16 chunks of 4 threads fit the budget
                assert check_chunks(tier, seed, 4) == 4
                run = tier.get_many(chunk_keys(seed, 4))
                for lease, i in zip(run, range(4), strict=False):
                    assert torch.equal(lease.tensor, chunk_bytes(seed, i))
                    lease.release()
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(20 + t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    assert tier.metrics.value("checksum_failures") == 0
    stats = tier.stats()
    assert stats is not None and stats.entries == 16
    deadline = time.monotonic() + 5
    while (
        (stats := tier.stats()) is not None and stats.leased_blocks and time.monotonic() < deadline
    ):
        time.sleep(0.02)  # the last releases go out with the flusher (10 ms)
    assert stats is not None and stats.leased_blocks == 0


def test_stats_command_prints_the_owners_counters(owner: NodeOwner) -> None:
    """``python -m lmcache.node stats`` (the operator's view) answers with the owner's counters,
    the same as a client's own Stats request."""
    import json
    import subprocess

    tier = _tier(owner.folder)
    try:
        expected = tier.stats()
    finally:
        tier.close()
    out = subprocess.run(
        [sys.executable, "-m", "lmcache.node", "stats", "--dir", str(owner.folder)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    printed = json.loads(out.stdout)
    assert expected is not None
    assert printed["budget_bytes"] == expected.budget_bytes == 64 * CHUNK
