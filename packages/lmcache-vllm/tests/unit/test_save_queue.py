# SPDX-License-Identifier: Apache-2.0
"""SaveQueue: copies in order, commits after their copy, fences, failures, draining close."""

from __future__ import annotations

import threading

import pytest

from lmcache_vllm.save_queue import ReadFence, SaveQueue


def test_copies_in_order_commits_after_their_copy():
    q = SaveQueue()
    events: list[str] = []

    def job(name: str):
        def copy():
            events.append(f"copy {name}")
            return lambda: events.append(f"commit {name}")

        return copy

    for name in ("a", "b", "c"):
        q.submit(name, job(name))
    assert q.wait(timeout=5)
    copies = [e for e in events if e.startswith("copy")]
    assert copies == ["copy a", "copy b", "copy c"]
    for name in "abc":
        assert events.index(f"copy {name}") < events.index(f"commit {name}")
    assert q.close()


def test_wait_read_does_not_wait_for_commits():
    """The step fence waits for the pages to be read, not for the checksum + publish."""
    q = SaveQueue()
    commit_gate = threading.Event()
    copied = threading.Event()

    def copy():
        copied.set()
        return lambda: commit_gate.wait(5)

    q.submit("r", copy)
    assert q.wait_read(timeout=5) == [] and copied.is_set()
    assert not q.wait(timeout=0.2)  # the commit is still blocked
    commit_gate.set()
    assert q.wait(timeout=5)
    assert q.close()


def test_wait_read_waits_for_a_running_copy():
    q = SaveQueue()
    gate = threading.Event()
    q.submit("slow", lambda: (gate.wait(5), None)[1])
    assert q.wait_read(timeout=0.2) is None
    gate.set()
    assert q.wait_read(timeout=5) == []
    assert q.close()


def test_a_copy_that_releases_its_fence_early_hands_back_its_event_once():
    """A deferred copy releases its fence (with the event its pages are read after) while
    it still runs: the fence returns at once, with that event, and never again."""
    q = SaveQueue()
    gate = threading.Event()
    fence = ReadFence()
    marker = object()  # stands for the CUDA event

    def copy():
        fence.release(marker)
        gate.wait(5)  # the rest of the job (its transfer) still runs
        return None

    q.submit("early", copy, fence)
    assert q.wait_read(timeout=5) == [marker]
    assert q.wait_read(timeout=5) == []  # handed out once
    assert not q.wait(timeout=0.1)  # the job itself is still running
    gate.set()
    assert q.wait(timeout=5)
    assert q.close()


def test_a_failing_copy_releases_its_fence():
    q = SaveQueue()

    def bad():
        raise RuntimeError("device error")

    q.submit("bad", bad)
    assert q.wait_read(timeout=5) == []
    assert q.close()


def test_failures_are_dropped_and_the_threads_survive(caplog):
    q = SaveQueue()
    ran: list[str] = []

    def bad_copy():
        raise RuntimeError("device error")

    def bad_commit():
        def commit():
            raise OSError("tier error")

        return commit

    q.submit("x", bad_copy)
    q.submit("y", bad_commit)
    q.submit("z", lambda: lambda: ran.append("z"))
    assert q.wait(timeout=5)
    assert ran == ["z"]
    assert "save of request x failed" in caplog.text and "save of request y failed" in caplog.text
    assert q.close()


def test_close_drains_then_refuses():
    q = SaveQueue()
    ran: list[int] = []
    for i in range(20):
        q.submit(f"r{i}", lambda i=i: lambda: ran.append(i))
    assert q.close(timeout=10)
    assert sorted(ran) == list(range(20))
    with pytest.raises(RuntimeError, match="after close"):
        q.submit("late", lambda: None)
