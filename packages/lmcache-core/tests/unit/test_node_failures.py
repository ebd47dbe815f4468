# SPDX-License-Identifier: Apache-2.0
"""Failures of real processes around a node cache: an engine SIGKILLed while holding leases, an
owner SIGKILLed or stopped, an owner restarted under writers that had not committed.

Nothing is lost and nothing stalls: leases of a dead engine are reclaimed, a dead owner turns
node cache calls into misses without an exception or a wait, a new owner starts a new generation
and never serves a chunk of the previous one (written or half-written). Time limits in these
tests are hang detectors (seconds), not speed checks.
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
import torch

from lmcache.metrics import LMCacheMetrics
from lmcache.node.client import NodeClient
from lmcache.node.wire import StatsReply
from lmcache.testing.node_owner import (
    CHUNK_SHAPE,
    NodeOwner,
    TierChild,
    check_chunks,
    chunk_bytes,
    chunk_keys,
    store_chunks,
)
from lmcache.tiers.cpu_tier import tensor_checksum
from lmcache.tiers.node_tier import NodeTier

CHUNK = math.prod(CHUNK_SHAPE) * 2
T = TypeVar("T")


@pytest.fixture
def owner(tmp_path: Path) -> Iterator[NodeOwner]:
    with NodeOwner(tmp_path / "node", 16 * CHUNK, grace_s=5.0) as running:
        yield running


def _tier(folder: Path) -> NodeTier:
    tier = NodeTier(NodeClient(folder, budget_bytes=0, autostart=False), LMCacheMetrics())
    assert tier.client.connect(10.0)
    return tier


def _until(probe: Callable[[], T], done: Callable[[T], bool], within: float = 15.0) -> T:
    deadline = time.monotonic() + within
    while True:
        value = probe()
        if done(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def _stats(tier: NodeTier) -> StatsReply:
    stats = tier.stats()
    assert stats is not None
    return stats


def test_leases_of_a_sigkilled_engine_are_reclaimed(owner: NodeOwner) -> None:
    child = TierChild(owner.folder)
    tier = _tier(owner.folder)
    try:
        assert child.ask("store 1 4") == "4"
        assert child.ask("hold 1 4") == "4"  # leases on 4 committed chunks
        assert child.ask("alloc 12") == "16"  # and 12 blocks it never commits: the arena is full
        assert tier.allocate_many(CHUNK_SHAPE, torch.bfloat16, 1) == []  # all leased
        assert _stats(tier).leased_blocks == 16
    finally:
        child.kill()  # SIGKILL: no goodbye
    stats = _until(lambda: _stats(tier), lambda s: s.leased_blocks == 0)
    assert stats.leased_blocks == 0 and stats.entries == 4  # its committed chunks stay...
    assert stats.used_bytes == 4 * CHUNK  # ...and the blocks it never committed are free
    assert check_chunks(tier, 1, 4) == 4
    leases = tier.allocate_many(CHUNK_SHAPE, torch.bfloat16, 12)
    assert len(leases) == 12 and tier.metrics.value("evicted_chunks") == 0
    for lease in leases:
        lease.release()


def test_a_killed_owner_means_quick_misses_then_a_clean_new_generation(owner: NodeOwner) -> None:
    tier = _tier(owner.folder)
    keys = chunk_keys(1, 4)
    assert store_chunks(tier, 1, 4) == 4
    held = tier.get(keys[0])  # a lease across the crash
    (writing,) = tier.allocate_many(CHUNK_SHAPE, torch.bfloat16, 1)  # filled, not committed
    writing.tensor.copy_(chunk_bytes(9, 0))
    old_generation = tier.client._arena.generation if tier.client._arena else ""
    owner.kill()  # SIGKILL

    calls: list[tuple[str, Callable[[], object], object]] = [
        ("missing", lambda: tier.missing(keys), [0, 1, 2, 3]),
        ("get", lambda: tier.get(keys[1]), None),
        ("allocate", lambda: tier.allocate_many(CHUNK_SHAPE, torch.bfloat16, 2), []),
        ("contains", lambda: tier.contains(keys[0]), False),
        ("put", lambda: tier.put(b"w" * 16, writing, tensor_checksum(writing.tensor)), None),
        ("touch", lambda: tier.touch_many(keys), 0),
    ]
    for name, call, expected in calls * 3:
        start = time.monotonic()
        assert call() == expected, name
        assert time.monotonic() - start < 2.0, f"{name} waited on a dead owner"
    assert held is not None  # bytes leased before the crash stay readable
    assert torch.equal(held.tensor.view(torch.int16), chunk_bytes(1, 0).view(torch.int16))

    owner.start()
    absent = _until(lambda: tier.missing(keys), lambda m: tier.client.connected)
    assert tier.client.connected and tier.client._arena is not None
    assert tier.client._arena.generation not in ("", old_generation)
    assert absent == [0, 1, 2, 3]  # a new owner starts clean: nothing of the old arena
    tier.put(b"w" * 16, writing, tensor_checksum(writing.tensor))  # the old writer commits late
    assert tier.missing([b"w" * 16]) == [0]  # skipped: a half-written chunk is never served
    assert len(list(owner.folder.glob("arena-*.bin"))) == 1  # the old arena file is gone
    held.release()  # releases of the old generation are dropped quietly
    writing.release()
    assert store_chunks(tier, 1, 4) == 4 and check_chunks(tier, 1, 4) == 4  # hits again
    assert _stats(tier).leased_blocks == 0


def test_an_uncommitted_block_of_a_writer_is_never_served(owner: NodeOwner) -> None:
    """A writer holds blocks it has not committed when its owner restarts; it fills and commits
    them afterwards. No process ever sees them: the new owner never leased those bytes."""
    child = TierChild(owner.folder)
    tier = _tier(owner.folder)
    keys = chunk_keys(5, 2)
    try:
        assert child.ask("alloc 2") == "2"
        assert tier.missing(keys) == [0, 1]  # allocated is not stored
        owner.kill()
        owner.start()
        assert child.ask("commit 5") == "2"  # late commits of the old generation's blocks
        assert _until(lambda: tier.missing(keys), lambda m: tier.client.connected) == [0, 1]
        assert _until(lambda: child.ask("store 5 2"), lambda out: out == "2") == "2"
        assert check_chunks(tier, 5, 2) == 2  # a fresh store of the same keys is whole
    finally:
        child.kill()


def test_a_stopped_owner_costs_one_timeout_and_resumes_the_session(owner: NodeOwner) -> None:
    tier = _tier(owner.folder)
    assert store_chunks(tier, 2, 2) == 2
    held = tier.get(chunk_keys(2, 2)[0])
    assert held is not None
    owner.proc.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
    try:
        start = time.monotonic()
        assert tier.missing(chunk_keys(2, 2)) == [0, 1]  # the call times out: a miss
        assert time.monotonic() - start < 3.0
        start = time.monotonic()
        assert tier.get(chunk_keys(2, 2)[1]) is None  # backing off: no wait at all
        assert time.monotonic() - start < 0.5
    finally:
        owner.proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
    assert _until(lambda: tier.missing(chunk_keys(2, 2)), lambda m: m == []) == []
    assert _stats(tier).leased_blocks == 1  # the session resumed: its lease is still counted
    held.release()
    assert _until(lambda: _stats(tier).leased_blocks, lambda n: n == 0) == 0


def test_each_arena_generation_is_pinned_until_its_last_lease_goes(owner: NodeOwner) -> None:
    """On a GPU machine every engine page-locks its arena mapping through the device backend
    (here a recording stand-in for CUDA); a previous generation's mapping is unpinned only once
    no lease on its bytes remains."""
    from lmcache.testing.recording_backend import RecordingBackend

    backend = RecordingBackend("cuda")
    client = NodeClient(owner.folder, budget_bytes=0, autostart=False, backend=backend)
    tier = NodeTier(client, LMCacheMetrics())
    assert client.connect(10.0) and client._arena is not None
    first = client._arena.data
    assert backend.registered == {first.data_ptr(): owner.budget_bytes}
    assert store_chunks(tier, 3, 1) == 1
    held = tier.get(chunk_keys(3, 1)[0])
    assert held is not None
    owner.kill()
    owner.start()
    _until(lambda: tier.missing(chunk_keys(3, 1)), lambda m: client.connected)
    assert client._arena is not None and client._arena.pinning is not None
    client._arena.pinning.join()  # a reconnect pins on a thread
    second = client._arena.data
    assert set(backend.registered) == {first.data_ptr(), second.data_ptr()}  # old one leased
    held.release()
    assert set(backend.registered) == {second.data_ptr()}
    tier.close()
    assert backend.registered == {}


def test_engines_starting_at_once_leave_one_owner_which_exits_when_idle(tmp_path: Path) -> None:
    folder = tmp_path / "node"
    a = NodeClient(folder, budget_bytes=1 << 20, autostart=True, idle_exit_s=1.0)
    b = NodeClient(folder, budget_bytes=2 << 20, autostart=True, idle_exit_s=1.0)
    a.starter.start(folder, a.budget_bytes, a.idle_exit_s)  # both find no owner: start one
    b.starter.start(folder, b.budget_bytes, b.idle_exit_s)
    children = a.starter.children + b.starter.children
    assert len(children) == 2
    assert a.connect(20.0) and b.connect(20.0)
    assert a.welcome is not None and b.welcome is not None
    assert a.welcome.generation == b.welcome.generation  # one owner serves both
    assert a.welcome.budget_bytes in (1 << 20, 2 << 20)
    assert a.budget_bytes == b.budget_bytes == a.welcome.budget_bytes  # the owner's budget
    loser = _until(lambda: [c.poll() for c in children], lambda codes: 0 in codes, 20.0)
    assert sorted(code is None for code in loser) == [False, True]  # the other exited, status 0
    assert 0 in loser
    a.close()
    b.close()
    survivor = next(c for c in children if c.returncode is None)
    assert survivor.pid == a.welcome.owner_pid
    assert survivor.wait(20) == 0  # no engine for 1 s: it exits, removing its files
    assert not list(folder.glob("arena-*.bin")) and not (folder / "node.sock").exists()
